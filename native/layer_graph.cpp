#include "layer_graph.h"

#include "arch.h"
#include "layer_pieces.h"

namespace river {

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
                        ggml_tensor* h) {
    ggml_tensor* logits = ggml_mul_mat(ctx, head, build_final_norm(ctx, hp, output_norm, h));
    if (hp.logit_scale != 0.0f) logits = ggml_scale(ctx, logits, 1.0f / hp.logit_scale);
    if (hp.final_softcap != 0.0f) {
        logits = ggml_scale(ctx, ggml_tanh(ctx, ggml_scale(ctx, logits, 1.0f / hp.final_softcap)), hp.final_softcap);
    }
    return logits;
}

}  // namespace river
