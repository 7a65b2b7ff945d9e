// River's exit rule: a token leaves once a layer barely turns its hidden state,
// cos(h_in, h_out) > tau.
#include <cmath>

#include "../exit_rule.h"

namespace river {

namespace {

// sum(a*b) / sqrt(sum(a^2) sum(b^2)) per token, on the layer's device.
ggml_tensor* cosine_graph(ggml_context* ctx, ggml_tensor* h_in, ggml_tensor* h_out) {
    ggml_tensor* dot = ggml_sum_rows(ctx, ggml_mul(ctx, h_in, h_out));
    ggml_tensor* norms = ggml_mul(ctx, ggml_sum_rows(ctx, ggml_sqr(ctx, h_in)), ggml_sum_rows(ctx, ggml_sqr(ctx, h_out)));
    return ggml_div(ctx, dot, ggml_sqrt(ctx, norms));
}

float cosine_cpu(const float* a, const float* b, int64_t d) {
    double dot = 0, na = 0, nb = 0;
    for (int64_t j = 0; j < d; ++j) {
        dot += double(a[j]) * b[j];
        na += double(a[j]) * a[j];
        nb += double(b[j]) * b[j];
    }
    return static_cast<float>(dot / std::sqrt(na * nb));
}

}  // namespace

extern const ExitRule kCosineExit = {
    "cosine",
    "exit when cos(h_in, h_out) > TAU after a layer (> 1: never)",
    1.0f,
    cosine_graph,
    cosine_cpu,
};

}  // namespace river
