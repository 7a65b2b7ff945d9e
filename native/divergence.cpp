#include "divergence.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>

// The row loops are built twice where ifuncs exist (x86-64 Linux, GCC): for AVX2 with FMA, and
// for the baseline the package is built for; the loader picks one per machine, so a machine's
// results do not change from call to call.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define RIVER_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define RIVER_CLONES
#endif

namespace river {

namespace {

// Sums run in LANES independent partial sums, added in one fixed order at the end: the compiler
// can then keep them in vector registers (an FP sum in vocabulary order is one long dependency
// chain it may not reorder), and a row's result still depends on nothing but the row.
constexpr int64_t LANES = 8;

double lanes_total(const double* acc) {
    double s = 0;
    for (int64_t j = 0; j < LANES; ++j) s += acc[j];
    return s;
}

// e^x in double for x <= 0 (a logit minus its row's largest), written without calls or branches
// so that a loop of it vectorizes: x = n ln2 + r with |r| <= ln2/2, e^r by its Taylor series to
// r^12 (the first term left out is below 3e-16 of the result), and 2^n put into the exponent's
// bits. Below -708, where 2^n would leave the normal range, it gives 0 (such a term is below
// 1e-307 of the row's sum).
inline double exp_nonpositive(double x) {
    constexpr double kRound = 6755399441055744.0;  // 1.5 * 2^52: adding it rounds to an integer, kept in the low bits
    constexpr double kLog2e = 1.4426950408889634;
    constexpr double kLn2Hi = 0.6931471803691238;     // ln 2's leading bits: n * kLn2Hi is exact
    constexpr double kLn2Lo = 1.9082149292705877e-10;  // the rest of ln 2
    const double xc = x < -708.0 ? -708.0 : x;
    const double t = xc * kLog2e + kRound;
    const double n = t - kRound;
    const double r = (xc - n * kLn2Hi) - n * kLn2Lo;
    double p = 1.0 / 479001600.0;  // 1/12!
    p = p * r + 1.0 / 39916800.0;
    p = p * r + 1.0 / 3628800.0;
    p = p * r + 1.0 / 362880.0;
    p = p * r + 1.0 / 40320.0;
    p = p * r + 1.0 / 5040.0;
    p = p * r + 1.0 / 720.0;
    p = p * r + 1.0 / 120.0;
    p = p * r + 1.0 / 24.0;
    p = p * r + 1.0 / 6.0;
    p = p * r + 0.5;
    p = p * r + 1.0;
    p = p * r + 1.0;
    uint64_t bits, round_bits;
    std::memcpy(&bits, &t, sizeof bits);
    std::memcpy(&round_bits, &kRound, sizeof round_bits);
    const uint64_t exponent = (bits - round_bits + 1023u) << 52;  // n + 1023, n in [-1022, 0]
    double scale;
    std::memcpy(&scale, &exponent, sizeof scale);
    return x < -708.0 ? 0.0 : p * scale;
}

// The row's first highest entry (0 for a row of NaNs, whose measures come out NaN).
RIVER_CLONES int64_t row_top(const float* x, int64_t n) {
    float lane[LANES];
    for (int64_t j = 0; j < LANES; ++j) lane[j] = -INFINITY;
    int64_t v = 0;
    for (; v + LANES <= n; v += LANES) {
        for (int64_t j = 0; j < LANES; ++j) lane[j] = x[v + j] > lane[j] ? x[v + j] : lane[j];
    }
    float m = lane[0];
    for (int64_t j = 1; j < LANES; ++j) m = lane[j] > m ? lane[j] : m;
    for (; v < n; ++v) m = x[v] > m ? x[v] : m;
    int64_t top = 0;
    while (top < n && x[top] != m) ++top;
    return top < n ? top : 0;
}

// sum_v term(v) over v < n, in LANES partial sums and then the tail, in one fixed order.
template <class Term>
inline double lane_sum(int64_t n, Term term) {
    double acc[LANES] = {};
    int64_t v = 0;
    for (; v + LANES <= n; v += LANES) {
        for (int64_t j = 0; j < LANES; ++j) acc[j] += term(v + j);
    }
    double s = lanes_total(acc);
    for (; v < n; ++v) s += term(v);
    return s;
}

// One reference row against every configuration's row r. prob: n_vocab of scratch.
RIVER_CLONES void divergence_row(const float* p, int64_t r, int32_t target, int64_t n_vocab,
                                 const DivergenceOutput* configs, int64_t n_configs, double* prob) {
    const int64_t top_p = row_top(p, n_vocab);
    const double max_p = p[top_p];
    const double sum_e = lane_sum(n_vocab, [&](int64_t v) { return prob[v] = exp_nonpositive(double(p[v]) - max_p); });
    const double lse_p = max_p + std::log(sum_e);
    // P = e^(p - max) / sum, and its total as rounded, for the KLD's second term.
    const double total_p = lane_sum(n_vocab, [&](int64_t v) { return prob[v] /= sum_e; });
    for (int64_t c = 0; c < n_configs; ++c) {
        const DivergenceOutput& out = configs[c];
        const float* q = out.logits + r * n_vocab;
        const int64_t top_q = row_top(q, n_vocab);
        const double max_q = q[top_q];
        const double lse_q = max_q + std::log(lane_sum(n_vocab, [&](int64_t v) {
            return exp_nonpositive(double(q[v]) - max_q);
        }));
        // KL(P || Q) = sum P (p - lse_p - q + lse_q) = sum P (p - q) - (lse_p - lse_q) sum P:
        // one pass over the row, and a row equal to the reference's sums to exactly 0.
        double d = lane_sum(n_vocab, [&](int64_t v) { return prob[v] * (double(p[v]) - double(q[v])); });
        d -= (lse_p - lse_q) * total_p;
        out.kld[r] = std::max(d, 0.0);  // rounding can give -1e-17 for rows that are nearly equal
        out.same_top[r] = top_p == top_q;
        out.nll[r] = -(double(q[target]) - lse_q);
    }
}

}  // namespace

void divergence_rows(const float* reference, const int32_t* targets, int64_t n_rows, int64_t n_vocab,
                     const DivergenceOutput* configs, int64_t n_configs, int n_threads) {
    auto run = [&](int64_t first, int64_t last) {
        // P(v) of the row, shared by every configuration: the same values in each
        // configuration's sum keep every result what a call of its own gives.
        std::vector<double> prob(static_cast<size_t>(n_vocab));
        for (int64_t r = first; r < last; ++r) {
            divergence_row(reference + r * n_vocab, r, targets[r], n_vocab, configs, n_configs, prob.data());
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
