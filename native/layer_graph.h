// Graph pieces for the supported decoders: the embedding, one decoder layer (a function per
// architecture family, sharing norms, rope, attention and FFN), and the output head. Each
// function adds nodes to `gf` and returns the result.
#pragma once
#include <vector>

#include "ggml.h"
#include "hparams.h"
#include "kv_cache.h"
#include "weights.h"

namespace river {

// Per-batch inputs shared by every layer of one graph.
struct BatchInputs {
    int n_tokens = 0;
    int n_kv = 0;                      // cache rows attended over (masked beyond each token's position)
    // The head reads only the batch's last row: the model's last layer keeps that row alone from
    // its attention output on (llama.cpp's inp_out_ids), so its residual and FFN run on one row.
    bool last_row_only = false;
    // I32 [n_out]: the rows the head reads, where they are not the last alone nor all of them
    // (each sequence's last row in a batch of several); the model's last layer keeps those rows
    // from its attention output on, as with last_row_only. nullptr otherwise.
    ggml_tensor* out_ids = nullptr;
    ggml_tensor* positions = nullptr;  // I32 [n_tokens]
    ggml_tensor* kv_rows = nullptr;    // I64 [n_tokens]: the cache row each token's K/V goes to
    // Flash attention (ggml_flash_attn_ext, V stored like K), else llama.cpp's non-flash path
    // (KQ, soft_max_ext, V^T x KQ, V stored transposed: KvCache::v_trans).
    bool flash_attn = true;
    // Without flash attention: I64 [n_embd_v_gqa * n_tokens], the element of the transposed V
    // cache each V value goes to (dim j of token i: j * n_ctx + row_i), as llama.cpp's v_idxs.
    ggml_tensor* v_idxs = nullptr;
    // [n_kv, n_tokens], causal; F16 for flash attention, F32 without (as llama.cpp); nullptr
    // unless the graph runs a global-attention layer.
    ggml_tensor* kq_mask = nullptr;
    // Same type, causal and within the sliding window; nullptr unless the graph
    // runs a sliding-window layer.
    ggml_tensor* kq_mask_swa = nullptr;
    // F32 [1, 1, n_tokens]: each token's attention temperature (hp.attn_temp_scale), by which its
    // roped Q is multiplied; nullptr when the model has none.
    ggml_tensor* attn_temp = nullptr;
    // Every row of the batch in the single-token kernels (a batch of several tokens otherwise
    // takes ggml's batched ones, which round differently): each weight product reads its
    // activations pre-converted to the weight's dot-product type in padded rows (weight_product),
    // and each row attends alone over the cache rows a decode step at its position would
    // (row_n_kv). So every row's bits are those of a decode step: a lossless verify batch whose
    // text is plain decoding's.
    bool decode_kernels = false;
    std::vector<int> row_n_kv;  // with decode_kernels: each row's n_kv, as a decode step pads it
};

// w x (ggml_mul_mat). With decode_kernels and several columns, each column as a decode step
// computes it, bit for bit, where the CPU reads w in its plain layout (a host buffer: a
// repacked weight has its own kernels for one column and for several): ggml's CPU mat-mul gives
// a batch to llamafile's tiled kernels only when the activations are contiguous (converted, or
// already of the weight's dot-product type), and a lone column to the dot-product loop. Here the
// activations arrive converted, as that loop converts them, in rows padded past their width: not
// contiguous, so every column goes through the loop.
ggml_tensor* weight_product(ggml_context* ctx, ggml_tensor* w, ggml_tensor* x, bool decode_kernels);

// Token embeddings from `table` (backbone's or river's), with the architecture's input scale.
ggml_tensor* build_embedding(ggml_context* ctx, const HParams& hp, ggml_tensor* table, ggml_tensor* tokens);

// One decoder layer `il` with weights `w` (backbone or river: same shapes). It writes this
// batch's K/V into cache layer il at rows kv_rows, then attends over rows 0..n_kv-1 (those the
// layer's mask lets each token see: a sliding-window layer sees only its window, whichever
// weights wrote the rows).
ggml_tensor* build_decoder_layer(ggml_context* ctx, ggml_cgraph* gf, const HParams& hp, const LayerWeights& w,
                                 ggml_tensor* rope_freqs, KvCache& cache, int il, const BatchInputs& in,
                                 ggml_tensor* h);

// The final RMS norm: what the head reads, and llama.cpp's embeddings (its "result_norm").
ggml_tensor* build_final_norm(ggml_context* ctx, const HParams& hp, ggml_tensor* output_norm, ggml_tensor* h);

// Final RMS norm, the head, and the architecture's logit scale or cap: logits F32 [n_vocab, n_rows].
ggml_tensor* build_head(ggml_context* ctx, const HParams& hp, ggml_tensor* output_norm, ggml_tensor* head,
                        ggml_tensor* h, bool decode_kernels = false);

}  // namespace river
