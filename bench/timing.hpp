// Timing for the benchmarks: every figure they print is a median, since this machine is shared and noisy.
#pragma once

#include <algorithm>
#include <chrono>
#include <fstream>
#include <string>
#include <vector>

namespace kimik3::bench {

inline double now_seconds() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// The median of v (the upper one of the middle two for an even count); 0 for an empty v.
inline double median(std::vector<double> v) {
    if (v.empty()) return 0;
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

// Median wall time of `reps` (at least 1) calls of f, after one untimed warm-up call.
template <class F> double median_seconds(int reps, F&& f) {
    f();
    std::vector<double> t;
    for (int i = 0; i < std::max(1, reps); ++i) {
        const double t0 = now_seconds();
        f();
        t.push_back(now_seconds() - t0);
    }
    return median(std::move(t));
}

// The machine's load (the first three fields of /proc/loadavg): quoted next to every measurement.
inline std::string load_average() {
    std::ifstream f("/proc/loadavg");
    std::string a, b, c;
    f >> a >> b >> c;
    return a + " " + b + " " + c;
}

}  // namespace kimik3::bench
