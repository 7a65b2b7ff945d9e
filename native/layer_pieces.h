// The pieces every layer function builds with (llama.cpp's llama-graph.cpp): norms, the Q/K/V
// projections, heads, rope, the KV write and attention, the gated FFN. Each family's layer
// function (native/models/) strings them together in its own order.
#pragma once
#include "ggml.h"
#include "hparams.h"
#include "kv_cache.h"
#include "layer_graph.h"
#include "weights.h"

namespace river {

// What every layer function works with.
struct LayerGraph {
    ggml_context* ctx;
    ggml_cgraph* gf;
    const HParams& hp;
    const LayerWeights& w;
    ggml_tensor* rope_freqs;
    KvCache& cache;
    int il;
    const BatchInputs& in;
};

ggml_tensor* rms_norm(ggml_context* ctx, ggml_tensor* x, ggml_tensor* weight, float eps);

// Q, K and V as [width, n_tokens]. With a joined weight they are row ranges of one product:
// strided views, which the ops below read in place.
struct Projections {
    ggml_tensor *q, *k, *v;
};
Projections project_qkv(const LayerGraph& L, ggml_tensor* x);

// [head_dim * n_heads, n] -> [head_dim, n_heads, n]; a strided view stays a view.
ggml_tensor* split_heads(ggml_context* ctx, ggml_tensor* t, int head_dim, int n_heads, int n);

// Rotary embedding of [head_dim, n_heads, n] by position; sliding-window layers may have their
// own base and scale (gemma3, olmo2).
ggml_tensor* rope(const LayerGraph& L, ggml_tensor* x);

// The KV write and the attention over cache layer il, then the output projection.
// q, k: [head_dim, heads, n], roped; v: [n_embd_v_gqa, n]. Q arrives pre-scaled where the
// architecture scales it (then kq_scale is 1).
ggml_tensor* attention(const LayerGraph& L, ggml_tensor* q, ggml_tensor* k, ggml_tensor* v, float kq_scale);

// The rows that go on past the attention: in the model's last layer of a graph whose head reads
// only the last row (BatchInputs::last_row_only), that row alone, or the rows out_ids selects
// (several sequences' last rows); elsewhere all of `t`. Each
// family applies it to both operands of the attention's residual add, where llama.cpp selects
// its output rows, so the last FFN is the same one-row product (a mat-vec on a GPU) as there.
ggml_tensor* output_rows(const LayerGraph& L, ggml_tensor* t);

enum class Gate { Silu, Gelu };
// The gated FFN: act(gate) * up, then down. With the joined weight, gate and up are the two
// halves of one output row.
ggml_tensor* gated_ffn(const LayerGraph& L, ggml_tensor* x, Gate gate);

// Q and K of the projections split into heads, each normed when the layer has per-head q/k
// norms (qwen3, gemma3).
struct Heads {
    ggml_tensor *q, *k;
};
Heads split_qk(const LayerGraph& L, const Projections& p);

}  // namespace river
