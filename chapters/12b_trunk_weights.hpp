// kimik3 chapter 12, APPENDIX B: trunk_weights -- carrying out a plan: the weights the forward pass reads.
// ====================================================================================================
//
// APPENDIX to chapter 12 (12_trunk_stream.hpp, section 12.5 in its index). The lesson decides what is
// resident and streams pieces through a ring; this binds a plan to the files: it reads at start what
// the plan keeps resident (small tensors, pinned layers, maybe the embedding), keeps small tensors
// widened to f32, gives every other matrix a stream over the ring, and reads embedding rows on demand.
// Chapter 13's forward pass sees only its interface: vec(), matrix(), lm_head(), embed_row().
//
// CONTRACT
//   * Where a weight comes from (resident, streamed, shard or trunk.bin, O_DIRECT or buffered) never
//     changes a bit of it: resident and streamed matrices hand the kernels the same bytes.
//   * Every small tensor is checked finite once, when loaded (a NaN norm would poison every token).
//   * A read is exact (appendix 01a) or an Error(io); a token id outside the vocabulary is Error(usage).
//
// USES     chapter 12 (Plan, PieceRing, Piece), appendix 12a (TrunkLayout, Progress), chapter 04
//          (MatrixRef, RowStream, widen), appendix 01a (pread_exact, detail::pread_direct)
// TEST     make test-12   (tests "12.5 ...") and chapter 13's invariance gates
// ====================================================================================================
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "12_trunk_stream.hpp"
#include "12a_pack_trunk.hpp"  // APPENDIX: TrunkLayout (a packed trunk), Progress

namespace kimik3 {

// ---------------------------------------------------------------------------------------------------
// 12.5 The trunk's weights: small tensors, pinned and streamed matrices, the embedding
// ---------------------------------------------------------------------------------------------------
// How a bound matrix tensor's elements are stored, for the kernels (chapter 04, 4.5): the release's
// BF16, or F16/F32 from a checkpoint saved at another precision (chapter 02 binds no other dtype).
inline WeightType weight_type(const TensorInfo& t) {
    if (t.dtype == DType::BF16) return WeightType::bf16;
    if (t.dtype == DType::F16) return WeightType::f16;
    if (t.dtype == DType::F32) return WeightType::f32;
    fail(ErrorKind::format, "tensor '" + t.name + "': dtype " + dtype_name(t.dtype) + " is not a matrix dtype (BF16, F16, F32)");
}

// The rows of a matrix that this process holds and computes: all of them (no function), or an MPI rank's
// share (chapter 17). The plan and the trunk's loader count and load those rows only.
using RowsOf = std::function<RowRange(const Checkpoint::Ref&)>;

// The rows of each matrix this process computes: with chapter 17's row split installed (one MPI rank of
// several), every matrix the forward pass multiplies through `linear`, at the rank's rows; MLA's
// kv_b_proj, read by the absorbed form's own kernels, whole (the embedding is never split).
inline RowsOf process_rows(const ModelTensors& m, const RowSplit* split) {
    if (!split) return {};
    std::set<const TensorInfo*> whole;
    for (const LayerTensors& lt : m.layers)
        if (lt.kv_b_proj) whole.insert(lt.kv_b_proj->info);
    return [split, whole](const Checkpoint::Ref& r) {
        const std::size_t n = std::size_t(r.info->shape[0]);
        return whole.count(r.info) ? RowRange{0, n} : split->rows(n);
    };
}

// The units of a bound checkpoint, summed as unit_bytes(Config) sums them, with every tensor's real
// dtype (a checkpoint may store F32 or F16), of the rows this process holds (rows_of; none: all).
inline UnitBytes unit_bytes(const ModelTensors& m, const RowsOf& rows_of = {}) {
    auto held = [&](const Checkpoint::Ref* r) {
        const RowRange h = rows_of ? rows_of(*r) : RowRange{0, std::size_t(r->info->shape[0])};
        return std::uint64_t(h.end - h.begin);
    };
    UnitBytes u;
    for (const LayerTensors& lt : m.layers) {
        std::uint64_t mat = 0, small = 0;
        for (const Checkpoint::Ref* r : lt.all) detail::add_unit_tensor(u, mat, small, r->info->dtype, r->info->shape, is_streamable_matrix(*r->info) ? held(r) : 0);
        u.layer_matrix.push_back(mat);
        u.layer_reread.push_back(lt.kv_b_proj ? lt.kv_b_proj->info->nbytes() : 0);  // the absorbed MLA reads it twice (chapter 08)
        u.layer_small.push_back(small);
    }
    const TensorInfo& head = *m.lm_head->info;
    const std::uint64_t row = head.nbytes() / std::uint64_t(std::max<std::int64_t>(head.shape[0], 1));
    detail::add_lm_head(u, held(m.lm_head) * row, row);
    return u;
}

// A bound 2-D tensor as the kernels see it, given where its bytes are.
inline MatrixRef matrix_ref(const Checkpoint::Ref* r, const void* bytes) {
    return MatrixRef{bytes, nullptr, std::size_t(r->info->shape[0]), std::size_t(r->info->shape[1]), weight_type(*r->info)};
}

// One streamed matrix: its rows arrive through the ring in pieces of at most chunk_bytes.
class MatrixStream : public RowStream {
  public:
    MatrixStream(PieceRing& ring, std::uint32_t id, const PieceSource* src, std::uint64_t offset, std::size_t rows, std::size_t row_bytes,
                 std::uint64_t chunk_bytes)
        : ring_(ring), id_(id), src_(src), offset_(offset), rows_(rows), row_bytes_(row_bytes),
          chunk_rows_(std::max<std::size_t>(1, std::size_t(chunk_bytes / row_bytes))) {}
    void for_each_chunk(const std::function<void(std::size_t, std::size_t, const void*)>& f) override { read(0, rows_, 0, f); }
    // Rows [b, e) alone (chapter 17: a rank reads only its rows), in pieces from b. Their keys start at
    // chunk 2^31, so that a piece of the range never stands for a piece of the whole; one range per stream.
    bool for_each_chunk_in(std::size_t b, std::size_t e, const std::function<void(std::size_t, std::size_t, const void*)>& f) override {
        if (b == 0 && e == rows_) return read(0, rows_, 0, f), true;
        if (range_.second != 0 && range_ != std::pair{b, e})
            fail(ErrorKind::runtime, "MatrixStream: rows [" + std::to_string(b) + ", " + std::to_string(e) + ") after [" +
                                         std::to_string(range_.first) + ", " + std::to_string(range_.second) + "): one row range per stream");
        range_ = {b, e};
        return read(b, e, 1u << 31, f), true;
    }

  private:
    void read(std::size_t b, std::size_t e, std::uint32_t key0, const std::function<void(std::size_t, std::size_t, const void*)>& f) {
        for (std::size_t r0 = b, c = key0; r0 < e; r0 += chunk_rows_, ++c) {
            const std::size_t r1 = std::min(e, r0 + chunk_rows_);
            const Piece p{id_, std::uint32_t(c), offset_ + r0 * row_bytes_, (r1 - r0) * row_bytes_, src_};
            const std::byte* bytes = ring_.acquire(p);
            struct Release {  // release even if the computation throws
                PieceRing& ring;
                const Piece& p;
                ~Release() { ring.release(p); }
            } release{ring_, p};
            f(r0, r1, bytes);
        }
    }

    PieceRing& ring_;
    std::uint32_t id_;
    const PieceSource* src_;
    std::uint64_t offset_;
    std::size_t rows_, row_bytes_, chunk_rows_;
    std::pair<std::size_t, std::size_t> range_{0, 0};  // the row range read alone, once one was
};

struct TrunkStats {
    std::uint64_t startup_bytes = 0;   // pinned matrices, small tensors, embedding read at start
    std::uint64_t embed_rows = 0;
};

// Gives the forward pass (chapter 13) every non-expert weight as the plan says: small tensors and
// pinned matrices from memory, other matrices streamed through the ring, embedding rows on demand.
class TrunkWeights {
  public:
    // rows_of: the rows of each matrix this process computes (chapter 17's ranks); a pinned matrix is
    // read at those rows only. None: every row.
    TrunkWeights(const ModelTensors& m, const Plan& plan, const TrunkLayout* trunk, bool direct, const Progress& progress = {},
                 const RowsOf& rows_of = {})
        : m_(m), plan_(plan) {
        // sources: every shard (and trunk.bin), buffered + O_DIRECT descriptors
        for (const auto& layer : m.layers)
            for (const Checkpoint::Ref* r : layer.all) source_for(r->file->path());
        for (const Checkpoint::Ref* r : {m.embed, m.lm_head}) source_for(r->file->path());
        if (trunk) trunk_src_ = &source_for(trunk->dir + "/trunk.bin"), trunk_ = trunk;
        if (direct)
            for (auto& [path, s] : sources_) s.direct_fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
        if (plan.ring_slots > 0) ring_ = std::make_unique<PieceRing>(plan.ring_slots, plan.chunk_bytes, plan.ring_slots > 0);
        // what is loaded at start: small tensors of every layer, pinned matrices, maybe the embedding
        std::uint64_t total = 0, done = 0;
        struct Load {
            const Checkpoint::Ref* r;
            bool mat;    // a matrix (else a small tensor, read whole)
            RowRange h;  // a matrix's rows to read
        };
        std::vector<Load> load;
        auto add = [&](const Checkpoint::Ref* r, bool mat) {
            const std::size_t rows = std::size_t(r->info->shape.rank ? r->info->shape[0] : 1);
            const RowRange h = rows_of && mat && r != m.embed ? rows_of(*r) : RowRange{0, rows};
            load.push_back({r, mat, h});
            total += mat ? r->info->nbytes() / rows * (h.end - h.begin) : r->info->nbytes();
        };
        for (std::size_t l = 0; l < m.layers.size(); ++l)
            for (const Checkpoint::Ref* r : m.layers[l].all) {
                const bool mat = is_streamable_matrix(*r->info);
                if (!mat || plan.pinned[l]) add(r, mat);
            }
        for (const Checkpoint::Ref* r : {m.final_norm, m.out_res_norm, m.out_res_proj}) add(r, false);
        if (plan.lm_head_pinned) add(m.lm_head, true);
        if (plan.embed_resident) add(m.embed, true);
        for (auto [r, mat, h] : load) {  // O_DIRECT where possible: no second copy in the page cache
            const std::uint64_t row = mat ? r->info->nbytes() / std::uint64_t(r->info->shape[0]) : 0;
            const std::uint64_t off = where(r).second + h.begin * row, n = mat ? (h.end - h.begin) * row : r->info->nbytes();
            const PieceSource* src = where(r).first;
            const std::uint64_t start = off / kPageAlign * kPageAlign;
            const std::size_t skew = std::size_t(off - start), need = skew + std::size_t(n);
            Resident& res = resident_[r->info];
            res.buf.resize(round_up(need, kPageAlign));
            res.skew = skew, res.held = h;
            if (src->direct_fd < 0 || detail::pread_direct(src->direct_fd, src->fd, res.buf.data(), start, round_up(need, kPageAlign), need, *src->path) == 0)
                pread_exact(src->fd, res.buf.data() + skew, std::size_t(n), off, *src->path);
            res.skew = detail::align_piece(res.buf.data(), skew, std::size_t(n));
            if (!mat) require_finite(*r->info, res.data());  // norms, biases, decay parameters: checked once, here
            done += n;
            if (progress) progress("load", done, total);
        }
        stats_.startup_bytes = total;
        // small tensors are kept widened to f32 (exactly; F32 ones as they are): the forward pass reads
        // every norm, conv tap and bias as f32 whatever dtype the checkpoint chose
        for (auto [r, mat, h] : load) {
            if (mat) continue;
            Resident& res = resident_.at(r->info);
            const std::size_t n = std::size_t(r->info->numel());
            res.f32.resize(n);
            const std::byte* bytes = res.data();
            if (r->info->dtype == DType::F32) {
                if (n) std::memcpy(res.f32.data(), bytes, n * 4);
            } else if (r->info->dtype == DType::BF16 || r->info->dtype == DType::F16) {
                const bool b = r->info->dtype == DType::BF16;
                for (std::size_t i = 0; i < n; ++i) {
                    std::uint16_t h;
                    std::memcpy(&h, bytes + 2 * i, 2);  // any alignment: a data section may start anywhere
                    res.f32[i] = b ? bf16_to_f32(h) : f16_to_f32(h);
                }
            } else {
                fail(ErrorKind::format, "tensor '" + r->info->name + "': dtype " + dtype_name(r->info->dtype) + " is not a float type");
            }
            res.buf = AlignedBuffer();  // the raw bytes are no longer needed
        }
        // one stream per unpinned matrix, ids in layer order
        for (std::size_t l = 0; l < m.layers.size(); ++l)
            if (!plan.pinned[l])
                for (const Checkpoint::Ref* r : m.layers[l].all)
                    if (is_streamable_matrix(*r->info)) add_stream(r);
        if (!plan.lm_head_pinned) add_stream(m.lm_head);
    }
    ~TrunkWeights() {
        // the ring's reader threads may still be reading ahead through these descriptors: stop and join
        // them first (the streams hold references to the ring), then close
        streams_.clear();
        ring_.reset();
        for (auto& [path, s] : sources_)
            if (s.direct_fd >= 0) ::close(s.direct_fd);
    }
    TrunkWeights(const TrunkWeights&) = delete;
    TrunkWeights& operator=(const TrunkWeights&) = delete;

    // A small tensor (norm, AttnRes vector, conv taps, A_log, dt_bias, router bias), widened to f32.
    const float* vec(const Checkpoint::Ref* r) const {
        auto it = resident_.find(r->info);
        if (it == resident_.end() || it->second.f32.size() != std::size_t(r->info->numel()))
            fail(ErrorKind::runtime, "tensor '" + r->info->name + "' is not a resident small tensor");
        return it->second.f32.data();
    }
    MatrixRef matrix(const Checkpoint::Ref* r) const {
        auto it = resident_.find(r->info);
        if (it != resident_.end()) {
            MatrixRef m = matrix_ref(r, it->second.data());
            m.held = it->second.held;
            return m;
        }
        MatrixRef m = matrix_ref(r, nullptr);
        m.stream = streams_.at(r->info).get();
        return m;
    }
    MatrixRef lm_head() const { return matrix(m_.lm_head); }

    // The embedding row of token `id`, widened to f32 (exact, whatever the table's float dtype).
    void embed_row(float* out, std::int64_t id) {  // out (D)
        const std::size_t D = std::size_t(m_.embed->info->shape[1]);
        if (id < 0 || id >= m_.embed->info->shape[0])
            fail(ErrorKind::usage, "token id " + std::to_string(id) + " is outside the vocabulary (" + std::to_string(m_.embed->info->shape[0]) + ")");
        const WeightType type = weight_type(*m_.embed->info);
        const std::size_t row_bytes = D * weight_bytes(type);
        const std::byte* row;
        auto it = resident_.find(m_.embed->info);
        if (it != resident_.end()) {
            row = it->second.data() + std::size_t(id) * row_bytes;
        } else {
            row_.resize(row_bytes);
            const auto [src, off] = where(m_.embed);
            pread_exact(src->fd, row_.data(), row_bytes, off + std::uint64_t(id) * row_bytes, *src->path);
            row = row_.data();
            ++stats_.embed_rows;
        }
        for (std::size_t j = 0; j < D; ++j) out[j] = detail::widen(type, row, j);
    }

    RingStats ring_stats() const { return ring_ ? ring_->stats() : RingStats{}; }
    const TrunkStats& stats() const { return stats_; }

  private:
    PieceSource& source_for(const std::string& path) {
        auto it = sources_.find(path);
        if (it != sources_.end()) return it->second;
        fds_.push_back(open_read(path));
        PieceSource& s = sources_[path];
        s.fd = fds_.back().get();
        s.path = &sources_.find(path)->first;
        return s;
    }
    // The file and absolute offset of a tensor: trunk.bin when packed (layer tensors), else its shard.
    std::pair<const PieceSource*, std::uint64_t> where(const Checkpoint::Ref* r) const {
        if (trunk_) {
            auto it = trunk_->tensor_off.find(r->info->name);
            if (it != trunk_->tensor_off.end()) return {trunk_src_, it->second};
        }
        return {&sources_.at(r->file->path()), r->info->file_offset};
    }
    void add_stream(const Checkpoint::Ref* r) {
        const auto [src, off] = where(r);
        streams_[r->info] = std::make_unique<MatrixStream>(*ring_, std::uint32_t(streams_.size()), src, off,
                                                            std::size_t(r->info->shape[0]), matrix_ref(r, nullptr).row_bytes(), plan_.chunk_bytes);
    }

    const ModelTensors& m_;
    Plan plan_;
    const TrunkLayout* trunk_ = nullptr;
    const PieceSource* trunk_src_ = nullptr;
    std::map<std::string, PieceSource> sources_;
    std::deque<Fd> fds_;
    std::unique_ptr<PieceRing> ring_;
    struct Resident {  // a tensor read at start: its bytes begin `skew` into the (O_DIRECT-aligned) buffer
        AlignedBuffer buf;
        std::size_t skew = 0;
        RowRange held;           // matrices: the rows read (all, or this rank's share)
        std::vector<float> f32;  // small tensors: the values widened to f32 (then buf is released)
        const std::byte* data() const { return buf.data() + skew; }
    };
    std::map<const TensorInfo*, Resident> resident_;
    std::map<const TensorInfo*, std::unique_ptr<MatrixStream>> streams_;
    std::vector<std::byte> row_;
    TrunkStats stats_;
};

}  // namespace kimik3
