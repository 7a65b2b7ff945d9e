// olmo2 (and OLMo 3's layout): no input norms; q/k norms over the whole projection (all heads at
// once), and norms on the attention and FFN outputs before each residual add. A sliding window,
// when the file sets one, on three of every four layers.
#include "../arch.h"
#include "../errors.h"
#include "../hparams_read.h"
#include "../layer_pieces.h"
#include "../weights.h"

namespace river {

namespace {

void olmo2_hparams(const GgufFile& f, HParams& hp, const std::string& a) {
    require_head_sizes(f, hp, a, /*model_wide=*/true, /*rope_whole_head=*/true);
    const std::string window = a + "attention.sliding_window";
    hp.n_swa = f.has_key(window) ? bounded_int(f, window, 0, 0, kMaxContext) : 0;
    if (hp.n_swa > 0) {
        // OLMo 3's layout: three sliding layers, then one global, unless the file says otherwise.
        const std::string pattern = a + "attention.sliding_window_pattern";
        if (f.has_key(pattern) && f.get_int_array(pattern).size() > 1) {
            throw UnsupportedModelError("a per-layer " + pattern + " is not supported (only a period)");
        }
        hp.swa_layers = swa_pattern(hp.n_layer, bounded_int(f, pattern, 4, 1, kMaxLayers));
        // Sliding layers rotate with the global base and no scaling (llama.cpp's olmo2 graph).
        hp.rope_freq_base_swa = hp.rope_freq_base;
        hp.rope_freq_scale_swa = 1.0f;
    }
}

void olmo2_weights(const LayerLoader& ld, LayerWeights& w) {
    load_qkvo(ld, w, /*biases_required=*/false);
    w.q_norm = ld.vec("attn_q_norm.weight", ld.q);
    w.k_norm = ld.vec("attn_k_norm.weight", ld.k);
    w.attn_post_norm = ld.vec("post_attention_norm.weight", ld.e);
    w.ffn_post_norm = ld.vec("post_ffw_norm.weight", ld.e);
    load_gated_ffn(ld, w);
}

ggml_tensor* olmo2_layer(const LayerGraph& L, ggml_tensor* h) {
    const HParams& hp = L.hp;
    const int n = L.in.n_tokens;
    Projections p = project_qkv(L, h);
    ggml_tensor* q = split_heads(L.ctx, rms_norm(L.ctx, p.q, L.w.q_norm, hp.rms_eps), hp.head_dim_k, hp.n_head, n);
    ggml_tensor* k = split_heads(L.ctx, rms_norm(L.ctx, p.k, L.w.k_norm, hp.rms_eps), hp.head_dim_k, hp.n_head_kv, n);
    ggml_tensor* att = attention(L, rope(L, q), rope(L, k), p.v, hp.attn_scale);
    ggml_tensor* h_attn = ggml_add(L.ctx, output_rows(L, rms_norm(L.ctx, att, L.w.attn_post_norm, hp.rms_eps)), output_rows(L, h));
    ggml_tensor* ff = gated_ffn(L, h_attn, Gate::Silu);
    return ggml_add(L.ctx, rms_norm(L.ctx, ff, L.w.ffn_post_norm, hp.rms_eps), h_attn);
}

}  // namespace

extern const ArchSpec kOlmo2 = {"olmo2", GGML_ROPE_TYPE_NEOX, RopeFactors::None, false, olmo2_hparams,
                                olmo2_weights, olmo2_layer};

}  // namespace river
