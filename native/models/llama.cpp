// llama, qwen2 (Q/K/V biases) and qwen3 (per-head q/k norms): pre-norm attention and a SwiGLU
// FFN. llama rotates adjacent pairs and reads llama3-style rope factors; qwen2/qwen3 rotate the
// two halves of each head.
#include "../arch.h"
#include "../layer_pieces.h"
#include "../weights.h"

namespace river {

namespace {

void no_extra_hparams(const GgufFile&, HParams&, const std::string&) {}

void llama_weights(const LayerLoader& ld, LayerWeights& w) { load_llama_layer(ld, w, /*biases_required=*/false); }

void qwen2_weights(const LayerLoader& ld, LayerWeights& w) { load_llama_layer(ld, w, /*biases_required=*/true); }

void qwen3_weights(const LayerLoader& ld, LayerWeights& w) {
    w.attn_norm = ld.vec("attn_norm.weight", ld.e);
    load_qkvo(ld, w, /*biases_required=*/false);
    w.q_norm = ld.vec("attn_q_norm.weight", ld.hp.head_dim_k);
    w.k_norm = ld.vec("attn_k_norm.weight", ld.hp.head_dim_k);
    w.ffn_norm = ld.vec("ffn_norm.weight", ld.e);
    load_gated_ffn(ld, w);
}

ggml_tensor* llama_layer(const LayerGraph& L, ggml_tensor* h) {
    const HParams& hp = L.hp;
    Projections p = project_qkv(L, rms_norm(L.ctx, h, L.w.attn_norm, hp.rms_eps));
    Heads qk = split_qk(L, p);
    ggml_tensor* att = attention(L, rope(L, qk.q), rope(L, qk.k), p.v, hp.attn_scale);
    ggml_tensor* h_attn = ggml_add(L.ctx, output_rows(L, h), output_rows(L, att));
    return ggml_add(L.ctx, h_attn, gated_ffn(L, rms_norm(L.ctx, h_attn, L.w.ffn_norm, hp.rms_eps), Gate::Silu));
}

}  // namespace

extern const ArchSpec kLlama = {"llama", GGML_ROPE_TYPE_NORMAL, RopeFactors::Freqs, false, no_extra_hparams,
                                llama_weights, llama_layer};
extern const ArchSpec kQwen2 = {"qwen2", GGML_ROPE_TYPE_NEOX, RopeFactors::Freqs, false, no_extra_hparams,
                                qwen2_weights, llama_layer};
extern const ArchSpec kQwen3 = {"qwen3", GGML_ROPE_TYPE_NEOX, RopeFactors::Freqs, false, no_extra_hparams,
                                qwen3_weights, llama_layer};

}  // namespace river
