#include "layer_pieces.h"

namespace river {

// ---- shared pieces ----------------------------------------------------------------------

// A layer's weight product, in the single-token kernels where the batch asks for them.
static ggml_tensor* product(const LayerGraph& L, ggml_tensor* w, ggml_tensor* x) {
    return weight_product(L.ctx, w, x, L.in.decode_kernels);
}

ggml_tensor* rms_norm(ggml_context* ctx, ggml_tensor* x, ggml_tensor* weight, float eps) {
    return ggml_mul(ctx, ggml_rms_norm(ctx, x, eps), weight);
}

Projections project_qkv(const LayerGraph& L, ggml_tensor* x) {
    const HParams& hp = L.hp;
    const LayerWeights& w = L.w;
    const int n = L.in.n_tokens;
    const int64_t nq = int64_t(hp.n_head) * hp.head_dim_k, nk = hp.n_embd_k_gqa(), nv = hp.n_embd_v_gqa();
    Projections p;
    if (w.wqkv) {
        ggml_tensor* qkv = product(L, w.wqkv, x);
        const size_t es = ggml_element_size(qkv);
        p.q = ggml_view_2d(L.ctx, qkv, nq, n, qkv->nb[1], 0);
        p.k = ggml_view_2d(L.ctx, qkv, nk, n, qkv->nb[1], es * nq);
        p.v = ggml_view_2d(L.ctx, qkv, nv, n, qkv->nb[1], es * (nq + nk));
    } else {
        p.q = product(L, w.wq, x);
        p.k = product(L, w.wk, x);
        p.v = product(L, w.wv, x);
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
ggml_tensor* rope(const LayerGraph& L, ggml_tensor* x) {
    const HParams& hp = L.hp;
    const bool swa = hp.is_swa(L.il);
    return ggml_rope_ext(L.ctx, x, L.in.positions, L.rope_freqs, hp.n_rot, hp.rope_type, hp.n_ctx_orig,
                         swa ? hp.rope_freq_base_swa : hp.rope_freq_base, swa ? hp.rope_freq_scale_swa : hp.rope_freq_scale,
                         hp.rope_ext_factor, hp.rope_attn_factor, hp.rope_beta_fast, hp.rope_beta_slow);
}

// The attention of q's rows over cache rows 0..n_kv-1 of layer il (written already), under
// `mask` ([n_kv, rows]): [head_dim_v * n_head, rows].
static ggml_tensor* attend(const LayerGraph& L, ggml_tensor* q, ggml_tensor* mask, int n_kv, float kq_scale) {
    const HParams& hp = L.hp;
    ggml_context* ctx = L.ctx;
    const int n = static_cast<int>(q->ne[2]);
    ggml_tensor* ck = L.cache.k(L.il);
    ggml_tensor* cv = L.cache.v(L.il);
    ggml_tensor* qp = ggml_permute(ctx, q, 0, 2, 1, 3);  // [head_dim, n, n_head]
    ggml_tensor* keys = ggml_view_3d(ctx, ck, hp.head_dim_k, n_kv, hp.n_head_kv, ck->nb[1],
                                     ggml_row_size(ck->type, hp.head_dim_k), 0);  // [head_dim, n_kv, n_head_kv]
    if (L.in.flash_attn) {
        ggml_tensor* vals = ggml_view_3d(ctx, cv, hp.head_dim_v, n_kv, hp.n_head_kv, cv->nb[1],
                                         ggml_row_size(cv->type, hp.head_dim_v), 0);
        ggml_tensor* att = ggml_flash_attn_ext(ctx, qp, keys, vals, mask, kq_scale, /*max_bias=*/0.0f, hp.attn_softcap);
        ggml_prec_set_acc(att, GGML_PREC_F32);
        return ggml_reshape_2d(ctx, att, hp.head_dim_v * hp.n_head, n);
    }
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
    return ggml_cont_2d(ctx, ggml_permute(ctx, kqv, 0, 2, 1, 3), hp.head_dim_v * hp.n_head, n);
}

// The KV write and the attention over cache layer il, then the output projection.
// q, k: [head_dim, heads, n], roped; v: [n_embd_v_gqa, n]. Q arrives pre-scaled where the
// architecture scales it (then kq_scale is 1).
ggml_tensor* attention(const LayerGraph& L, ggml_tensor* q, ggml_tensor* k, ggml_tensor* v, float kq_scale) {
    const HParams& hp = L.hp;
    ggml_context* ctx = L.ctx;
    const int n = L.in.n_tokens;
    // This batch's rows of cache layer il, addressed by an input tensor so that the graph does
    // not depend on the position. Expanded before the reads, so the graph orders the write
    // first. Backbone and river layers write the same rows; a sliding-window layer writes every
    // row too (only its reads are windowed), so later tokens find no holes.
    ggml_tensor* ck = L.cache.k(L.il);
    ggml_tensor* cv = L.cache.v(L.il);
    ggml_build_forward_expand(L.gf, ggml_set_rows(ctx, ck, ggml_reshape_2d(ctx, k, hp.n_embd_k_gqa(), n), L.in.kv_rows));
    if (L.in.flash_attn) {
        ggml_build_forward_expand(L.gf, ggml_set_rows(ctx, cv, v, L.in.kv_rows));
    } else {
        // llama.cpp's cpy_v with v_trans: every V value is a one-element row of the transposed
        // cache [n_ctx, n_embd_v_gqa], placed by v_idxs.
        const int64_t nv = hp.n_embd_v_gqa();
        ggml_tensor* vc = ggml_is_contiguous(v) ? v : ggml_cont(ctx, v);
        ggml_build_forward_expand(L.gf, ggml_set_rows(ctx, ggml_reshape_2d(ctx, cv, 1, ggml_nelements(cv)),
                                                      ggml_reshape_2d(ctx, vc, 1, nv * n), L.in.v_idxs));
    }
    ggml_tensor* mask = hp.is_swa(L.il) ? L.in.kq_mask_swa : L.in.kq_mask;
    ggml_tensor* att;
    if (!L.in.decode_kernels || n < 2) {
        att = attend(L, q, mask, L.in.n_kv, kq_scale);
    } else {
        // Row by row, each over the rows a decode step at its position attends to: the kernels
        // a lone query row takes (flash attention splits the cache across threads from 512
        // rows) and the sums' lengths are then a decode step's.
        att = nullptr;
        for (int i = 0; i < n; ++i) {
            const int n_kv = L.in.row_n_kv[i];
            ggml_tensor* qi = ggml_view_3d(ctx, q, q->ne[0], q->ne[1], 1, q->nb[1], q->nb[2], size_t(i) * q->nb[2]);
            ggml_tensor* mi = ggml_view_2d(ctx, mask, n_kv, 1, mask->nb[1], size_t(i) * mask->nb[1]);
            ggml_tensor* row = attend(L, qi, mi, n_kv, kq_scale);
            att = att ? ggml_concat(ctx, att, row, 1) : row;
        }
    }
    return product(L, L.w.wo, att);
}

// The gated FFN: act(gate) * up, then down. With the joined weight, gate and up are the two
// halves of one output row.
ggml_tensor* gated_ffn(const LayerGraph& L, ggml_tensor* x, Gate gate) {
    ggml_context* ctx = L.ctx;
    const LayerWeights& w = L.w;
    ggml_tensor* ff;
    if (w.ffn_gate_up) {
        ggml_tensor* gu = product(L, w.ffn_gate_up, x);
        ff = gate == Gate::Silu ? ggml_swiglu(ctx, gu) : ggml_geglu(ctx, gu);
    } else {
        ggml_tensor* g = product(L, w.ffn_gate, x);
        ggml_tensor* u = product(L, w.ffn_up, x);
        ff = gate == Gate::Silu ? ggml_swiglu_split(ctx, g, u) : ggml_geglu_split(ctx, g, u);
    }
    return product(L, w.ffn_down, ff);
}

ggml_tensor* output_rows(const LayerGraph& L, ggml_tensor* t) {
    if (L.il != L.hp.n_layer - 1) return t;
    if (L.in.out_ids) return ggml_get_rows(L.ctx, t, L.in.out_ids);
    if (!L.in.last_row_only || t->ne[1] == 1) return t;
    return ggml_view_2d(L.ctx, t, t->ne[0], 1, t->nb[1], t->nb[1] * (t->ne[1] - 1));
}

Heads split_qk(const LayerGraph& L, const Projections& p) {
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

}  // namespace river
