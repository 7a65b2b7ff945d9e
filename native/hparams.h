// Model hyperparameters, read from GGUF metadata with llama.cpp's key names and defaults.
#pragma once
#include <string>
#include <vector>

#include "exit_setting.h"
#include "gguf_file.h"

namespace river {

struct ArchSpec;  // arch.h: the family's facts (native/models/)

// The default exit setting a River GGUF stores under its river.* keys (docs/format.md), read
// and checked with the file; keys a file lacks read as ExitSetting's defaults, river.exit_rule
// as "cosine" and the threshold as the rule's never_exit_threshold.
struct FileExitDefaults {
    ExitSetting setting;            // mode River: the rest from the keys
    bool threshold_stored = false;  // whether the file has river.threshold
    bool prefill_river = false;     // river.prefill: "river" (sequence-level exit), else "backbone"
};

struct HParams {
    const ArchSpec* arch = nullptr;
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
    int rope_type = 0;    // GGML_ROPE_TYPE_NORMAL or _NEOX (the family's)
    // The context the rope was trained for before any extension (rope.scaling.original_context_length,
    // else context_length): phi3's LongRoPE picks its long factors for contexts beyond it.
    int n_ctx_orig = 0;
    // What cos and sin are scaled by: rope.scaling.attn_factor (LongRoPE's magnitude correction),
    // times YaRN's, as llama.cpp computes its yarn_attn_factor for every architecture.
    float rope_attn_factor = 1.0f;
    // YaRN (rope.scaling.type = yarn): the extrapolation mix (1, else 0) and its ramp's bounds.
    float rope_ext_factor = 0.0f;
    float rope_beta_fast = 32.0f;
    float rope_beta_slow = 1.0f;
    // Llama 4's attention temperature (mistral3): Q of the token at position p is scaled by
    // log(floor(p / attn_temp_floor) + 1) * attn_temp_scale + 1; 0 means not applied.
    float attn_temp_scale = 0.0f;
    int attn_temp_floor = 0;

    // Multipliers and caps beyond llama; 0 means "not applied", as in llama.cpp.
    float embedding_scale = 0.0f;  // token embeddings times this (granite; sqrt(n_embd) for gemma)
    float residual_scale = 0.0f;   // granite: attention and FFN outputs times this before each residual add
    float logit_scale = 0.0f;      // granite: logits divided by this
    float attn_scale = 1.0f;       // the softmax scale of q.k
    // gemma and phi3 multiply Q by attn_scale before attention (which then scales by 1); the
    // others pass it to the attention op. The two round differently, so each follows llama.cpp.
    bool scale_q = false;
    float attn_softcap = 0.0f;     // gemma2: attention logits become cap * tanh(logit / cap)
    float final_softcap = 0.0f;    // gemma2: the same on the output logits

    // Sliding-window attention: layer il sees only the last n_swa positions (itself included)
    // when swa_layers[il]; those layers rotate with their own rope base and scale.
    int n_swa = 0;
    std::vector<bool> swa_layers;
    float rope_freq_base_swa = 10000.0f;
    float rope_freq_scale_swa = 1.0f;

    FileExitDefaults exit_defaults;  // the river.* keys (plain files: the defaults)

    int n_embd_k_gqa() const { return head_dim_k * n_head_kv; }
    int n_embd_v_gqa() const { return head_dim_v * n_head_kv; }
    bool is_swa(int il) const { return n_swa > 0 && swa_layers[il]; }
};

// Throws UnsupportedModelError naming the supported architectures.
HParams read_hparams(const GgufFile& file);

// The architectures this engine runs, as text for messages ("llama, qwen2, ...").
const char* supported_architectures();

}  // namespace river
