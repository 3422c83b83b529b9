// kimik3 chapter 15, APPENDIX C: sessions on disk (15.8) -- a conversation saved and resumed.
// ====================================================================================================
//
// APPENDIX to chapter 15 (15_generate.hpp). Chapter 15's Chat holds a conversation: the token history,
// every layer's state (the KDA states, the MLA latent caches) and the tokens the next turn feeds first.
// This appendix writes that to a file and reads it back, so `kimik3 chat`'s /save and /load resume a
// conversation in a fresh process with bit-identical logits. What it teaches is how little of a file
// can be trusted: everything is checked before a byte of state is used.
//
// THE FORMAT (version 2; little-endian)
//   "KIMIK3SS" | u32 version | u64 config fingerprint | u64 n | n x i64 history | u64 m | m x i64 pending
//   | per KDA layer: KdaState::save | per MLA layer: MlaCache::save (n positions)
//   | u64 model fingerprint | u64 checksum
//   config fingerprint  the dimensions the state's shape depends on: a file from a model of another
//                       shape is refused before any count in it is believed.
//   model fingerprint   the model's identity: every field of its config (routing's top-k, scaling, the
//                       gate's bound, ...) and every tensor header of its shards (names, dtypes, shapes,
//                       byte ranges, metadata). A file from another model of the same shape (top-2 instead
//                       of top-4 routing, a checkpoint with other tensors) is refused: its states are
//                       another model's. Not covered: a fine-tune that keeps every header byte for byte
//                       (telling it apart means reading every weight, a full pass over the checkpoint).
//   checksum            FNV-1a 64 of every byte before it. A flip of any one byte (any number of its
//                       bits) always changes it (each step of FNV-1a is a bijection of the state); a
//                       damaged file is refused, never loaded as garbage that fails a turn later.
//
// CONTRACT  The order of the checks: magic, version, config fingerprint, every count against the model,
//   the context and the file's length (before anything is allocated), the checksum, the model
//   fingerprint, every id inside the vocabulary, every state finite and one MLA position per token of
//   history. Each refusal is an ErrorKind::format naming the file and what is wrong.
//
// USES     chapter 15 (Chat), chapters 07/08 (KdaState, MlaCache save/load), 13 (Model), 14 (fnv1a64),
//          appendix 01b (the atomic writer).
// TEST     make test-15   (tests "15.8 ...")
// ====================================================================================================
#pragma once

#include <cstring>
#include <sstream>
#include <string>
#include <string_view>
#include <tuple>

#include "01b_writer.hpp"
#include "15_generate.hpp"

namespace kimik3 {

// ---------------------------------------------------------------------------------------------------
// 15.8 Sessions on disk
// ---------------------------------------------------------------------------------------------------
inline std::uint64_t config_fingerprint(const Config& c) {
    std::ostringstream o;
    o << c.hidden_size << ' ' << c.num_hidden_layers << ' ' << c.vocab_size << ' ' << c.schedule_string() << ' ' << c.kda_num_heads
      << ' ' << c.kda_head_dim << ' ' << c.short_conv_kernel_size << ' ' << c.num_attention_heads << ' ' << c.kv_lora_rank << ' '
      << c.qk_rope_head_dim << ' ' << c.num_experts << ' ' << c.moe_intermediate_size << ' ' << c.routed_expert_hidden_size;
    return fnv1a64(o.str());
}

// Every field of the config (floats by their bits) and every tensor header of every shard.
inline std::uint64_t model_fingerprint(const Config& c, const Checkpoint& ck) {
    std::ostringstream o;
    auto f = [&](float x) { o << std::bit_cast<std::uint32_t>(x) << ' '; };
    o << c.bos_token_id << ' ' << c.eos_token_id << ' ' << c.pad_token_id << ' ' << c.hidden_size << ' ' << c.num_hidden_layers << ' '
      << c.vocab_size << ' ' << c.num_attention_heads << ' ' << c.q_lora_rank << ' ' << c.kv_lora_rank << ' ' << c.qk_nope_head_dim << ' '
      << c.qk_rope_head_dim << ' ' << c.v_head_dim << ' ' << c.kda_num_heads << ' ' << c.kda_head_dim << ' ' << c.short_conv_kernel_size << ' '
      << c.intermediate_size << ' ' << c.first_k_dense_replace << ' ' << c.moe_layer_freq << ' ' << c.num_experts << ' '
      << c.num_experts_per_token << ' ' << c.num_shared_experts << ' ' << c.moe_intermediate_size << ' ' << c.routed_expert_hidden_size
      << ' ' << c.moe_renormalize << ' ' << c.latent_moe_use_norm << ' ' << c.attn_res_block_size << ' ' << c.schedule_string() << ' ';
    f(c.rms_norm_eps), f(c.gate_lower_bound), f(c.situ_beta), f(c.situ_linear_beta), f(c.routed_scaling_factor);
    for (int l : c.kda_layers) o << 'k' << l;
    for (int l : c.full_attn_layers) o << 'f' << l;
    for (const auto& shard : ck.shards()) {
        o << "\nshard";
        for (const auto& [k, v] : shard->header().metadata) o << ' ' << k << '=' << v;
        for (const TensorInfo& t : shard->tensors()) o << '\n' << t.name << ' ' << dtype_name(t.dtype) << ' ' << t.shape.str() << ' ' << t.begin << ' ' << t.end;
    }
    return fnv1a64(o.str());
}
inline std::uint64_t model_fingerprint(const Model& m) { return model_fingerprint(m.config, m.checkpoint); }

inline constexpr char kSessionMagic[8] = {'K', 'I', 'M', 'I', 'K', '3', 'S', 'S'};
inline constexpr std::uint32_t kSessionVersion = 2;
inline constexpr std::size_t kSessionTrailer = 16;  // model fingerprint, checksum

// The checksum of a session file's bytes (all but its last 8) written into its last 8. save_chat seals
// every file; tests and the fuzzer reseal files they edit on purpose, to reach the checks after it.
inline void seal_session(std::string& bytes) {
    if (bytes.size() < 8) return;
    const std::uint64_t sum = fnv1a64(std::string_view(bytes).substr(0, bytes.size() - 8));
    std::memcpy(bytes.data() + bytes.size() - 8, &sum, 8);
}

inline std::string session_bytes(const Config& config, const Chat& chat, std::uint64_t identity) {
    std::ostringstream out(std::ios::binary);
    auto u64 = [&](std::uint64_t v) { out.write(reinterpret_cast<const char*>(&v), 8); };
    out.write(kSessionMagic, 8);
    out.write(reinterpret_cast<const char*>(&kSessionVersion), 4);
    u64(config_fingerprint(config));
    for (const auto* ids : {&chat.session.tokens, &chat.pending}) {
        u64(ids->size());
        out.write(reinterpret_cast<const char*>(ids->data()), std::streamsize(ids->size() * 8));
    }
    for (const auto& k : chat.session.kda)
        if (k) k->save(out);
    for (const auto& m : chat.session.mla)
        if (m) m->save(out);
    u64(identity);
    u64(0);  // the checksum, sealed below
    std::string bytes = out.str();
    seal_session(bytes);
    return bytes;
}

inline void save_chat(const std::string& path, const Model& model, const Chat& chat) {
    SafetensorsWriter::write_text_atomic(path, session_bytes(model.config, chat, model_fingerprint(model)));
}

// Reading one back trusts nothing: every count is checked against the model and against the file's
// own length before anything is allocated (a file claiming 2^32 tokens is 36 bytes long, and is refused
// as such), the file must end exactly where its trailer does, its checksum and the model's identity
// must match, every id must be in the vocabulary, every MLA cache must hold one position per token of
// history, and every saved number must be finite (a NaN in a state would fail the next turn, or worse,
// propagate into every later one).
namespace detail {
struct MemoryStreamBuf : std::streambuf {  // an istream over bytes already in memory
    MemoryStreamBuf(const char* p, std::size_t n) { setg(const_cast<char*>(p), const_cast<char*>(p), const_cast<char*>(p) + n); }
};
}  // namespace detail

// The most bytes a session of this model at this context can take: what load_chat reads at most.
inline std::uint64_t max_session_bytes(const Config& c, std::size_t context) {
    const KdaDims k = KdaDims::from(c);
    const std::uint64_t kda = 24 + 4 * (3 * (k.conv - 1) * k.width() + k.heads * k.head_dim * k.head_dim);  // KdaState::save
    const std::uint64_t mla = 24 + 4 * std::uint64_t(context) * MlaDims::from(c).cache_width();            // MlaCache::save, full
    return 36 + 16 * std::uint64_t(context) + std::uint64_t(c.count(AttnKind::KDA)) * kda + std::uint64_t(c.count(AttnKind::MLA)) * mla +
           kSessionTrailer;
}

inline void parse_chat(std::string_view bytes, const std::string& path, const Config& config, std::uint64_t identity, Chat& chat) {
    auto bad = [&](const std::string& what) { fail(ErrorKind::format, path + ": " + what); };
    auto u64_at = [&](std::size_t at) {
        std::uint64_t v = 0;
        std::memcpy(&v, bytes.data() + at, 8);
        return v;
    };
    if (bytes.size() < 20 || std::memcmp(bytes.data(), kSessionMagic, 8) != 0) bad("not a kimik3 session file");
    std::uint32_t version = 0;
    std::memcpy(&version, bytes.data() + 8, 4);
    if (version != kSessionVersion)
        bad("session format version " + std::to_string(version) + ", this program reads " + std::to_string(kSessionVersion) +
            (version == 1 ? " (version 1 files carry no checksum or model identity: save the conversation again)" : ""));
    if (u64_at(12) != config_fingerprint(config)) bad("the session was made for a different model (config fingerprint differs)");
    // the counts, each against the context and the file's length, before any allocation
    if (bytes.size() < 28) bad("the session file is truncated (" + std::to_string(bytes.size()) + " bytes, in the header)");
    const std::uint64_t n = u64_at(20), ctx = chat.context;
    if (n > ctx) bad("the history holds " + std::to_string(n) + " tokens, more than this chat's context of " + std::to_string(ctx));
    if (bytes.size() < 36 + 8 * n) bad("the session file is truncated (" + std::to_string(bytes.size()) + " bytes, in the token history)");
    const std::uint64_t m = u64_at(28 + 8 * n);
    if (m > ctx - n) bad(std::to_string(m) + " pending tokens do not fit the context after " + std::to_string(n) + " of history");
    Chat fresh(config, chat.context);
    fresh.options = chat.options;
    const std::uint64_t states = 36 + 8 * (n + m);
    std::uint64_t want = states;
    for (const auto& k : fresh.session.kda)
        if (k) want += 24 + k->bytes();
    for (const auto& c : fresh.session.mla)
        if (c) want += 24 + n * c->width() * 4;
    const std::uint64_t end = want;  // where the states end and the trailer begins
    want += kSessionTrailer;
    if (bytes.size() != want)
        bad("is " + std::to_string(bytes.size()) + " bytes, but a session of " + std::to_string(n) + " tokens for this model is " +
            std::to_string(want) + (bytes.size() < want ? ": the file is truncated" : ": trailing bytes after the last layer's state"));
    // the whole content, then whose it is
    if (u64_at(end + 8) != fnv1a64(bytes.substr(0, end + 8)))
        bad("the session file is damaged: its checksum does not match its content (a changed byte, or a partial copy)");
    if (u64_at(end) != identity)
        bad("the session was made for another model of the same shape (its routing, its scaling or its tensors differ: the model "
            "fingerprint does not match)");
    // the ids, each inside the vocabulary
    for (auto [ids, count, at, what] : {std::tuple{&fresh.session.tokens, n, std::size_t(28), "history"},
                                        std::tuple{&fresh.pending, m, std::size_t(36 + 8 * n), "pending tokens"}}) {
        ids->resize(std::size_t(count));
        if (count) std::memcpy(ids->data(), bytes.data() + at, std::size_t(count) * 8);
        for (std::size_t i = 0; i < ids->size(); ++i)
            if ((*ids)[i] < 0 || (*ids)[i] >= config.vocab_size)
                bad(std::string(what) + " token " + std::to_string(i) + " is id " + std::to_string((*ids)[i]) + ", outside the vocabulary (" +
                    std::to_string(config.vocab_size) + ")");
    }
    // every layer's state: checked and finite (KdaState::load, MlaCache::load), one position per token
    detail::MemoryStreamBuf buf(bytes.data() + states, end - states);
    std::istream in(&buf);
    try {
        for (auto& k : fresh.session.kda)
            if (k) k->load(in);
        for (auto& c : fresh.session.mla)
            if (c) {
                c->load(in);
                if (c->length() != n)
                    bad("MLA layer " + std::to_string(c->layer()) + " holds " + std::to_string(c->length()) + " positions for " +
                        std::to_string(n) + " tokens of history");
            }
    } catch (const Error& e) {
        if (e.kind == ErrorKind::format && std::string(e.what()).rfind(path, 0) == 0) throw;
        bad("the session file is corrupt (" + std::string(e.what()) + ")");
    }
    chat = std::move(fresh);
}

inline void load_chat(const std::string& path, const Model& model, Chat& chat) {
    parse_chat(read_file_capped(path, max_session_bytes(model.config, chat.context), "session of this model and context"), path, model.config,
               model_fingerprint(model), chat);
}

}  // namespace kimik3
