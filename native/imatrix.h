// Activation statistics for importance-matrix ("imatrix") quantization (the quantizer that
// takes them is in quantize.h).
//
// The statistic is the one llama.cpp's llama-imatrix collects: for every matrix multiplication
// by a model weight W (n_cols inputs), the per-column sum over all input rows (tokens) of x_j^2,
// and the number of rows seen. sum / count is the mean square of each input column, which
// ggml's quantizers take as per-column weights of the rounding error: columns that carry large
// activations are kept more precisely.
#pragma once
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "ggml-backend.h"
#include "ggml.h"

namespace river {

class Engine;

class ActivationStats {
public:
    struct Entry {
        std::vector<double> sums;  // per input column; double so long runs do not lose small terms
        int64_t count = 0;         // input rows (tokens) seen
    };

    // The scheduler's eval callback; `data` is an ActivationStats*. Never throws: ggml's C code
    // calls it, so a failure is recorded (see error()) and stops the graph instead.
    static bool callback(ggml_tensor* t, bool ask, void* data);

    std::map<std::string, Entry> snapshot() const;
    // The first failure seen by the callback (empty when none); collect_activations raises it.
    std::string error() const;
    void clear();
    size_t size() const;

private:
    bool wanted(const ggml_tensor* t) const;
    void accumulate(const ggml_tensor* t);

    mutable std::mutex mu_;
    std::map<std::string, Entry> entries_;
    std::vector<float> rows_;  // staging copy of one activation matrix (it may live on a GPU)
    std::string error_;
};

// The weight a mul_mat node reads, by its GGUF name; empty when src0 is not a model weight.
// Scheduler copies of weights (GPU splits) are named "<backend>#<name>#<n>" and map back to <name>.
std::string weight_name(const ggml_tensor* mul_mat);

// Run `tokens` through the backbone of `engine` (from its current n_past) with `stats` observing
// every mat-mul, the head included on every token. The observer is removed on every exit path.
// Throws std::runtime_error when the statistics hit a problem (non-finite activations, a weight
// whose width changed between runs).
void collect_activations(Engine& engine, const std::vector<int32_t>& tokens, ActivationStats& stats);

}  // namespace river
