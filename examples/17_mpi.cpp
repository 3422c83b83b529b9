// Chapter 17 example: the little K3 over MPI ranks, the same bits as one process. How rows and experts
// are shared out, a greedy generation at the floor budget over the job's ranks against the same
// generation with the splits removed, one step's messages against the count from the config, and the
// full K3's projected seconds per token on 1-16 machines.
//   make run-17                                  one rank (MPI started without mpirun)
//   mpirun -np 3 build/g++/examples/17_mpi       three ranks: the same transcript (rank 0 prints)
// Built with mpicxx; the rank count and what this rank received go to stderr.
#include <fcntl.h>
#include <unistd.h>

#include <cstdio>

#include "../chapters/14_tokenizer.hpp"
#include "../chapters/17_mpi.hpp"

#ifndef KIMIK3_SOURCE_DIR
#define KIMIK3_SOURCE_DIR "."
#endif

using namespace kimik3;

int main(int argc, char** argv) {
    MpiJob job(&argc, &argv);
    if (job.rank() != 0) {  // rank 0 alone prints; the others compute their shares
        const int null = open("/dev/null", O_WRONLY);
        dup2(null, 1), close(null);
    }
    try {
        std::printf("17.1 a matrix's output rows over N ranks: rank r computes rows [R r / N, R (r+1) / N)\n");
        for (const auto& [R, N] : {std::pair{10, 3}, std::pair{7168, 8}, std::pair{2, 3}}) {
            std::printf("  R = %-5d N = %d:", R, N);
            for (int r = 0; r < N; ++r) {
                const Share sh = rank_share(std::size_t(R), r, N);
                std::printf(" [%zu, %zu)", sh.begin, sh.end);
            }
            std::printf("%s\n", R < N ? "   (a rank may own none)" : "");
        }
        std::printf("\n17.3 each (layer, expert) has one owner, (expert + layer) mod N; N = 3, experts 0-7:\n");
        for (int layer = 1; layer <= 3; ++layer) {
            std::printf("  layer %d:", layer);
            for (int e = 0; e < 8; ++e) std::printf(" %d", expert_owner(layer, e, 3));
            std::printf("\n");
        }

        const std::string dir = std::string(KIMIK3_SOURCE_DIR) + "/fixtures/little-k3";
        const Tokenizer tok = Tokenizer::load(dir);
        const std::vector<std::uint32_t> enc = tok.encode("She opened the door and saw");
        const std::vector<std::int64_t> prompt(enc.begin(), enc.end());
        ModelOptions floor;
        floor.budget = kBudgetFloor;  // every matrix streamed: each rank reads, then computes its rows
        auto quiet = [](std::size_t, std::int64_t) {};
        RowSplit* rows = row_split();
        ExpertSplit* experts = expert_split();
        row_split() = nullptr, expert_split() = nullptr;  // the single-process engine
        Model alone_model(dir, floor);
        const Generation alone = generate_greedy(alone_model, prompt, 16, kPrefillChunk, false, 64, quiet);
        row_split() = rows, expert_split() = experts;
        Model model(dir, floor);
        const Generation spread = generate_greedy(model, prompt, 16, kPrefillChunk, false, 64, quiet);
        // Every rank compares its own copy; the job agrees only if every rank does (an integer minimum).
        int same = spread.ids == alone.ids && spread.logits == alone.logits, all_same = 0;
        MPI_Allreduce(&same, &all_same, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
        auto text = [&](const std::vector<std::int64_t>& ids) { return tok.decode_text(std::vector<std::uint32_t>(ids.begin(), ids.end())); };
        std::printf("\n17.2-17.3 the little K3 at the floor budget (one process: %s; each rank: its share's floor), greedy, over the job's ranks\n",
                    human_bytes(double(alone_model.plan.budget)).c_str());
        std::printf("  \"%s\" continues: \"%s\"\n", text(prompt).c_str(), text(spread.ids).c_str());
        std::printf("  tokens and all %zu rows of logits against one process with no split: %s on every rank\n", spread.ids.size(),
                    all_same ? "bit-identical" : "DIFFERENT");

        Session s(model.config, 64);  // one decode step's messages
        std::vector<float> logits(std::size_t(model.config.vocab_size));
        const MpiStats before = job.stats();
        forward(logits.data(), model, s, std::span<const std::int64_t>(prompt.data(), 1));
        const MpiStats after = job.stats();
        const MpiTraffic t = mpi_traffic(model.config);
        std::printf("  one decode step: %llu collectives, %llu floats gathered (mpi_traffic from the config: %llu, %llu)\n",
                    (unsigned long long)(after.collectives - before.collectives), (unsigned long long)(after.floats_gathered - before.floats_gathered),
                    (unsigned long long)t.collectives, (unsigned long long)t.floats);
        std::fprintf(stderr, "rank %d of %d: received %llu of those floats, %.4f s in MPI\n", job.rank(), job.ranks(),
                     (unsigned long long)(after.floats_received - before.floats_received), after.seconds - before.seconds);

        const Config k3 = load_config(std::string(KIMIK3_SOURCE_DIR) + "/fixtures/k3-release/config.json");
        std::printf("\n17.5 the full K3 on N machines of 24 GB (each pins 1/N of the trunk, caches what fits of its experts)\n%s",
                    describe_cost(k3, config_census(k3)).c_str());
        std::printf("  (seconds per token; the assumptions are in chapter 17's top block)\n");
        std::fflush(stdout);
        return all_same ? 0 : 1;
    } catch (const std::exception& e) {
        job.abort(e.what(), 2);
    }
}
