// A rule on the size of the layer's update: a token leaves once a layer changes its hidden
// state by little against the state itself, 1 - ||h_out - h_in|| / ||h_in|| > tau. Unlike the
// cosine, it also sees an update along the state (a rescaling). Scores run from -inf (an update
// larger than the state) to 1 (no update).
#include <cmath>

#include "../exit_rule.h"

namespace river {

namespace {

// 1 - sqrt(sum((h_out - h_in)^2) / sum(h_in^2)) per token, on the layer's device.
ggml_tensor* update_graph(ggml_context* ctx, ggml_tensor* h_in, ggml_tensor* h_out) {
    ggml_tensor* change = ggml_sum_rows(ctx, ggml_sqr(ctx, ggml_sub(ctx, h_out, h_in)));
    ggml_tensor* ratio = ggml_sqrt(ctx, ggml_div(ctx, change, ggml_sum_rows(ctx, ggml_sqr(ctx, h_in))));
    return ggml_scale_bias(ctx, ratio, -1.0f, 1.0f);
}

float update_cpu(const float* a, const float* b, int64_t d) {
    double change = 0, na = 0;
    for (int64_t j = 0; j < d; ++j) {
        const double u = double(b[j]) - a[j];
        change += u * u;
        na += double(a[j]) * a[j];
    }
    return static_cast<float>(1.0 - std::sqrt(change / na));
}

}  // namespace

extern const ExitRule kUpdateExit = {
    "update",
    "exit when 1 - ||h_out - h_in|| / ||h_in|| > TAU after a layer (>= 1: never)",
    1.0f,
    update_graph,
    update_cpu,
};

}  // namespace river
