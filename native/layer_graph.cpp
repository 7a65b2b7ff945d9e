#include "layer_graph.h"

#include <cmath>

namespace river {

namespace {

// What every layer function works with.
struct Layer {
    ggml_context* ctx;
    ggml_cgraph* gf;
    const HParams& hp;
    const LayerWeights& w;
    ggml_tensor* rope_freqs;
    KvCache& cache;
    int il;
    const BatchInputs& in;
};

// ---- shared pieces ----------------------------------------------------------------------

ggml_tensor* rms_norm(ggml_context* ctx, ggml_tensor* x, ggml_tensor* weight, float eps) {
    return ggml_mul(ctx, ggml_rms_norm(ctx, x, eps), weight);
}

// Q, K and V as [width, n_tokens]. With a joined weight they are row ranges of one product:
// strided views, which the ops below read in place.
struct Projections {
    ggml_tensor *q, *k, *v;
};

Projections project_qkv(const Layer& L, ggml_tensor* x) {
    const HParams& hp = L.hp;
    const LayerWeights& w = L.w;
    const int n = L.in.n_tokens;
    const int64_t nq = int64_t(hp.n_head) * hp.head_dim_k, nk = hp.n_embd_k_gqa(), nv = hp.n_embd_v_gqa();
    Projections p;
    if (w.wqkv) {
        ggml_tensor* qkv = ggml_mul_mat(L.ctx, w.wqkv, x);
        const size_t es = ggml_element_size(qkv);
        p.q = ggml_view_2d(L.ctx, qkv, nq, n, qkv->nb[1], 0);
        p.k = ggml_view_2d(L.ctx, qkv, nk, n, qkv->nb[1], es * nq);
        p.v = ggml_view_2d(L.ctx, qkv, nv, n, qkv->nb[1], es * (nq + nk));
    } else {
        p.q = ggml_mul_mat(L.ctx, w.wq, x);
        p.k = ggml_mul_mat(L.ctx, w.wk, x);
        p.v = ggml_mul_mat(L.ctx, w.wv, x);
    }
    if (w.bq) p.q = ggml_add(L.ctx, p.q, w.bq);
    if (w.bk) p.k = ggml_add(L.ctx, p.k, w.bk);
    if (w.bv) p.v = ggml_add(L.ctx, p.v, w.bv);
    return p;
}

// [head_dim * n_heads, n] -> [head_dim, n_heads, n]; a strided view stays a view.
ggml_tensor* split_heads(ggml_context* ctx, ggml_tensor* t, int head_dim, int n_heads, int n) {
    if (ggml_is_contiguous(t)) return ggml_reshape_3d(ctx, t, head_dim, n_heads, n);
    return ggml_view_3d(ctx, t, head_dim, n_heads, n, ggml_element_size(t) * head_dim, t->nb[1], 0);
}

// Rotary embedding of [head_dim, n_heads, n] by position; sliding-window layers may have their
// own base and scale (gemma3, olmo2).
ggml_tensor* rope(const Layer& L, ggml_tensor* x) {
    const HParams& hp = L.hp;
    const bool swa = hp.is_swa(L.il);
    return ggml_rope_ext(L.ctx, x, L.in.positions, L.rope_freqs, hp.n_rot, hp.rope_type, hp.n_ctx_orig,
                         swa ? hp.rope_freq_base_swa : hp.rope_freq_base, swa ? hp.rope_freq_scale_swa : hp.rope_freq_scale,
                         /*ext_factor=*/0.0f, hp.rope_attn_factor, /*beta_fast=*/32.0f, /*beta_slow=*/1.0f);
}

// The KV write and the attention over cache layer il, then the output projection.
// q, k: [head_dim, heads, n], roped; v: [n_embd_v_gqa, n]. Q arrives pre-scaled where the
// architecture scales it (then kq_scale is 1).
ggml_tensor* attention(const Layer& L, ggml_tensor* q, ggml_tensor* k, ggml_tensor* v, float kq_scale) {
    const HParams& hp = L.hp;
    ggml_context* ctx = L.ctx;
    const int n = L.in.n_tokens, n_kv = L.in.n_kv;
    // This batch's rows of cache layer il, addressed by an input tensor so that the graph does
    // not depend on the position. Expanded before the reads below, so the graph orders the
    // write first. Backbone and river layers write the same rows; a sliding-window layer
    // writes every row too (only its reads are windowed), so later tokens find no holes.
    ggml_tensor* ck = L.cache.k(L.il);
    ggml_tensor* cv = L.cache.v(L.il);
    ggml_build_forward_expand(L.gf, ggml_set_rows(ctx, ck, ggml_reshape_2d(ctx, k, hp.n_embd_k_gqa(), n), L.in.kv_rows));
    ggml_tensor* mask = hp.is_swa(L.il) ? L.in.kq_mask_swa : L.in.kq_mask;
    ggml_tensor* qp = ggml_permute(ctx, q, 0, 2, 1, 3);  // [head_dim, n, n_head]
    ggml_tensor* keys = ggml_view_3d(ctx, ck, hp.head_dim_k, n_kv, hp.n_head_kv, ck->nb[1],
                                     ggml_row_size(ck->type, hp.head_dim_k), 0);  // [head_dim, n_kv, n_head_kv]
    ggml_tensor* att;
    if (L.in.flash_attn) {
        ggml_build_forward_expand(L.gf, ggml_set_rows(ctx, cv, v, L.in.kv_rows));
        ggml_tensor* vals = ggml_view_3d(ctx, cv, hp.head_dim_v, n_kv, hp.n_head_kv, cv->nb[1],
                                         ggml_row_size(cv->type, hp.head_dim_v), 0);
        att = ggml_flash_attn_ext(ctx, qp, keys, vals, mask, kq_scale, /*max_bias=*/0.0f, hp.attn_softcap);
        ggml_prec_set_acc(att, GGML_PREC_F32);
        att = ggml_reshape_2d(ctx, att, hp.head_dim_v * hp.n_head, n);
    } else {
        // llama.cpp's cpy_v with v_trans: every V value is a one-element row of the transposed
        // cache [n_ctx, n_embd_v_gqa], placed by v_idxs.
        const int64_t nv = hp.n_embd_v_gqa();
        ggml_tensor* vc = ggml_is_contiguous(v) ? v : ggml_cont(ctx, v);
        ggml_build_forward_expand(L.gf, ggml_set_rows(ctx, ggml_reshape_2d(ctx, cv, 1, ggml_nelements(cv)),
                                                      ggml_reshape_2d(ctx, vc, 1, nv * n), L.in.v_idxs));
        // build_attn_mha without flash attention: KQ in F32 precision, the architecture's soft
        // cap, softmax with the mask and scale, then V^T x KQ over the transposed cache.
        ggml_tensor* kq = ggml_mul_mat(ctx, keys, qp);  // [n_kv, n, n_head]
        ggml_mul_mat_set_prec(kq, GGML_PREC_F32);
        if (hp.attn_softcap != 0.0f) {
            kq = ggml_scale(ctx, kq, 1.0f / hp.attn_softcap);
            kq = ggml_tanh(ctx, kq);
            kq = ggml_scale(ctx, kq, hp.attn_softcap);
        }
        kq = ggml_soft_max_ext(ctx, kq, mask, kq_scale, /*max_bias=*/0.0f);
        // llama.cpp's get_v (v_trans), permuted: [n_kv, head_dim_v, n_head_kv].
        const int64_t n_ctx = cv->ne[0];
        ggml_tensor* vals = ggml_view_3d(ctx, cv, n_kv, hp.head_dim_v, hp.n_head_kv, ggml_row_size(cv->type, n_ctx),
                                         ggml_row_size(cv->type, n_ctx * hp.head_dim_v), 0);
        ggml_tensor* kqv = ggml_mul_mat(ctx, vals, kq);  // [head_dim_v, n, n_head]
        att = ggml_cont_2d(ctx, ggml_permute(ctx, kqv, 0, 2, 1, 3), hp.head_dim_v * hp.n_head, n);
    }
    return ggml_mul_mat(ctx, L.w.wo, att);
}

enum class Gate { Silu, Gelu };

// The gated FFN: act(gate) * up, then down. With the joined weight, gate and up are the two
// halves of one output row.
ggml_tensor* gated_ffn(const Layer& L, ggml_tensor* x, Gate gate) {
    ggml_context* ctx = L.ctx;
    const LayerWeights& w = L.w;
    ggml_tensor* ff;
    if (w.ffn_gate_up) {
        ggml_tensor* gu = ggml_mul_mat(ctx, w.ffn_gate_up, x);
        ff = gate == Gate::Silu ? ggml_swiglu(ctx, gu) : ggml_geglu(ctx, gu);
    } else {
        ggml_tensor* g = ggml_mul_mat(ctx, w.ffn_gate, x);
        ggml_tensor* u = ggml_mul_mat(ctx, w.ffn_up, x);
        ff = gate == Gate::Silu ? ggml_swiglu_split(ctx, g, u) : ggml_geglu_split(ctx, g, u);
    }
    return ggml_mul_mat(ctx, w.ffn_down, ff);
}

// Q and K of the projections split into heads, each normed when the layer has per-head q/k norms
// (qwen3, gemma3).
struct Heads {
    ggml_tensor *q, *k;
};

Heads split_qk(const Layer& L, const Projections& p) {
    const HParams& hp = L.hp;
    const int n = L.in.n_tokens;
    ggml_tensor* q = split_heads(L.ctx, p.q, hp.head_dim_k, hp.n_head, n);
    ggml_tensor* k = split_heads(L.ctx, p.k, hp.head_dim_k, hp.n_head_kv, n);
    if (L.w.q_norm) {
        q = rms_norm(L.ctx, q, L.w.q_norm, hp.rms_eps);
        k = rms_norm(L.ctx, k, L.w.k_norm, hp.rms_eps);
    }
    return {q, k};
}

// ---- one function per family ------------------------------------------------------------

// llama, qwen2 (Q/K/V biases), qwen3 (per-head q/k norms): pre-norm attention and SwiGLU FFN.
ggml_tensor* llama_layer(const Layer& L, ggml_tensor* h) {
    const HParams& hp = L.hp;
    Projections p = project_qkv(L, rms_norm(L.ctx, h, L.w.attn_norm, hp.rms_eps));
    Heads qk = split_qk(L, p);
    ggml_tensor* h_attn = ggml_add(L.ctx, h, attention(L, rope(L, qk.q), rope(L, qk.k), p.v, hp.attn_scale));
    return ggml_add(L.ctx, h_attn, gated_ffn(L, rms_norm(L.ctx, h_attn, L.w.ffn_norm, hp.rms_eps), Gate::Silu));
}

// granite: llama with each block's output scaled before its residual add (and the embedding
// and logit scales, in build_embedding and build_head).
ggml_tensor* granite_layer(const Layer& L, ggml_tensor* h) {
    const HParams& hp = L.hp;
    auto residual = [&](ggml_tensor* x) { return hp.residual_scale != 0.0f ? ggml_scale(L.ctx, x, hp.residual_scale) : x; };
    Projections p = project_qkv(L, rms_norm(L.ctx, h, L.w.attn_norm, hp.rms_eps));
    Heads qk = split_qk(L, p);  // granite has no q/k norms
    ggml_tensor* h_attn = ggml_add(L.ctx, residual(attention(L, rope(L, qk.q), rope(L, qk.k), p.v, hp.attn_scale)), h);
    ggml_tensor* ff = gated_ffn(L, rms_norm(L.ctx, h_attn, L.w.ffn_norm, hp.rms_eps), Gate::Silu);
    return ggml_add(L.ctx, residual(ff), h_attn);
}

// olmo2: no input norms; q/k norms over the whole projection (all heads at once), and norms on
// the attention and FFN outputs before each residual add.
ggml_tensor* olmo2_layer(const Layer& L, ggml_tensor* h) {
    const HParams& hp = L.hp;
    const int n = L.in.n_tokens;
    Projections p = project_qkv(L, h);
    ggml_tensor* q = split_heads(L.ctx, rms_norm(L.ctx, p.q, L.w.q_norm, hp.rms_eps), hp.head_dim_k, hp.n_head, n);
    ggml_tensor* k = split_heads(L.ctx, rms_norm(L.ctx, p.k, L.w.k_norm, hp.rms_eps), hp.head_dim_k, hp.n_head_kv, n);
    ggml_tensor* att = attention(L, rope(L, q), rope(L, k), p.v, hp.attn_scale);
    ggml_tensor* h_attn = ggml_add(L.ctx, rms_norm(L.ctx, att, L.w.attn_post_norm, hp.rms_eps), h);
    ggml_tensor* ff = gated_ffn(L, h_attn, Gate::Silu);
    return ggml_add(L.ctx, rms_norm(L.ctx, ff, L.w.ffn_post_norm, hp.rms_eps), h_attn);
}

// gemma2, gemma3: norms before and after attention and FFN, GELU-gated FFN, Q scaled before
// attention; gemma3 adds per-head q/k norms, gemma2 caps attention logits (hp.attn_softcap,
// inside the attention op). Sliding-window layers are chosen by hp.swa_layers.
ggml_tensor* gemma_layer(const Layer& L, ggml_tensor* h) {
    const HParams& hp = L.hp;
    Projections p = project_qkv(L, rms_norm(L.ctx, h, L.w.attn_norm, hp.rms_eps));
    Heads qk = split_qk(L, p);
    ggml_tensor* q = ggml_scale(L.ctx, rope(L, qk.q), hp.attn_scale);
    ggml_tensor* att = attention(L, q, rope(L, qk.k), p.v, 1.0f);
    ggml_tensor* h_attn = ggml_add(L.ctx, rms_norm(L.ctx, att, L.w.attn_post_norm, hp.rms_eps), h);
    ggml_tensor* ff = gated_ffn(L, rms_norm(L.ctx, h_attn, L.w.ffn_norm, hp.rms_eps), Gate::Gelu);
    return ggml_add(L.ctx, rms_norm(L.ctx, ff, L.w.ffn_post_norm, hp.rms_eps), h_attn);
}

// phi3: llama's layout with Q/K/V in one weight, gate and up in one (ffn_up), Q scaled before
// attention, and rope over the first n_rot dims of each head (partial rotary).
ggml_tensor* phi3_layer(const Layer& L, ggml_tensor* h) {
    const HParams& hp = L.hp;
    Projections p = project_qkv(L, rms_norm(L.ctx, h, L.w.attn_norm, hp.rms_eps));
    Heads qk = split_qk(L, p);  // phi3 has no q/k norms
    ggml_tensor* q = ggml_scale(L.ctx, rope(L, qk.q), hp.attn_scale);
    ggml_tensor* h_attn = ggml_add(L.ctx, attention(L, q, rope(L, qk.k), p.v, 1.0f), h);
    return ggml_add(L.ctx, h_attn, gated_ffn(L, rms_norm(L.ctx, h_attn, L.w.ffn_norm, hp.rms_eps), Gate::Silu));
}

}  // namespace

ggml_tensor* build_embedding(ggml_context* ctx, const HParams& hp, ggml_tensor* table, ggml_tensor* tokens) {
    ggml_tensor* h = ggml_get_rows(ctx, table, tokens);
    return hp.embedding_scale != 0.0f ? ggml_scale(ctx, h, hp.embedding_scale) : h;
}

ggml_tensor* build_decoder_layer(ggml_context* ctx, ggml_cgraph* gf, const HParams& hp, const LayerWeights& w,
                                 ggml_tensor* rope_freqs, KvCache& cache, int il, const BatchInputs& in,
                                 ggml_tensor* h) {
    const Layer L{ctx, gf, hp, w, rope_freqs, cache, il, in};
    switch (hp.arch) {
        case Arch::Llama:
        case Arch::Qwen2:
        case Arch::Qwen3: return llama_layer(L, h);
        case Arch::Granite: return granite_layer(L, h);
        case Arch::Olmo2: return olmo2_layer(L, h);
        case Arch::Gemma2:
        case Arch::Gemma3: return gemma_layer(L, h);
        case Arch::Phi3: return phi3_layer(L, h);
    }
    return h;  // unreachable: read_hparams accepts only the families above
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
