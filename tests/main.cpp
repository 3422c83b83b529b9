// The one main() shared by every chapter's test binary.
//
// doctest runs the cases; a listener prints one machine-readable line at the end of the run,
// "kimik3-tests: <binary> P passed, F failed, S skipped", which tests/run.sh adds up across chapters
// into the final "N passed, N failed, N skipped" line of `make test`. S counts the kernel checks this
// machine cannot run (tests/check.hpp's test::skip: a kernel for an instruction set the CPU lacks or
// the architecture cannot compile, once per test case and kernel) and any test case doctest skipped.
// A binary that crashes prints no such line, and the runner counts it as a failure, so a segfault can
// never look like a pass.
//
// It also makes parallel_rows split every job, however small (see main()).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>
#include <string>

#include "../chapters/00a_isa.hpp"

namespace kimik3::test {
int& skipped_count() {
    static int n = 0;
    return n;
}
std::string& current_test_name() {
    static std::string name;
    return name;
}
const std::string& current_test() { return current_test_name(); }
}  // namespace kimik3::test

namespace {
struct CountingListener : doctest::IReporter {
    explicit CountingListener(const doctest::ContextOptions& opts) : opts_(opts) {}
    void report_query(const doctest::QueryData&) override {}
    void test_run_start() override {}
    void test_run_end(const doctest::TestRunStats& s) override {
        if (opts_.no_run) return;
        const unsigned ran = s.numTestCasesPassingFilters;
        std::printf("kimik3-tests: %s %u passed, %u failed, %d skipped\n", opts_.binary_name.c_str(),
                    ran - s.numTestCasesFailed, s.numTestCasesFailed, kimik3::test::skipped_count());
        std::fflush(stdout);
    }
    void test_case_start(const doctest::TestCaseData& tc) override { kimik3::test::current_test_name() = tc.m_name; }
    void test_case_reenter(const doctest::TestCaseData&) override {}
    void test_case_end(const doctest::CurrentTestCaseStats&) override {}
    void test_case_exception(const doctest::TestCaseException&) override {}
    void subcase_start(const doctest::SubcaseSignature&) override {}
    void subcase_end() override {}
    void log_assert(const doctest::AssertData&) override {}
    void log_message(const doctest::MessageData&) override {}
    void test_case_skipped(const doctest::TestCaseData& tc) override {
        if (!tc.m_skip) return;  // filtered out by the command line: not a skip
        ++kimik3::test::skipped_count();
        std::printf("skipped: \"%s\" (doctest::skip)\n", tc.m_name);
    }

  private:
    const doctest::ContextOptions& opts_;
};
}  // namespace

REGISTER_LISTENER("kimik3-count", 1, CountingListener);

int main(int argc, char** argv) {
    // Split every job across the threads, however small: the claims "the same bits at 1 and 2 threads"
    // are then tested on the tiny model's matrices too (test 0.8 checks that the split happens).
    kimik3::parallel_min_work() = 1;
    doctest::Context context(argc, argv);
    return context.run();
}
