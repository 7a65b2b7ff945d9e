#include "divergence.h"

#include <algorithm>
#include <cmath>
#include <thread>
#include <vector>

namespace river {

namespace {

// The row's first highest entry and its log-sum-exp, in double.
struct RowStats {
    int64_t top;
    double lse;
};

RowStats row_stats(const float* x, int64_t n) {
    int64_t top = 0;
    for (int64_t v = 1; v < n; ++v) if (x[v] > x[top]) top = v;
    const double m = x[top];
    double s = 0;
    for (int64_t v = 0; v < n; ++v) s += std::exp(double(x[v]) - m);
    return {top, m + std::log(s)};
}

}  // namespace

void divergence_rows(const float* reference, const int32_t* targets, int64_t n_rows, int64_t n_vocab,
                     const DivergenceOutput* configs, int64_t n_configs, int n_threads) {
    auto run = [&](int64_t first, int64_t last) {
        // P(v) of the row, shared by every configuration: the exp is most of a row's work, and
        // the same value in each configuration's sum keeps every result what a call of its own gives.
        std::vector<double> prob(static_cast<size_t>(n_vocab));
        for (int64_t r = first; r < last; ++r) {
            const float* p = reference + r * n_vocab;
            const RowStats sp = row_stats(p, n_vocab);
            for (int64_t v = 0; v < n_vocab; ++v) prob[v] = std::exp(double(p[v]) - sp.lse);
            for (int64_t c = 0; c < n_configs; ++c) {
                const DivergenceOutput& out = configs[c];
                const float* q = out.logits + r * n_vocab;
                const RowStats sq = row_stats(q, n_vocab);
                double d = 0;
                for (int64_t v = 0; v < n_vocab; ++v) {
                    const double pv = prob[v];
                    if (pv > 0) d += pv * ((double(p[v]) - sp.lse) - (double(q[v]) - sq.lse));
                }
                out.kld[r] = std::max(d, 0.0);  // rounding can give -1e-17 for rows that are nearly equal
                out.same_top[r] = sp.top == sq.top;
                out.nll[r] = -(double(q[targets[r]]) - sq.lse);
            }
        }
    };
    const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(n_threads, n_rows));
    if (threads == 1) {
        run(0, n_rows);
        return;
    }
    std::vector<std::thread> pool;
    const int64_t per = (n_rows + threads - 1) / threads;
    for (int64_t t = 0; t < threads; ++t) {
        const int64_t first = t * per, last = std::min(n_rows, first + per);
        if (first < last) pool.emplace_back(run, first, last);
    }
    for (std::thread& th : pool) th.join();
}

}  // namespace river
