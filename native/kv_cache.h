// The KV cache: one K and one V tensor per layer, shared by backbone and river layers.
// Row j of layer l holds the K (or V) at layer l of the token KvCells places there, whichever
// weights computed it; while one sequence alone fills the cache, row p holds its position p.
//
// Two layouts of V, as in llama.cpp's llama_kv_cache: with flash attention, V is stored like K
// ([n_embd_v_gqa, n_ctx], one row per position); without it V is transposed (v_trans:
// [n_ctx, n_embd_v_gqa], one row per V dimension, position p at column p), the layout the
// non-flash attention's kqv = V^T x softmax(KQ) product reads directly.
#pragma once
#include <cstdint>
#include <map>
#include <vector>

#include "ggml-backend.h"
#include "ggml-cpp.h"
#include "hparams.h"

namespace river {

// Which sequence and position each cache row holds: llama.cpp's KV cells, one sequence per row.
// A sequence holds positions 0..length-1 (tokens are appended, and only a tail is removed), so
// token p of sequence s sees exactly the rows of s at positions <= p. New tokens take the lowest
// free rows: while one sequence alone fills the cache, its row p holds position p.
class KvCells {
public:
    explicit KvCells(int n_ctx) : seq_(n_ctx, -1), pos_(n_ctx, -1) {}

    int n_ctx() const { return static_cast<int>(seq_.size()); }
    int used() const { return used_; }
    int free_rows() const { return n_ctx() - used_; }
    int used_end() const { return used_end_; }  // one past the highest row in use
    int length(int seq) const;
    // The sequences that hold positions, ascending.
    std::vector<int> sequences() const;
    // Row of each position of `seq`, in position order.
    const std::vector<int64_t>& rows(int seq) const;
    // Rows for n new tokens, token i appended to sequence seq[i] (in order): its position goes to
    // pos[i], its row to row[i]. The caller has checked that n rows are free.
    void place(const int32_t* seq, int n, int32_t* pos, int64_t* row);
    // Forget positions n.. of `seq` (n >= its length: nothing).
    void remove_tail(int seq, int n);
    // Whether a token of `seq` at position p attends to row j, and (n_swa > 0) within its window.
    bool visible(int j, int seq, int p) const { return seq_[j] == seq && pos_[j] <= p; }
    bool visible_swa(int j, int seq, int p, int n_swa) const { return visible(j, seq, p) && p - pos_[j] < n_swa; }

private:
    std::vector<int32_t> seq_, pos_;               // per row; -1: free
    std::map<int, std::vector<int64_t>> rows_;     // per sequence: row of each position
    int used_ = 0, used_end_ = 0, lowest_free_ = 0;
};

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
    // Layer il, rows [0, n) of K or V (positions [0, n) while one sequence alone fills the
    // cache), as float32 rows of n_embd_{k,v}_gqa (whatever the V layout).
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
