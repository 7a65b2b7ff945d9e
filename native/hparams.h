// Model hyperparameters, read from GGUF metadata with llama.cpp's key names and defaults.
#pragma once
#include <string>

#include "gguf_file.h"

namespace river {

enum class Arch { Llama, Qwen2, Qwen3 };

struct HParams {
    Arch arch = Arch::Llama;
    std::string arch_name;
    int n_layer = 0;
    int n_embd = 0;
    int n_head = 0;
    int n_head_kv = 0;
    int n_ff = 0;
    int head_dim_k = 0;   // per-head K (and Q) width
    int head_dim_v = 0;   // per-head V width
    int n_rot = 0;        // rotated dims per head
    int n_ctx_train = 0;
    int n_vocab = 0;
    float rms_eps = 1e-5f;
    float rope_freq_base = 10000.0f;
    float rope_freq_scale = 1.0f;
    int rope_type = 0;    // GGML_ROPE_TYPE_NORM or _NEOX

    int n_embd_k_gqa() const { return head_dim_k * n_head_kv; }
    int n_embd_v_gqa() const { return head_dim_v * n_head_kv; }
};

// Throws UnsupportedModelError naming the supported architectures.
HParams read_hparams(const GgufFile& file);

// Text like "llama, qwen2, qwen3", for messages.
const char* supported_architectures();

}  // namespace river
