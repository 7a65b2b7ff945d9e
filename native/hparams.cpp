#include "hparams.h"

#include <algorithm>

#include "errors.h"

namespace river {

const char* supported_architectures() { return "llama, qwen2, qwen3"; }

namespace {

// llama.cpp lets some counts vary per layer; this engine needs them uniform.
int uniform_int(const GgufFile& f, const std::string& key, int def) {
    std::vector<int64_t> v = f.get_int_array(key);
    if (v.empty()) return def;
    if (std::any_of(v.begin(), v.end(), [&](int64_t x) { return x != v[0]; })) {
        throw UnsupportedModelError("per-layer values of '" + key + "' differ; only uniform layers are supported");
    }
    return static_cast<int>(v[0]);
}

}  // namespace

HParams read_hparams(const GgufFile& f) {
    HParams hp;
    hp.arch_name = f.get_str("general.architecture");
    if (hp.arch_name == "llama") hp.arch = Arch::Llama;
    else if (hp.arch_name == "qwen2") hp.arch = Arch::Qwen2;
    else if (hp.arch_name == "qwen3") hp.arch = Arch::Qwen3;
    else {
        throw UnsupportedModelError("unsupported architecture '" + hp.arch_name + "' in '" + f.path() +
                                    "'; supported: " + supported_architectures());
    }
    const std::string a = hp.arch_name + ".";

    hp.n_layer = static_cast<int>(f.get_int(a + "block_count", 0));
    hp.n_embd = static_cast<int>(f.get_int(a + "embedding_length", 0));
    hp.n_ff = uniform_int(f, a + "feed_forward_length", 0);
    hp.n_head = uniform_int(f, a + "attention.head_count", 0);
    hp.n_head_kv = uniform_int(f, a + "attention.head_count_kv", hp.n_head);
    hp.n_ctx_train = static_cast<int>(f.get_int(a + "context_length", 2048));
    if (hp.n_layer <= 0 || hp.n_embd <= 0 || hp.n_head <= 0 || hp.n_head_kv <= 0 || hp.n_ff <= 0) {
        throw GgufFormatError("'" + f.path() + "' lacks required " + hp.arch_name +
                              " hyperparameters (block_count, embedding_length, feed_forward_length, attention.head_count)");
    }
    if (hp.n_head % hp.n_head_kv != 0) throw UnsupportedModelError("head_count is not a multiple of head_count_kv");
    hp.head_dim_k = static_cast<int>(f.get_int(a + "attention.key_length", hp.n_embd / hp.n_head));
    hp.head_dim_v = static_cast<int>(f.get_int(a + "attention.value_length", hp.n_embd / hp.n_head));
    hp.n_rot = static_cast<int>(f.get_int(a + "rope.dimension_count", hp.head_dim_k));
    hp.rms_eps = f.get_float(a + "attention.layer_norm_rms_epsilon", 1e-5f);
    hp.rope_freq_base = f.get_float(a + "rope.freq_base", 10000.0f);

    // Linear scaling may be given as a factor (new key) or directly as a scale (old key).
    const std::string scaling = f.get_str(a + "rope.scaling.type", "none");
    float factor = f.get_float(a + "rope.scaling.factor", 0.0f);
    if (scaling != "none" && scaling != "linear" && !(scaling == "llama3")) {
        throw UnsupportedModelError("rope scaling type '" + scaling + "' is not supported (none, linear, llama3 via rope_freqs)");
    }
    if (scaling == "linear" && factor > 0.0f) hp.rope_freq_scale = 1.0f / factor;
    const float scale_linear = f.get_float(a + "rope.scale_linear", 0.0f);
    if (scale_linear > 0.0f) hp.rope_freq_scale = 1.0f / scale_linear;

    hp.rope_type = hp.arch == Arch::Llama ? GGML_ROPE_TYPE_NORMAL : GGML_ROPE_TYPE_NEOX;

    const ggml_tensor* emb = f.tensor("token_embd.weight");
    if (!emb) throw UnsupportedModelError("'" + f.path() + "' has no token_embd.weight");
    hp.n_vocab = static_cast<int>(emb->ne[1]);
    return hp;
}

}  // namespace river
