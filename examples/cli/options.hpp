// Typed options for run, chat and serve: every option is read once, with its type, its range and its
// default in one place, and the groups the three commands share (the model at a budget, sampling,
// speculation) are parsed by the same functions.
//
// The rules, for every option of every command:
//   --name VALUE   the value must be there and must not be empty: `--api-key "$UNSET"` is refused, never
//                  taken as "no key" (an absent option is the only way to ask for the default)
//   given twice    refused (which one was meant?)
//   unknown        refused, with the usage text
//   a flag         --name without a value
// Values are read before flags (Options::text and the typed readers, then Options::flag), so that a
// value that looks like a flag (`--system --think`) is the value.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "common.hpp"

namespace kimik3::cli {

class Options {
  public:
    Options(std::vector<std::string> args, const char* usage) : args_(std::move(args)), usage_(usage) {}
    const char* usage() const { return usage_; }
    [[noreturn]] void refuse(const std::string& why) const { throw Usage(why + "\n\n" + usage_); }

    // --name VALUE, or nothing when the option is absent.
    std::optional<std::string> text(const std::string& name) {
        std::optional<std::string> v;
        for (std::size_t i = 0; i < args_.size();) {
            if (args_[i] != name) {
                ++i;
                continue;
            }
            if (v) refuse(name + " is given twice");
            if (i + 1 >= args_.size()) refuse(name + " needs a value");
            v = args_[i + 1];
            if (v->empty()) refuse(name + ": the value is empty (leave the option out for its default)");
            args_.erase(args_.begin() + long(i), args_.begin() + long(i) + 2);
        }
        return v;
    }
    // A non-negative integer from `lo` to `hi`.
    std::optional<std::uint64_t> count(const std::string& name, std::uint64_t lo, std::uint64_t hi) {
        const std::optional<std::string> s = text(name);
        if (!s) return std::nullopt;
        const std::uint64_t v = std::uint64_t(parse_count(*s, name, usage_, (long long)std::min<std::uint64_t>(hi, 1ull << 62)));
        if (v < lo) refuse(name + " must be at least " + std::to_string(lo));
        return v;
    }
    // Any 64-bit unsigned integer (seeds).
    std::optional<std::uint64_t> u64(const std::string& name) {
        const std::optional<std::string> s = text(name);
        if (!s) return std::nullopt;
        char* end = nullptr;
        errno = 0;
        const unsigned long long v = std::strtoull(s->c_str(), &end, 10);
        if (*end != '\0' || errno == ERANGE || (*s)[0] == '-' || (*s)[0] == '+' || (*s)[0] == ' ')
            refuse(name + ": '" + *s + "' is not an integer from 0 to 18446744073709551615");
        return std::uint64_t(v);
    }
    std::optional<float> real(const std::string& name, float lo, float hi) {
        const std::optional<std::string> s = text(name);
        if (!s) return std::nullopt;
        return parse_real(*s, name, usage_, lo, hi);
    }
    // One of `choices`.
    std::optional<std::string> choice(const std::string& name, const std::vector<std::string>& choices) {
        const std::optional<std::string> s = text(name);
        if (!s) return std::nullopt;
        for (const std::string& c : choices)
            if (*s == c) return s;
        std::string list;
        for (const std::string& c : choices) list += (list.empty() ? "" : ", ") + c;
        refuse(name + ": '" + *s + "' is not one of " + list);
    }
    bool flag(const std::string& name) {
        bool seen = false;
        for (std::size_t i = 0; i < args_.size();) {
            if (args_[i] != name) {
                ++i;
                continue;
            }
            if (seen) refuse(name + " is given twice");
            seen = true;
            args_.erase(args_.begin() + long(i));
        }
        return seen;
    }
    // What is left: exactly `n` positional arguments, no option.
    std::vector<std::string> positional(std::size_t n, const std::string& what) {
        for (const std::string& a : args_)
            if (a.size() > 1 && a[0] == '-') refuse("unknown option '" + a + "'");
        if (args_.size() != n) refuse(args_.empty() ? "needs " + what : args_.size() < n ? "needs " + what : "unexpected argument '" + args_[n] + "'");
        return args_;
    }

  private:
    std::vector<std::string> args_;
    const char* usage_;
};

// --budget SIZE | --preset NAME, --context N, --trunk DIR, --no-direct, --threads N: the model at a budget.
struct ModelArgs {
    std::uint64_t budget = 0;
    std::optional<std::uint64_t> context;  // absent: the command's own default
    std::string trunk;
    bool direct = true;
    int threads = 0;  // 0: the default (all cores, or OMP_NUM_THREADS)
};
inline ModelArgs model_args(Options& o) {
    ModelArgs m;
    const std::optional<std::string> budget = o.text("--budget"), preset = o.text("--preset");
    m.budget = budget_bytes(budget.value_or(""), preset.value_or(""), o.usage());
    m.context = o.count("--context", 1, std::uint64_t(kMaxPositions));
    m.trunk = o.text("--trunk").value_or("");
    if (const auto t = o.text("--threads")) m.threads = parse_threads(*t, o.usage());
    m.direct = !o.flag("--no-direct");
    return m;
}

// --temperature T, --top-k K, --top-p P, --seed S (temperature 0, the default, is greedy).
inline SamplingParams sampling_args(Options& o) {
    SamplingParams sp;
    sp.temperature = o.real("--temperature", 0.0f, 100.0f).value_or(0.0f);
    sp.top_k = int(o.count("--top-k", 0, 1u << 30).value_or(0));
    sp.top_p = o.real("--top-p", 0.0f, 1.0f).value_or(1.0f);
    sp.seed = o.u64("--seed").value_or(0);
    return sp;
}

// --speculate N: 1 to 32 drafted tokens per step (absent: 0, one token per step).
inline std::size_t speculate_arg(Options& o) { return std::size_t(o.count("--speculate", 1, 32).value_or(0)); }

// --think [--think-effort E]: the chat format's thinking, and its effort message (see parse_think_effort).
struct ThinkArgs {
    bool think = false;
    std::string effort = "max";
};
inline ThinkArgs think_args(Options& o) {
    ThinkArgs t;
    const std::optional<std::string> effort = o.choice("--think-effort", {"low", "high", "max", "none"});
    t.think = o.flag("--think");
    if (effort && !t.think) o.refuse("--think-effort needs --think");
    t.effort = parse_think_effort(effort.value_or(""), o.usage());
    return t;
}

}  // namespace kimik3::cli
