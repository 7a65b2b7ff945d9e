// Named views of a model's tensors: the backbone's, and the exit river's per-layer copies.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "ggml-backend.h"
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
    ggml_tensor* q_norm = nullptr;  // qwen3
    ggml_tensor* k_norm = nullptr;
    ggml_tensor* ffn_norm = nullptr;
    ggml_tensor* ffn_gate = nullptr;
    ggml_tensor* ffn_up = nullptr;
    ggml_tensor* ffn_down = nullptr;
};

struct BackboneWeights {
    ggml_tensor* tok_embd = nullptr;
    ggml_tensor* output_norm = nullptr;
    ggml_tensor* output = nullptr;      // the head; tok_embd when the model ties them
    ggml_tensor* rope_freqs = nullptr;  // llama3-style per-dimension rope factors
    std::vector<LayerWeights> layers;
};

// The exit river: the same layers at lower precision.
struct RiverWeights {
    std::vector<LayerWeights> layers;
    ggml_tensor* tok_embd = nullptr;  // used by river-only mode when present
    ggml_tensor* head = nullptr;      // quantized output head, when present
};

// prefix "" for a plain GGUF, "river." for the river inside a River GGUF.
BackboneWeights load_backbone(const GgufFile& f, const HParams& hp);
RiverWeights load_river(const GgufFile& f, const HParams& hp, const std::string& prefix);

// Copies of some tensors in another buffer type: a GPU's memory for offloaded layers, or a
// CPU "extra" buffer type that repacks weights for faster matrix kernels. Owns the buffer.
class DeviceWeights {
public:
    DeviceWeights() = default;
    ~DeviceWeights();
    DeviceWeights(const DeviceWeights&) = delete;
    DeviceWeights& operator=(const DeviceWeights&) = delete;
    // Replace each *slot by a copy living in a buffer of type `buft`.
    void move(ggml_backend_buffer_type_t buft, const std::vector<ggml_tensor**>& slots);

private:
    ggml_context* ctx_ = nullptr;
    ggml_backend_buffer_t buffer_ = nullptr;
};

// Every tensor slot of a layer, for placement.
std::vector<ggml_tensor**> layer_slots(LayerWeights& w);
// The slots used only as mul_mat weights (candidates for repacked CPU buffers).
std::vector<ggml_tensor**> matmul_slots(LayerWeights& w);

// The CPU device's extra buffer types (repacked layouts), in preference order.
std::vector<ggml_backend_buffer_type_t> cpu_extra_buffer_types();
// Whether `buft` can hold `w` as the weight of a mul_mat on `dev` (llama.cpp's test too).
bool buft_supports_matmul(ggml_backend_dev_t dev, ggml_backend_buffer_type_t buft, const ggml_tensor* w);

}  // namespace river
