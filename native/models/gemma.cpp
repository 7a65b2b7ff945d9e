// gemma2 and gemma3: norms before and after attention and FFN, a GELU-gated FFN, embeddings
// scaled by sqrt(width), Q scaled before attention, and sliding-window layers; gemma2 caps the
// attention and output logits and alternates its window, gemma3 adds per-head q/k norms and has
// one global layer in six, which alone takes the file's rope base.
#include <cmath>

#include "../arch.h"
#include "../errors.h"
#include "../hparams_read.h"
#include "../layer_pieces.h"
#include "../weights.h"

namespace river {

namespace {

// What both read: the scales, the window and its pattern key.
void gemma_hparams(const GgufFile& f, HParams& hp, const std::string& a, bool gemma2) {
    hp.embedding_scale = std::sqrt(float(hp.n_embd));
    hp.scale_q = true;
    // The largest Gemma 2 and Gemma 3 (27B, told apart by depth) scale by the model's width
    // per head, not by the head size.
    if (hp.n_layer == (gemma2 ? 46 : 62)) hp.attn_scale = 1.0f / std::sqrt(float(hp.n_embd / hp.n_head));
    // gemma2 requires the window (as in llama.cpp); a gemma3 without one runs another graph in
    // llama.cpp (every layer global, a final logit cap), which is not implemented.
    if (!gemma2 && f.get_int(a + "attention.sliding_window", 0) == 0) {
        throw UnsupportedModelError("'" + f.path() + "': gemma3 without a sliding window (" + a +
                                    "attention.sliding_window absent or 0) is not supported");
    }
    require_key(f, a + "attention.sliding_window");  // with 0 every position would be masked
    hp.n_swa = bounded_int(f, a + "attention.sliding_window", -1, 1, kMaxContext);
    // gemma3 may set its period (llama.cpp reads it); gemma2's is fixed at 2.
    const std::string pattern = a + "attention.sliding_window_pattern";
    if (f.has_key(pattern) && (gemma2 || f.get_int_array(pattern).size() > 1)) {
        throw UnsupportedModelError("'" + f.path() + "' sets " + pattern + "; " +
                                    (gemma2 ? "gemma2 runs llama.cpp's fixed alternation"
                                            : "only a period (one number) is supported"));
    }
}

void gemma2_hparams(const GgufFile& f, HParams& hp, const std::string& a) {
    gemma_hparams(f, hp, a, true);
    hp.swa_layers = swa_pattern(hp.n_layer, 2);
    hp.rope_freq_base_swa = hp.rope_freq_base;
    hp.rope_freq_scale_swa = hp.rope_freq_scale;
    hp.attn_softcap = finite_float(f, a + "attn_logit_softcapping", 50.0f, /*allow_zero=*/false);
    hp.final_softcap = finite_float(f, a + "final_logit_softcapping", 30.0f, /*allow_zero=*/false);
}

void gemma3_hparams(const GgufFile& f, HParams& hp, const std::string& a) {
    gemma_hparams(f, hp, a, false);
    // Sliding layers keep Gemma's original rope (base 10000, unscaled); global layers take
    // the file's base and scaling.
    hp.swa_layers = swa_pattern(hp.n_layer, bounded_int(f, a + "attention.sliding_window_pattern", 6, 1, kMaxLayers));
    hp.rope_freq_base_swa = finite_float(f, a + "rope.freq_base_swa", 10000.0f, /*allow_zero=*/false);
    hp.rope_freq_scale_swa = 1.0f;
}

void gemma_weights(const LayerLoader& ld, LayerWeights& w, bool qk_norms) {
    w.attn_norm = ld.vec("attn_norm.weight", ld.e);
    load_qkvo(ld, w, /*biases_required=*/false);
    if (qk_norms) {
        w.q_norm = ld.vec("attn_q_norm.weight", ld.hp.head_dim_k);
        w.k_norm = ld.vec("attn_k_norm.weight", ld.hp.head_dim_k);
    }
    w.attn_post_norm = ld.vec("post_attention_norm.weight", ld.e);
    w.ffn_post_norm = ld.vec("post_ffw_norm.weight", ld.e);
    w.ffn_norm = ld.vec("ffn_norm.weight", ld.e);
    load_gated_ffn(ld, w);
}

void gemma2_weights(const LayerLoader& ld, LayerWeights& w) { gemma_weights(ld, w, false); }
void gemma3_weights(const LayerLoader& ld, LayerWeights& w) { gemma_weights(ld, w, true); }

// gemma2's attention cap (hp.attn_softcap) is applied inside the attention op.
ggml_tensor* gemma_layer(const LayerGraph& L, ggml_tensor* h) {
    const HParams& hp = L.hp;
    Projections p = project_qkv(L, rms_norm(L.ctx, h, L.w.attn_norm, hp.rms_eps));
    Heads qk = split_qk(L, p);
    ggml_tensor* q = ggml_scale(L.ctx, rope(L, qk.q), hp.attn_scale);
    ggml_tensor* att = attention(L, q, rope(L, qk.k), p.v, 1.0f);
    ggml_tensor* h_attn = ggml_add(L.ctx, output_rows(L, rms_norm(L.ctx, att, L.w.attn_post_norm, hp.rms_eps)), output_rows(L, h));
    ggml_tensor* ff = gated_ffn(L, rms_norm(L.ctx, h_attn, L.w.ffn_norm, hp.rms_eps), Gate::Gelu);
    return ggml_add(L.ctx, rms_norm(L.ctx, ff, L.w.ffn_post_norm, hp.rms_eps), h_attn);
}

}  // namespace

extern const ArchSpec kGemma2 = {"gemma2", GGML_ROPE_TYPE_NEOX, RopeFactors::None, /*tied_only=*/true,
                                 gemma2_hparams, gemma2_weights, gemma_layer};
extern const ArchSpec kGemma3 = {"gemma3", GGML_ROPE_TYPE_NEOX, RopeFactors::None, false, gemma3_hparams,
                                 gemma3_weights, gemma_layer};

}  // namespace river
