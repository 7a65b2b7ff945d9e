#include "layer_graph.h"

#include <cmath>

namespace river {

namespace {

ggml_tensor* rms_norm(ggml_context* ctx, ggml_tensor* x, ggml_tensor* weight, float eps) {
    return ggml_mul(ctx, ggml_rms_norm(ctx, x, eps), weight);
}

ggml_tensor* linear(ggml_context* ctx, ggml_tensor* w, ggml_tensor* b, ggml_tensor* x) {
    ggml_tensor* y = ggml_mul_mat(ctx, w, x);
    return b ? ggml_add(ctx, y, b) : y;
}

ggml_tensor* rope(ggml_context* ctx, const HParams& hp, ggml_tensor* x, const BatchInputs& in, ggml_tensor* freqs) {
    return ggml_rope_ext(ctx, x, in.positions, freqs, hp.n_rot, hp.rope_type, hp.n_ctx_train, hp.rope_freq_base,
                         hp.rope_freq_scale, /*ext_factor=*/0.0f, /*attn_factor=*/1.0f,
                         /*beta_fast=*/32.0f, /*beta_slow=*/1.0f);
}

}  // namespace

ggml_tensor* build_decoder_layer(ggml_context* ctx, ggml_cgraph* gf, const HParams& hp, const LayerWeights& w,
                                 ggml_tensor* rope_freqs, KvCache& cache, int il, const BatchInputs& in,
                                 ggml_tensor* h) {
    const int n = in.n_tokens;
    const int n_kv = in.n_kv;

    // Attention.
    ggml_tensor* x = rms_norm(ctx, h, w.attn_norm, hp.rms_eps);
    ggml_tensor *q, *k, *v;
    const int64_t nq = int64_t(hp.n_head) * hp.head_dim_k, nk = hp.n_embd_k_gqa(), nv = hp.n_embd_v_gqa();
    if (w.wqkv) {
        // One mul_mat; Q, K and V are row ranges of its output.
        ggml_tensor* qkv = ggml_mul_mat(ctx, w.wqkv, x);
        const size_t es = ggml_element_size(qkv);
        q = ggml_view_2d(ctx, qkv, nq, n, qkv->nb[1], 0);
        k = ggml_view_2d(ctx, qkv, nk, n, qkv->nb[1], es * nq);
        v = ggml_view_2d(ctx, qkv, nv, n, qkv->nb[1], es * (nq + nk));
        if (w.bq) q = ggml_add(ctx, q, w.bq);
        if (w.bk) k = ggml_add(ctx, k, w.bk);
        if (w.bv) v = ggml_add(ctx, v, w.bv);
        // Views of a row range are strided; rope and the reshapes below take them as 3-d views.
        q = w.bq ? ggml_reshape_3d(ctx, q, hp.head_dim_k, hp.n_head, n)
                 : ggml_view_3d(ctx, qkv, hp.head_dim_k, hp.n_head, n, es * hp.head_dim_k, qkv->nb[1], 0);
        k = w.bk ? ggml_reshape_3d(ctx, k, hp.head_dim_k, hp.n_head_kv, n)
                 : ggml_view_3d(ctx, qkv, hp.head_dim_k, hp.n_head_kv, n, es * hp.head_dim_k, qkv->nb[1], es * nq);
    } else {
        q = ggml_reshape_3d(ctx, linear(ctx, w.wq, w.bq, x), hp.head_dim_k, hp.n_head, n);
        k = ggml_reshape_3d(ctx, linear(ctx, w.wk, w.bk, x), hp.head_dim_k, hp.n_head_kv, n);
        v = linear(ctx, w.wv, w.bv, x);
    }
    if (w.q_norm) {  // qwen3 normalizes each head before rope
        q = rms_norm(ctx, q, w.q_norm, hp.rms_eps);
        k = rms_norm(ctx, k, w.k_norm, hp.rms_eps);
    }
    q = rope(ctx, hp, q, in, rope_freqs);
    k = rope(ctx, hp, k, in, rope_freqs);

    // KV write: this batch's rows of cache layer il, addressed by an input tensor so that the
    // graph does not depend on the position. Expanded before the reads below, so the graph
    // orders the write first.
    ggml_tensor* ck = cache.k(il);
    ggml_tensor* cv = cache.v(il);
    ggml_build_forward_expand(gf, ggml_set_rows(ctx, ck, ggml_reshape_2d(ctx, k, hp.n_embd_k_gqa(), n), in.kv_rows));
    ggml_build_forward_expand(gf, ggml_set_rows(ctx, cv, v, in.kv_rows));

    ggml_tensor* keys = ggml_view_3d(ctx, ck, hp.head_dim_k, n_kv, hp.n_head_kv, ck->nb[1],
                                     ggml_row_size(ck->type, hp.head_dim_k), 0);
    ggml_tensor* vals = ggml_view_3d(ctx, cv, hp.head_dim_v, n_kv, hp.n_head_kv, cv->nb[1],
                                     ggml_row_size(cv->type, hp.head_dim_v), 0);
    ggml_tensor* qp = ggml_permute(ctx, q, 0, 2, 1, 3);  // [head_dim, n, n_head]
    ggml_tensor* att = ggml_flash_attn_ext(ctx, qp, keys, vals, in.kq_mask, 1.0f / std::sqrt(float(hp.head_dim_k)),
                                           0.0f, 0.0f);
    ggml_prec_set_acc(att, GGML_PREC_F32);
    att = ggml_reshape_2d(ctx, att, hp.head_dim_v * hp.n_head, n);
    ggml_tensor* h_attn = ggml_add(ctx, h, ggml_mul_mat(ctx, w.wo, att));

    // Feed-forward (SwiGLU).
    x = rms_norm(ctx, h_attn, w.ffn_norm, hp.rms_eps);
    // silu(gate) * up; with the joined weight, gate and up are the two halves of one output row.
    ggml_tensor* ff = w.ffn_gate_up ? ggml_swiglu(ctx, ggml_mul_mat(ctx, w.ffn_gate_up, x))
                                    : ggml_swiglu_split(ctx, ggml_mul_mat(ctx, w.ffn_gate, x), ggml_mul_mat(ctx, w.ffn_up, x));
    return ggml_add(ctx, h_attn, ggml_mul_mat(ctx, w.ffn_down, ff));
}

ggml_tensor* build_state_similarity(ggml_context* ctx, ggml_tensor* h_in, ggml_tensor* h_out) {
    ggml_tensor* dot = ggml_sum_rows(ctx, ggml_mul(ctx, h_in, h_out));
    ggml_tensor* n_in = ggml_sum_rows(ctx, ggml_sqr(ctx, h_in));
    ggml_tensor* n_out = ggml_sum_rows(ctx, ggml_sqr(ctx, h_out));
    return ggml_div(ctx, dot, ggml_sqrt(ctx, ggml_mul(ctx, n_in, n_out)));
}

ggml_tensor* build_head(ggml_context* ctx, const HParams& hp, ggml_tensor* output_norm, ggml_tensor* head,
                        ggml_tensor* h) {
    return ggml_mul_mat(ctx, head, rms_norm(ctx, h, output_norm, hp.rms_eps));
}

}  // namespace river
