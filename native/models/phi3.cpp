// phi3 (Phi-3, Phi-4-mini): llama's layout with Q/K/V in one weight and gate and up in one
// (ffn_up), Q scaled before attention, rope over the first n_rot dims of each head (partial
// rotary), and LongRoPE's two factor sets for long contexts.
#include "../arch.h"
#include "../hparams_read.h"
#include "../layer_pieces.h"
#include "../weights.h"

namespace river {

namespace {

void phi3_hparams(const GgufFile& f, HParams& hp, const std::string& a) {
    require_head_sizes(f, hp, a, /*model_wide=*/true, /*rope_whole_head=*/false);
    hp.scale_q = true;
    // llama.cpp reads phi3's attention.sliding_window but runs every layer globally (its phi3
    // loader turns the window off), so it is ignored here too.
}

void phi3_weights(const LayerLoader& ld, LayerWeights& w) {
    w.attn_norm = ld.vec("attn_norm.weight", ld.e);
    if (ld.has("attn_qkv.weight")) {
        w.wqkv = ld.mat("attn_qkv.weight", ld.e, ld.q + ld.k + ld.v);
    } else {
        w.wq = ld.mat("attn_q.weight", ld.e, ld.q);
        w.wk = ld.mat("attn_k.weight", ld.e, ld.k);
        w.wv = ld.mat("attn_v.weight", ld.e, ld.v);
    }
    w.wo = ld.mat("attn_output.weight", ld.o, ld.e);
    load_qkv_biases(ld, w, /*required=*/false);
    w.ffn_norm = ld.vec("ffn_norm.weight", ld.e);
    w.ffn_gate_up = ld.mat("ffn_up.weight", ld.e, 2 * int64_t(ld.hp.n_ff));  // gate rows, then up rows
    w.ffn_down = ld.mat("ffn_down.weight", ld.hp.n_ff, ld.e);
    refuse_biases_and_experts(ld);
}

ggml_tensor* phi3_layer(const LayerGraph& L, ggml_tensor* h) {
    const HParams& hp = L.hp;
    Projections p = project_qkv(L, rms_norm(L.ctx, h, L.w.attn_norm, hp.rms_eps));
    Heads qk = split_qk(L, p);  // phi3 has no q/k norms
    ggml_tensor* q = ggml_scale(L.ctx, rope(L, qk.q), hp.attn_scale);
    ggml_tensor* h_attn = ggml_add(L.ctx, output_rows(L, attention(L, q, rope(L, qk.k), p.v, 1.0f)), output_rows(L, h));
    return ggml_add(L.ctx, h_attn, gated_ffn(L, rms_norm(L.ctx, h_attn, L.w.ffn_norm, hp.rms_eps), Gate::Silu));
}

}  // namespace

extern const ArchSpec kPhi3 = {"phi3", GGML_ROPE_TYPE_NEOX, RopeFactors::LongRope, false, phi3_hparams,
                               phi3_weights, phi3_layer};

}  // namespace river
