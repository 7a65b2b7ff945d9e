// The KV cache: one K and one V tensor per layer, shared by backbone and river layers.
// Row p of layer l holds token p's K (or V) at layer l, whichever weights computed it.
//
// Two layouts of V, as in llama.cpp's llama_kv_cache: with flash attention, V is stored like K
// ([n_embd_v_gqa, n_ctx], one row per position); without it V is transposed (v_trans:
// [n_ctx, n_embd_v_gqa], one row per V dimension, position p at column p), the layout the
// non-flash attention's kqv = V^T x softmax(KQ) product reads directly.
#pragma once
#include <vector>

#include "ggml-backend.h"
#include "ggml-cpp.h"
#include "hparams.h"

namespace river {

class KvCache {
public:
    // layer_backend[l]: where layer l's cache lives (the backend that computes layer l).
    KvCache(const HParams& hp, int n_ctx, ggml_type type, const std::vector<ggml_backend_t>& layer_backend,
            bool v_trans = false);
    ~KvCache() = default;
    KvCache(const KvCache&) = delete;
    KvCache& operator=(const KvCache&) = delete;

    int n_ctx() const { return n_ctx_; }
    bool v_trans() const { return v_trans_; }
    ggml_tensor* k(int il) const { return k_[il]; }
    ggml_tensor* v(int il) const { return v_[il]; }

    // Fill every entry with NaN, so that any slot a step forgot to write poisons the
    // attention that reads it and shows in a test (RIVER.md invariant 4).
    //
    // Without flash attention (v_trans) the entries are poison_value_no_fa() instead, finite: there the
    // attention multiplies every row it spans (masked ones too, with weight 0) and 0 x NaN is
    // NaN, so NaN in the padded rows beyond the batch would poison correct steps. A slot a step
    // forgot to write then holds a whole row of that value, which a test can look for.
    //
    // A device's flash attention (ggml-vulkan's, at least) also multiplies the masked rows it
    // spans, so caches in device memory get the finite poison with either layout, as a whole
    // row of it.
    void poison();
    // Whether layer il's cache holds the finite poison (else NaN).
    bool finite_poison(int il) const;
    // The non-flash poison as float (F16 0x1E1E, bytes 0x1E): small, so that a masked row's
    // K.Q stays finite even where the CPU accumulates in F16.
    static float poison_value_no_fa();
    // Layer il, positions [0, n) of K or V, as float32 rows of n_embd_{k,v}_gqa (whatever the
    // V layout).
    std::vector<float> read(int il, bool values, int n) const;

private:
    int n_ctx_;
    bool v_trans_;
    // The one rule for which poison a buffer gets: finite without flash attention or in device memory.
    bool finite_poison_in(ggml_backend_buffer_t buf) const;
    std::vector<ggml_tensor*> k_, v_;
    // Owned from creation, so a constructor that fails half-way frees them; buffers are
    // declared last so they are freed before the contexts that describe their tensors.
    std::vector<ggml_context_ptr> ctxs_;
    std::vector<ggml_backend_buffer_ptr> buffers_;
};

}  // namespace river
