// Fuzz target: config.json through the reader, the refusals, the schedule, the census and the memory
// plan (chapters 01, 02 and 12): a config that is accepted must plan without overflow or exhaustion.
#include "../../chapters/12_trunk_stream.hpp"
#include "fuzz.hpp"

void kimik3_fuzz_one(std::string_view input) {
    using namespace kimik3;
    const Config c = parse_config(parse_json(input, "fuzz/config.json"), "fuzz/config.json");
    (void)describe_schedule(c);
    const Census census = config_census(c);
    for (std::uint64_t budget : {std::uint64_t(1) << 30, std::uint64_t(8) << 30, UINT64_MAX / 4}) {
        PlanOptions po;
        po.context = 4096;
        const Plan p = make_plan(c, census, budget, po);
        (void)describe_plan(p, c);
    }
}

std::vector<std::string> kimik3_fuzz_seeds() {
    return {kimik3::fuzz::source_file("fixtures/tiny-k3/config.json"), kimik3::fuzz::source_file("fixtures/k3-release/config.json")};
}
