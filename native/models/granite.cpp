// granite: llama's layers with each block's output scaled before its residual add, and
// multipliers on the embeddings, the attention scores and the logits.
#include "../arch.h"
#include "../errors.h"
#include "../hparams_read.h"
#include "../layer_pieces.h"
#include "../weights.h"

namespace river {

namespace {

void granite_hparams(const GgufFile& f, HParams& hp, const std::string& a) {
    require_head_sizes(f, hp, a, /*model_wide=*/false, /*rope_whole_head=*/true);
    // Granite turns rope off with rope.scaling.finetuned = false; no released model does.
    if (f.has_key(a + "rope.scaling.finetuned") && f.get_int(a + "rope.scaling.finetuned", 1) == 0) {
        throw UnsupportedModelError("granite without rope (" + a + "rope.scaling.finetuned = false) is not supported");
    }
    require_key(f, a + "logit_scale");
    hp.logit_scale = finite_float(f, a + "logit_scale", 1.0f, /*allow_zero=*/false);
    hp.residual_scale = finite_float(f, a + "residual_scale", 0.0f, /*allow_zero=*/true);
    hp.embedding_scale = finite_float(f, a + "embedding_scale", 0.0f, /*allow_zero=*/true);
    const float scale = finite_float(f, a + "attention.scale", 0.0f, /*allow_zero=*/true);
    if (scale != 0.0f) hp.attn_scale = scale;
}

void granite_weights(const LayerLoader& ld, LayerWeights& w) {
    load_llama_layer(ld, w, /*biases_required=*/false);
    refuse_biases_and_experts(ld);
}

// The embedding and logit scales are applied by build_embedding and build_head.
ggml_tensor* granite_layer(const LayerGraph& L, ggml_tensor* h) {
    const HParams& hp = L.hp;
    auto residual = [&](ggml_tensor* x) { return hp.residual_scale != 0.0f ? ggml_scale(L.ctx, x, hp.residual_scale) : x; };
    Projections p = project_qkv(L, rms_norm(L.ctx, h, L.w.attn_norm, hp.rms_eps));
    Heads qk = split_qk(L, p);  // granite has no q/k norms
    ggml_tensor* att = output_rows(L, attention(L, rope(L, qk.q), rope(L, qk.k), p.v, hp.attn_scale));
    ggml_tensor* h_attn = ggml_add(L.ctx, residual(att), output_rows(L, h));
    ggml_tensor* ff = gated_ffn(L, rms_norm(L.ctx, h_attn, L.w.ffn_norm, hp.rms_eps), Gate::Silu);
    return ggml_add(L.ctx, residual(ff), h_attn);
}

}  // namespace

extern const ArchSpec kGranite = {"granite", GGML_ROPE_TYPE_NORMAL, RopeFactors::Freqs, false, granite_hparams,
                                  granite_weights, granite_layer};

}  // namespace river
