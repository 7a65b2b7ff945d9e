// mistral3 (Ministral 3): llama's layers, YaRN rope (read for every family in hparams.cpp), and
// Llama 4's attention temperature: each token's roped Q is scaled by a factor that grows with
// the logarithm of its position in units of the original context.
#include "../arch.h"
#include "../errors.h"
#include "../hparams_read.h"
#include "../layer_pieces.h"
#include "../weights.h"

namespace river {

namespace {

void mistral3_hparams(const GgufFile& f, HParams& hp, const std::string& a) {
    require_head_sizes(f, hp, a, /*model_wide=*/false, /*rope_whole_head=*/true);
    hp.attn_temp_scale = finite_float(f, a + "attention.temperature_scale", 0.0f, /*allow_zero=*/true);
    if (hp.attn_temp_scale != 0.0f) hp.attn_temp_floor = hp.n_ctx_orig;  // never 0: bounded at >= 1
}

void mistral3_weights(const LayerLoader& ld, LayerWeights& w) {
    load_llama_layer(ld, w, /*biases_required=*/false);
    refuse_biases_and_experts(ld);
}

ggml_tensor* mistral3_layer(const LayerGraph& L, ggml_tensor* h) {
    const HParams& hp = L.hp;
    Projections p = project_qkv(L, rms_norm(L.ctx, h, L.w.attn_norm, hp.rms_eps));
    Heads qk = split_qk(L, p);
    ggml_tensor* q = rope(L, qk.q);
    if (L.in.attn_temp) q = ggml_mul(L.ctx, q, L.in.attn_temp);
    ggml_tensor* att = attention(L, q, rope(L, qk.k), p.v, hp.attn_scale);
    ggml_tensor* h_attn = ggml_add(L.ctx, output_rows(L, h), output_rows(L, att));
    return ggml_add(L.ctx, h_attn, gated_ffn(L, rms_norm(L.ctx, h_attn, L.w.ffn_norm, hp.rms_eps), Gate::Silu));
}

}  // namespace

extern const ArchSpec kMistral3 = {"mistral3", GGML_ROPE_TYPE_NORMAL, RopeFactors::Freqs, false, mistral3_hparams,
                                   mistral3_weights, mistral3_layer};

}  // namespace river
