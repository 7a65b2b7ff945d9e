#include "layer_graph.h"

#include <algorithm>

#include "arch.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "layer_pieces.h"

namespace river {

ggml_tensor* weight_product(ggml_context* ctx, ggml_tensor* w, ggml_tensor* x, bool decode_kernels) {
    const int64_t width = x->ne[0], n = x->ne[1];
    if (!decode_kernels || n < 2 || x->ne[2] != 1 || x->ne[3] != 1 || x->type != GGML_TYPE_F32 || !w->buffer ||
        !ggml_backend_buffer_is_host(w->buffer)) {
        return ggml_mul_mat(ctx, w, x);
    }
    const ggml_type dot = ggml_get_type_traits_cpu(w->type)->vec_dot_type;
    // Pad by a block of the dot type and at least 64 bytes, so that padded rows stay aligned as
    // the unpadded ones would be.
    const int64_t block = ggml_blck_size(dot);
    const int64_t pad = block * std::max<int64_t>(1, 64 / int64_t(ggml_type_size(dot)));
    if (width % block != 0) return ggml_mul_mat(ctx, w, x);
    ggml_tensor* padded = ggml_pad(ctx, ggml_is_contiguous(x) ? x : ggml_cont(ctx, x), int(pad), 0, 0, 0);
    // The conversion a decode step's mat-mul makes (the dot type's from_float), row by row.
    ggml_tensor* converted = dot == GGML_TYPE_F32 ? padded : ggml_cpy(ctx, padded, ggml_new_tensor_2d(ctx, dot, width + pad, n));
    ggml_tensor* rows = ggml_view_2d(ctx, converted, width, n, converted->nb[1], 0);
    return ggml_mul_mat(ctx, w, rows);
}

ggml_tensor* build_embedding(ggml_context* ctx, const HParams& hp, ggml_tensor* table, ggml_tensor* tokens) {
    ggml_tensor* h = ggml_get_rows(ctx, table, tokens);
    return hp.embedding_scale != 0.0f ? ggml_scale(ctx, h, hp.embedding_scale) : h;
}

ggml_tensor* build_decoder_layer(ggml_context* ctx, ggml_cgraph* gf, const HParams& hp, const LayerWeights& w,
                                 ggml_tensor* rope_freqs, KvCache& cache, int il, const BatchInputs& in,
                                 ggml_tensor* h) {
    const LayerGraph L{ctx, gf, hp, w, rope_freqs, cache, il, in};
    return hp.arch->build_layer(L, h);
}

ggml_tensor* build_final_norm(ggml_context* ctx, const HParams& hp, ggml_tensor* output_norm, ggml_tensor* h) {
    return rms_norm(ctx, h, output_norm, hp.rms_eps);
}

ggml_tensor* build_head(ggml_context* ctx, const HParams& hp, ggml_tensor* output_norm, ggml_tensor* head,
                        ggml_tensor* h, bool decode_kernels) {
    ggml_tensor* logits = weight_product(ctx, head, build_final_norm(ctx, hp, output_norm, h), decode_kernels);
    if (hp.logit_scale != 0.0f) logits = ggml_scale(ctx, logits, 1.0f / hp.logit_scale);
    if (hp.final_softcap != 0.0f) {
        logits = ggml_scale(ctx, ggml_tanh(ctx, ggml_scale(ctx, logits, 1.0f / hp.final_softcap)), hp.final_softcap);
    }
    return logits;
}

}  // namespace river
