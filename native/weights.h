// Named views of a model's tensors: the backbone's, and the exit river's per-layer copies.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "ggml-backend.h"
#include "ggml-cpp.h"
#include "gguf_file.h"
#include "hparams.h"

namespace river {

// One decoder layer. Optional tensors are nullptr when the architecture lacks them.
struct LayerWeights {
    ggml_tensor* attn_norm = nullptr;
    ggml_tensor* wq = nullptr;
    ggml_tensor* wk = nullptr;
    ggml_tensor* wv = nullptr;
    ggml_tensor* wo = nullptr;
    ggml_tensor* bq = nullptr;      // qwen2
    ggml_tensor* bk = nullptr;
    ggml_tensor* bv = nullptr;
    ggml_tensor* q_norm = nullptr;  // qwen3, gemma3: per head; olmo2: over the whole projection
    ggml_tensor* k_norm = nullptr;
    ggml_tensor* attn_post_norm = nullptr;  // gemma2/3, olmo2: on the attention output, before the residual add
    ggml_tensor* ffn_norm = nullptr;
    ggml_tensor* ffn_gate = nullptr;
    ggml_tensor* ffn_up = nullptr;
    ggml_tensor* ffn_down = nullptr;
    ggml_tensor* ffn_post_norm = nullptr;   // gemma2/3, olmo2: on the FFN output
    // Row-concatenations made at load where weights are copied anyway (repacked CPU buffers):
    // one mul_mat instead of three (Q, K, V) or two (gate, up). Each output row is the same dot
    // product as before, so logits do not change; a decode step runs 3 fewer graph nodes per
    // layer, and on a small model each node's thread barrier is a visible share of the step.
    // phi3 files hold both joined already (attn_qkv, and ffn_up with 2 x n_ff rows); then the
    // separate slots stay nullptr.
    ggml_tensor* wqkv = nullptr;         // rows: wq, then wk, then wv
    ggml_tensor* ffn_gate_up = nullptr;  // rows: ffn_gate, then ffn_up
};

struct BackboneWeights {
    ggml_tensor* tok_embd = nullptr;
    ggml_tensor* output_norm = nullptr;
    ggml_tensor* output = nullptr;      // the head; tok_embd when the model ties them
    ggml_tensor* draft_output = nullptr;  // the head's draft-vocabulary rows (HeadRows), when set
    ggml_tensor* rope_freqs = nullptr;  // llama3-style per-dimension rope factors
    // phi3's LongRoPE factors: two sets, one for contexts within n_ctx_orig and one beyond.
    ggml_tensor* rope_long = nullptr;
    ggml_tensor* rope_short = nullptr;
    std::vector<LayerWeights> layers;

    // The per-dimension rope factors a context of n_ctx positions runs with (nullptr: none).
    // As llama.cpp, which compares its context rounded up to 256 positions.
    ggml_tensor* rope_factors(const HParams& hp, int n_ctx) const;
};

// The exit river: the same layers at lower precision.
struct RiverWeights {
    std::vector<LayerWeights> layers;
    ggml_tensor* tok_embd = nullptr;  // used by river-only mode when present
    ggml_tensor* head = nullptr;      // quantized output head, when present
    ggml_tensor* draft_head = nullptr;  // its draft-vocabulary rows (HeadRows), when set
};

// A layer's tensors, looked up by name in one file ("blk.N." after the prefix) and checked
// against the shapes the hyperparameters give: each family's load_layer (native/models/) asks
// for the tensors it has.
class LayerLoader {
public:
    LayerLoader(const GgufFile& f, const HParams& hp, const std::string& prefix, int il, bool river);
    const HParams& hp;
    const int64_t e, q, k, v, o;  // widths: the embedding, Q, K, V and the attention output
    // A 1-D F32 tensor of `len` (nullptr when absent and not required).
    ggml_tensor* vec(const std::string& name, int64_t len, bool required = true) const;
    // A mul_mat weight mapping `in` to `out`.
    ggml_tensor* mat(const std::string& name, int64_t in, int64_t out) const;
    bool has(const std::string& name) const;
    // A tensor llama.cpp would use but this engine does not run: refused rather than ignored.
    void refuse(const std::string& name, const std::string& what) const;

private:
    const GgufFile& f_;
    std::string p_;
    bool river_;  // a river's shape that differs from the backbone's is another model
};

// The pieces most families' layers share.
// Separate Q, K, V and the output projection, with optional (or required) Q/K/V biases.
void load_qkvo(const LayerLoader& ld, LayerWeights& w, bool biases_required);
void load_qkv_biases(const LayerLoader& ld, LayerWeights& w, bool required);
// llama's layer: attn_norm, load_qkvo, ffn_norm, load_gated_ffn.
void load_llama_layer(const LayerLoader& ld, LayerWeights& w, bool biases_required);
// ffn_gate, ffn_up, ffn_down.
void load_gated_ffn(const LayerLoader& ld, LayerWeights& w);
// llama.cpp's loader would run these; this engine does not: refused.
void refuse_biases_and_experts(const LayerLoader& ld);

// prefix "" for a plain GGUF, "river." for the river inside a River GGUF.
BackboneWeights load_backbone(const GgufFile& f, const HParams& hp);
RiverWeights load_river(const GgufFile& f, const HParams& hp, const std::string& prefix);

// Weights joined into one mat-mul at load when they share a type (placement's `fuse`): the
// parts' slots and GGUF tensor kinds, in row order, and the joined slot. A joined weight is named
// after its first part plus `suffix`, e.g. "blk.3.attn_q.weight+k+v" (ggml names hold 63 chars).
struct LayerJoin {
    std::vector<ggml_tensor* LayerWeights::*> parts;
    std::vector<const char*> kinds;
    ggml_tensor* LayerWeights::*joined;
    const char* suffix;
};
const std::vector<LayerJoin>& layer_joins();
// The part names of a weight name: its parts if joined, else the name itself.
std::vector<std::string> joined_parts(const std::string& name);

// A layer's attention group, by slot and GGUF tensor kind (a kind once per slot: a bias shares
// its weight's): what a river layer takes from the backbone with backbone_attention.
struct SlotKind {
    ggml_tensor* LayerWeights::*slot;
    const char* kind;
};
const std::vector<SlotKind>& attention_group();

// Every tensor slot of a layer, for placement (empty slots are skipped by the placement).
std::vector<ggml_tensor**> layer_slots(LayerWeights& w);
// `ffn_from`'s weights with the attention group (attention_group()) of `attention_from`: a
// layer of the same shape.
LayerWeights with_attention_of(const LayerWeights& ffn_from, const LayerWeights& attention_from);
// The filled slots used only as mul_mat weights (candidates for repacked CPU buffers).
std::vector<ggml_tensor**> matmul_slots(LayerWeights& w);
// Whether the file holds a complete-looking river: its first layer's attention output, which
// every supported architecture has.
bool has_river_layers(const GgufFile& f);
inline constexpr const char* kRiverMarker = "river.blk.0.attn_output.weight";

// ggml's name of a tensor type, or "type N" for one it does not know.
std::string type_name(ggml_type t);

// How a weight is used, which decides the types it may have.
enum class WeightUse {
    Vector,     // 1-D: norm weights, biases, rope factors; read by element-wise ops in F32
    MatMul,     // the weight of a mul_mat
    Embedding,  // the table of a get_rows
    TiedTable,  // an embedding table that is also the head's mul_mat weight
};
// Throws GgufFormatError naming the tensor when the CPU backend cannot run `use` on its type
// (ggml would abort or crash at the first graph otherwise).
void check_weight_type(const GgufFile& f, const ggml_tensor* t, WeightUse use);
// Whether the CPU backend has a mul_mat kernel for weight w's type / a get_rows for it.
bool cpu_can_matmul(const ggml_tensor* w);
bool cpu_can_get_rows(const ggml_tensor* w);
}  // namespace river
