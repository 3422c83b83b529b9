// Example for chapter 12: what the planner keeps resident and what it streams (the real K3 from its
// config alone, and the little K3); then the ring and its reader thread at work on two of the little
// K3's matrices, piece by piece; then the whole little K3 at its floor, every matrix streamed, giving
// the same tokens and logits as with everything resident.
//   make run-12
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <thread>

#include "../kimik3.hpp"

#ifndef KIMIK3_SOURCE_DIR
#define KIMIK3_SOURCE_DIR "."
#endif

using namespace kimik3;

static void table(const Config& c, const Census& s, const std::vector<std::pair<const char*, std::uint64_t>>& budgets) {
    std::printf("  %-8s %10s %8s %9s %5s %10s %8s %12s %12s\n", "budget", "floor", "pinned", "lm_head", "ring", "chunk", "experts",
                "trunk/token", "expected");
    for (const auto& [name, bytes] : budgets) {
        const Plan p = make_plan(c, s, bytes, PlanOptions{});
        if (p.budget < p.floor) {
            std::printf("  %-8s %10s  refused: below the floor\n", name, human_bytes(double(p.floor)).c_str());
            continue;
        }
        std::printf("  %-8s %10s %5d/%-2d %9s %5d %10s %8zu %12s %12s\n", name, human_bytes(double(p.floor)).c_str(), p.pinned_layers(),
                    c.num_hidden_layers, p.lm_head_pinned ? "pinned" : "streamed", p.ring_slots, human_bytes(double(p.chunk_bytes)).c_str(),
                    p.expert_slots, human_bytes(double(p.trunk_read_per_token)).c_str(), human_bytes(double(p.total())).c_str());
    }
}

// Every read of the ring goes through chapter 01's pread hook: it records who read (the reader thread or
// the consumer, this program's main thread) and counts the reader's completed reads.
static std::thread::id g_main;
static std::atomic<int> g_reader_reads{0}, g_consumer_reads{0};
static ssize_t counting_pread(int fd, void* buf, std::size_t n, off_t off) {
    const ssize_t got = ::pread(fd, buf, n, off);
    (std::this_thread::get_id() == g_main ? g_consumer_reads : g_reader_reads) += 1;
    return got;
}

int main() {
    try {
        const std::string root = KIMIK3_SOURCE_DIR, dir = root + "/fixtures/little-k3";
        std::printf("12.2 the real Kimi K3 (planned from fixtures/k3-release/config.json, 4096-token context)\n");
        const Config k3 = load_config(root + "/fixtures/k3-release/config.json");
        const Census s3 = config_census(k3);
        std::printf("  trunk %s in 93 layers (largest %s), lm_head %s, KDA state %s, MLA cache %s per position\n",
                    human_bytes(double(s3.trunk_bytes)).c_str(), human_bytes(double(s3.largest_layer_bytes)).c_str(),
                    human_bytes(double(s3.lm_head_bytes)).c_str(), human_bytes(double(s3.kda_state_bytes)).c_str(),
                    human_bytes(double(s3.mla_cache_bytes_per_token)).c_str());
        const std::uint64_t G = 1'000'000'000, M = 1'000'000;
        table(k3, s3, {{"floor", kBudgetFloor}, {"8G", 8 * G}, {"32G", 32 * G}, {"128G", 128 * G}});
        std::printf("  (more memory pins the largest units first: every pinned byte is a byte not read per token)\n");

        std::printf("\n12.2 the little K3 (fixtures/little-k3: 9 layers, 14 M parameters; 4096-token context)\n");
        const Config little = load_config(dir);
        const Census sl = config_census(little);
        table(little, sl, {{"10M", 10 * M}, {"floor", kBudgetFloor}, {"20M", 20 * M}, {"24M", 24 * M}, {"28M", 28 * M}, {"64M", 64 * M}});

        // 12.3 the ring, alone: layer 1's q_proj and k_proj [192, 192] bf16 in pieces of 48 rows (18 kB),
        // 3 slots, one reader thread. The consumer computes y = W x piece by piece; after each piece it
        // waits until the reader has filled every free slot, so what it prints does not depend on timing.
        Checkpoint ck(dir);
        const ModelTensors m = bind_tensors(ck, little);
        const Checkpoint::Ref* mats[2] = {m.layers[1].q_proj, m.layers[1].k_proj};
        const std::size_t rows_per_piece = 48, slots = 3;
        Fd fd = open_read(mats[0]->file->path());
        const PieceSource src{fd.get(), -1, &mats[0]->file->path()};
        std::vector<Piece> schedule;
        for (std::uint32_t i = 0; i < 2; ++i) {
            const TensorInfo& t = *mats[i]->info;
            const std::size_t row_bytes = std::size_t(t.shape[1]) * 2;
            for (std::uint32_t c = 0; c * rows_per_piece < std::size_t(t.shape[0]); ++c)
                schedule.push_back(Piece{i, c, t.file_offset + c * rows_per_piece * row_bytes, rows_per_piece * row_bytes, &src});
        }
        const std::size_t N = schedule.size(), D = std::size_t(little.hidden_size);
        std::printf("\n12.3 the ring: %zu slots, one reader thread; a step reads layer 1's q_proj and k_proj in %zu pieces of %zu rows\n",
                    slots, N, rows_per_piece);
        std::vector<float> x(D), y(D), want[2] = {std::vector<float>(D), std::vector<float>(D)};
        for (std::size_t j = 0; j < D; ++j) x[j] = float(j % 7) - 3.0f;
        for (int i = 0; i < 2; ++i) {  // y = W x with the whole matrix resident, for comparison
            const Tensor t = ck.read(mats[i]->info->name);
            linear(want[i].data(), x.data(), 1, MatrixRef{t.bytes.data(), nullptr, D, D});
        }
        g_main = std::this_thread::get_id();
        detail::pread_hook = counting_pread;
        bool same = true;
        {
            PieceRing ring(int(slots), rows_per_piece * D * 2, true, 1);
            for (int step = 0; step < 3; ++step) {
                const int consumer_before = g_consumer_reads;
                const std::uint64_t ready_before = ring.stats().prefetched;
                for (std::size_t k = 0; k < N; ++k) {
                    const std::size_t global = std::size_t(step) * N + k;
                    const int consumer_had = g_consumer_reads;
                    const std::byte* bytes = ring.acquire(schedule[k]);
                    const bool read_here = g_consumer_reads > consumer_had;
                    const std::uint32_t mat = schedule[k].matrix, r0 = schedule[k].chunk * std::uint32_t(rows_per_piece);
                    linear(&y[r0], x.data(), 1, MatrixRef{bytes, nullptr, rows_per_piece, D});  // this piece's rows of y = W x
                    // From step 1 on the reader reads the schedule in order, one piece behind the consumer's
                    // start: its n-th read is piece N + 1 + n. While piece `global` is in use it fills the
                    // two other slots, so it has read everything up to global + 2.
                    const int due = step == 0 ? 0 : int(global + slots - 1) - int(N);
                    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
                    while (g_reader_reads < due && std::chrono::steady_clock::now() < deadline)
                        std::this_thread::sleep_for(std::chrono::microseconds(200));
                    if (step == 1 && k == 0) std::printf("  step 1, piece by piece:\n");
                    if (step == 1)
                        std::printf("  piece %zu (%s rows %3u-%3u): %-24s while it is computed the reader reads ahead to piece %zu%s\n",
                                    k, mat == 0 ? "q_proj" : "k_proj", r0, r0 + unsigned(rows_per_piece) - 1,
                                    read_here ? "read now by the consumer;" : "ready in the ring;", (k + slots - 1) % N,
                                    k + slots - 1 >= N ? " of the next step" : "");
                    ring.release(schedule[k]);
                    if (k + 1 == N / 2 || k + 1 == N)  // a matrix is complete: check it against the resident one
                        same = same && std::memcmp(y.data(), want[mat].data(), D * sizeof(float)) == 0;
                }
                const RingStats st = ring.stats();
                std::printf("  step %d: %llu of %zu pieces were ready in the ring when asked for; the consumer read %d itself%s\n", step,
                            (unsigned long long)(st.prefetched - ready_before), N, g_consumer_reads - consumer_before,
                            step == 0 ? " (the reader learns the schedule during the first step)" : "");
            }
            const RingStats st = ring.stats();
            std::printf("  reads aimed at a slot in use: %llu; pieces read ahead and then not wanted: %llu\n",
                        (unsigned long long)st.busy_slot_reads, (unsigned long long)st.mismatches);
        }
        detail::pread_hook = ::pread;
        std::printf("  (the reader fills only free slots: while piece k is in use the ring holds k, k+1 and k+2, and the\n"
                    "   slot of k is read again only after the consumer releases it; chapter 12's test 12.3)\n");
        std::printf("  y = W x from the pieces, bit-identical to the resident matrices: %s\n", same ? "yes" : "NO");

        // 12.5 the whole model at its floor: every matrix streams through the ring, the reader works ahead
        // of the forward pass, and nothing changes a bit.
        const std::vector<std::int64_t> prompt = {65, 3808, 401, 362, 704, 1111, 471, 325, 260, 623, 1940, 762};  // held-out text
        ModelOptions at_floor;
        at_floor.budget = kBudgetFloor;
        Model streamed(dir, at_floor), resident(dir, ModelOptions{});
        const Plan& p = streamed.plan;
        std::printf("\n12.5 the little K3 at its floor (%s): %d of %d layers pinned, lm_head %s, a ring of %d x %s,\n"
                    "     %s of trunk read per token; 16 greedy tokens after a 12-token held-out prompt\n",
                    human_bytes(double(p.budget)).c_str(), p.pinned_layers(), little.num_hidden_layers, p.lm_head_pinned ? "pinned" : "streamed",
                    p.ring_slots, human_bytes(double(p.chunk_bytes)).c_str(), human_bytes(double(p.trunk_read_per_token)).c_str());
        auto quiet = [](std::size_t, std::int64_t) {};
        RingStats first;
        std::size_t steps = 0;
        const auto t0 = std::chrono::steady_clock::now();
        const Generation a = generate(streamed, prompt, 16, 32, false, 64, [](std::span<const float> l) { return argmax(l.data(), l.size()); },
                                      [&](std::size_t, std::int64_t) {
                                          if (steps++ == 0) first = streamed.trunk().ring_stats();
                                          return true;
                                      });
        const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        const Generation b = generate_greedy(resident, prompt, 16, 32, false, 64, quiet);
        const RingStats all = streamed.trunk().ring_stats();
        std::printf("  step 0 (the prompt): %llu pieces, %llu ready ahead: the reader is learning the schedule\n",
                    (unsigned long long)first.pieces, (unsigned long long)first.prefetched);
        std::printf("  steps 1-15: the reader follows the schedule and reads ahead (how far ahead depends on timing: stderr)\n");
        std::printf("  tokens the same as with everything resident: %s; logits bit-identical: %s\n", a.ids == b.ids ? "yes" : "NO",
                    a.logits.size() == b.logits.size() && std::memcmp(a.logits.data(), b.logits.data(), a.logits.size() * 4) == 0 ? "yes" : "NO");
        std::fprintf(stderr, "  [floor run: %.3f s for 16 tokens; after step 0, %llu of %llu pieces were ready when asked (%.0f%%), "
                             "the consumer waited %.3f s in all]\n",
                     seconds, (unsigned long long)(all.prefetched - first.prefetched), (unsigned long long)(all.pieces - first.pieces),
                     100.0 * double(all.prefetched - first.prefetched) / double(std::max<std::uint64_t>(1, all.pieces - first.pieces)),
                     all.wait_seconds);
    } catch (const Error& e) {
        std::fprintf(stderr, "error: %s\n", e.what());
        return 2;
    }
    return 0;
}
