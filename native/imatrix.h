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

    // Add n_rows input rows of `name` (n_cols floats each, packed) as one batch, as the callback
    // adds a mat-mul's input: rows the caller already has (the head's input is the final norm's
    // output, which a graph ending at the norm returns without running the head).
    void add(const std::string& name, const float* rows, int64_t n_rows, int64_t n_cols);

    std::map<std::string, Entry> snapshot() const;
    // The first failure seen by the callback (empty when none); collect_activations raises it.
    std::string error() const;
    void clear();
    size_t size() const;

private:
    bool wanted(const ggml_tensor* t) const;
    void accumulate(const ggml_tensor* t);
    // One batch's rows (rows_ staged, or the caller's) into `name`'s entry; mu_ held.
    void add_locked(const std::string& name, const float* rows, int64_t n_rows, int64_t n_cols);

    mutable std::mutex mu_;
    std::map<std::string, Entry> entries_;
    std::vector<float> rows_;  // staging copy of one activation matrix (it may live on a GPU)
    std::string error_;
};

// The weight a mul_mat node reads, by its GGUF name; empty when src0 is not a model weight.
// Scheduler copies of weights (GPU splits) are named "<backend>#<name>#<n>" and map back to <name>.
std::string weight_name(const ggml_tensor* mul_mat);
// A weight tensor's name as the file has it (a scheduler copy's mapped back); empty when it does
// not name a weight ("*.weight").
std::string file_weight_name(std::string name);

// Run `tokens` through the backbone of `engine` (from its current n_past) with `stats` observing
// every mat-mul, the head's input included on every token (from the final norm: the head itself
// does not run). The observer is removed on every exit path.
// Throws std::runtime_error when the statistics hit a problem (non-finite activations, a weight
// whose width changed between runs).
void collect_activations(Engine& engine, const std::vector<int32_t>& tokens, ActivationStats& stats);

}  // namespace river
