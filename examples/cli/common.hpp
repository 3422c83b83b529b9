// Shared pieces of the kimik3 command-line program: exit codes, usage errors, argument helpers.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <system_error>
#include <new>
#include <vector>

#include "../../kimik3.hpp"
#include "sizes.hpp"

namespace kimik3::cli {

// Exit codes (the same for every command).
constexpr int kExitOk = 0;       // done
constexpr int kExitRuntime = 1;  // a failure while computing
constexpr int kExitUsage = 2;    // a bad argument, or a config/checkpoint refused
constexpr int kExitBudget = 3;   // a memory budget below the floor
constexpr int kExitRead = 4;     // a weight read failed: no tokens are printed after it

// A usage error: main prints the message (which ends with the command's usage text) and exits 2.
struct Usage : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// What a program prints for an exception that is not one of ours: what ran out, when something did (a
// thread that cannot start says only "Resource temporarily unavailable").
inline std::string describe_exception(const std::exception& e) {
    if (dynamic_cast<const std::bad_alloc*>(&e)) return std::string("out of memory (") + e.what() + ")";
    if (const auto* se = dynamic_cast<const std::system_error*>(&e); se && se->code() == std::errc::resource_unavailable_try_again)
        return std::string("a thread could not start: ") + e.what() + " (out of memory, or the limit on processes)";
    return e.what();
}

inline bool wants_help(const std::vector<std::string>& args) {
    for (const std::string& a : args)
        if (a == "--help" || a == "-h") return true;
    return false;
}

// 1234567 -> "1,234,567"
inline std::string thousands(std::uint64_t v) {
    std::string s = std::to_string(v), out;
    for (std::size_t i = 0; i < s.size(); ++i) {
        if (i && (s.size() - i) % 3 == 0) out += ',';
        out += s[i];
    }
    return out;
}

// Options of the form --name VALUE: returns VALUE and removes both from args; "" when absent.
inline std::string take_option(std::vector<std::string>& args, const std::string& name, const char* usage) {
    for (std::size_t i = 0; i < args.size(); ++i)
        if (args[i] == name) {
            if (i + 1 >= args.size()) throw Usage(name + " needs a value\n\n" + usage);
            std::string v = args[i + 1];
            args.erase(args.begin() + long(i), args.begin() + long(i) + 2);
            return v;
        }
    return "";
}

// A flag without a value: true (and removed from args) when present.
inline bool take_flag(std::vector<std::string>& args, const std::string& name) {
    for (std::size_t i = 0; i < args.size(); ++i)
        if (args[i] == name) {
            args.erase(args.begin() + long(i));
            return true;
        }
    return false;
}

// A non-negative integer option value up to `max`, or a usage error naming the option.
inline long long parse_count(const std::string& s, const std::string& name, const char* usage, long long max = 1ll << 40) {
    char* end = nullptr;
    errno = 0;
    const long long v = std::strtoll(s.c_str(), &end, 10);
    if (s.empty() || *end != '\0' || v < 0 || errno == ERANGE) throw Usage(name + ": '" + s + "' is not a non-negative integer\n\n" + usage);
    if (v > max) throw Usage(name + ": " + s + " is more than " + std::to_string(max) + "\n\n" + usage);
    return v;
}

// A real option value in [lo, hi], or a usage error naming the option.
inline float parse_real(const std::string& s, const std::string& name, const char* usage, float lo, float hi) {
    char* end = nullptr;
    errno = 0;
    const float v = std::strtof(s.c_str(), &end);
    const bool overflow = errno == ERANGE && std::fabs(v) > 1.0f;  // an underflow (1e-45: a subnormal, 1e-50: 0) is a number
    if (s.empty() || *end != '\0' || overflow || !(v >= lo && v <= hi)) {
        char range[64];
        std::snprintf(range, sizeof range, "%g to %g", double(lo), double(hi));
        throw Usage(name + ": '" + s + "' is not a number from " + range + "\n\n" + usage);
    }
    return v;
}

// --threads N: 1 to 4096 worker threads (0 would silently mean "the default"; 2^32 + 1 would wrap).
inline int parse_threads(const std::string& s, const char* usage) {
    const long long n = parse_count(s, "--threads", usage, 4096);
    if (n < 1) throw Usage("--threads: must be at least 1\n\n" + std::string(usage));
    return int(n);
}

// An output file (--out, --dump-logits, --trace-experts) must be writable before the first weight is
// read, not found unwritable after the whole run: where the writer will write (write_target: a symlink's
// target, a device in place; a directory, a block device or a dangling link refused), and, for a file, a
// temporary file created and removed again next to it. A missing folder or a read-only place is a usage
// error.
inline void require_writable(const std::string& path, const std::string& option, const char* usage) {
    if (path.empty()) return;
    try {
        const WriteTarget t = write_target(path);
        if (t.device) return;  // /dev/stdout, /dev/null, a pipe: opened when written
        UniqueTemp probe(t);     // removed at once
    } catch (const Error& e) {
        std::string why = e.what();
        if (const std::size_t at = why.rfind(": "); at != std::string::npos && why.find("cannot create") != std::string::npos) why = why.substr(at + 2);
        else if (why.rfind(path + ": ", 0) == 0) why = why.substr(path.size() + 2);
        throw Usage(option + ": cannot write '" + path + "': " + why + "\n\n" + usage);
    }
}

// --think-effort: the three values K3's encoder accepts (encoding_k3.py), or "none" (no thinking-effort message).
inline std::string parse_think_effort(const std::string& s, const char* usage) {
    if (s.empty()) return "max";  // the release's default
    if (s == "none") return "";
    if (s != "low" && s != "high" && s != "max")
        throw Usage("--think-effort: '" + s + "' is not one of low, high, max, none\n\n" + usage);
    return s;
}

// The most positions --context, --gen or --max-new may ask for (2^31: far past any model's window, and
// far from overflowing the plan's arithmetic).
constexpr long long kMaxPositions = 1ll << 31;

// --budget SIZE or --preset NAME (or neither: the auto preset) in bytes; --budget floor is the model's
// own floor (kBudgetFloor, resolved by the planner). 0 is refused here: inside the engine it means
// "everything resident, no budget".
inline std::uint64_t budget_bytes(const std::string& budget, const std::string& preset, const char* usage) {
    if (!budget.empty() && !preset.empty()) throw Usage(std::string("give --budget or --preset, not both\n\n") + usage);
    const std::uint64_t b = budget.empty() ? preset_bytes(preset.empty() ? "auto" : preset)
                            : budget == "floor" ? kBudgetFloor : parse_size(budget);
    if (b == 0) throw Usage("--budget: '" + budget + "' is no memory at all\n\n" + usage);
    return b;
}

// Shown before any weight is read: the plan, and a refusal when it would not fit in available memory
// (better than running into the out-of-memory killer halfway through loading).
inline void show_and_check_plan(const Plan& plan, const Config& config) {
    std::fprintf(stderr, "%s", describe_plan(plan, config).c_str());
    const std::uint64_t avail = mem_available();
    if (avail && plan.total() > avail / 100 * 95)
        fail(ErrorKind::budget, "the plan needs " + human_bytes(double(plan.total())) + ", more than 95% of the " +
                                    human_bytes(double(avail)) + " available: lower --budget");
}

}  // namespace kimik3::cli
