// Shared pieces of the kimik3 command-line program: exit codes, usage errors, argument helpers.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include "../../kimik3.hpp"

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

// A non-negative integer option value, or a usage error naming the option.
inline long long parse_count(const std::string& s, const std::string& name, const char* usage) {
    char* end = nullptr;
    const long long v = std::strtoll(s.c_str(), &end, 10);
    if (s.empty() || *end != '\0' || v < 0) throw Usage(name + ": '" + s + "' is not a non-negative integer\n\n" + usage);
    return v;
}

}  // namespace kimik3::cli
