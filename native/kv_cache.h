// The KV cache: one K and one V tensor per layer, shared by backbone and river layers.
// Row p of layer l holds token p's K (or V) at layer l, whichever weights computed it.
#pragma once
#include <vector>

#include "ggml-backend.h"
#include "ggml-cpp.h"
#include "hparams.h"

namespace river {

class KvCache {
public:
    // layer_backend[l]: where layer l's cache lives (the backend that computes layer l).
    KvCache(const HParams& hp, int n_ctx, ggml_type type, const std::vector<ggml_backend_t>& layer_backend);
    ~KvCache() = default;
    KvCache(const KvCache&) = delete;
    KvCache& operator=(const KvCache&) = delete;

    int n_ctx() const { return n_ctx_; }
    ggml_tensor* k(int il) const { return k_[il]; }
    ggml_tensor* v(int il) const { return v_[il]; }

    // Fill every entry with NaN, so that any slot a step forgot to write poisons the
    // attention that reads it and shows in a test (RIVER.md invariant 4).
    void poison();
    // Layer il, positions [0, n) of K or V, as float32 rows of n_embd_{k,v}_gqa.
    std::vector<float> read(int il, bool values, int n) const;

private:
    int n_ctx_;
    std::vector<ggml_tensor*> k_, v_;
    // Owned from creation, so a constructor that fails half-way frees them; buffers are
    // declared last so they are freed before the contexts that describe their tensors.
    std::vector<ggml_context_ptr> ctxs_;
    std::vector<ggml_backend_buffer_ptr> buffers_;
};

}  // namespace river
