#include "hparams.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <set>

#include "arch.h"
#include "errors.h"
#include "exit_rule.h"
#include "hparams_read.h"

namespace river {

namespace {

std::string num(double v) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%g", v);
    return buf;
}

int in_range(const GgufFile& f, const std::string& key, int64_t v, int64_t lo, int64_t hi) {
    if (v < lo || v > hi) bad_value(f, key, std::to_string(v), "must be in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
    return static_cast<int>(v);
}

// llama.cpp lets some counts vary per layer; this engine needs them uniform.
int uniform_int(const GgufFile& f, const std::string& key, int64_t def, int64_t lo, int64_t hi) {
    std::vector<int64_t> v = f.get_int_array(key);
    if (v.empty()) {
        if (def < 0) throw GgufFormatError("'" + f.path() + "' lacks the required key " + key);
        return static_cast<int>(def);
    }
    if (std::any_of(v.begin(), v.end(), [&](int64_t x) { return x != v[0]; })) {
        throw UnsupportedModelError("per-layer values of '" + key + "' differ; only uniform layers are supported");
    }
    return in_range(f, key, v[0], lo, hi);
}

// The layer index of "blk.N.*" (after `prefix`), or -1 for other names. Indices too long to
// be a layer count come back as kMaxLayers, which no block_count reaches.
int64_t layer_index(const std::string& name, const std::string& prefix) {
    const std::string head = prefix + "blk.";
    if (name.compare(0, head.size(), head) != 0) return -1;
    int64_t n = 0;
    size_t i = head.size(), digits = 0;
    for (; i < name.size() && name[i] >= '0' && name[i] <= '9'; ++i, ++digits) {
        n = std::min<int64_t>(n * 10 + (name[i] - '0'), kMaxLayers);
    }
    if (digits == 0 || i >= name.size() || name[i] != '.') return -1;
    return n;
}

// The layers present as tensors (blk.N.*, and river.blk.N.* when any) must be exactly
// 0..block_count-1: more would be ignored, fewer would run missing layers.
void check_layer_tensors(const GgufFile& f, int n_layer, const std::string& block_key) {
    for (const char* prefix : {"", "river."}) {
        std::set<int64_t> present;
        std::string example;
        for (const std::string& name : f.tensor_names()) {
            const int64_t il = layer_index(name, prefix);
            if (il < 0) continue;
            if (il >= n_layer) {
                throw GgufFormatError("'" + f.path() + "': tensor '" + name + "' belongs to layer " + std::to_string(il) +
                                      " but " + block_key + " is " + std::to_string(n_layer));
            }
            present.insert(il);
        }
        if (present.empty() && *prefix) continue;  // no river in this file
        if (static_cast<int>(present.size()) != n_layer) {
            int64_t missing = 0;
            while (present.count(missing)) ++missing;
            throw GgufFormatError("'" + f.path() + "': " + block_key + " is " + std::to_string(n_layer) +
                                  " but the file has no " + prefix + "blk." + std::to_string(missing) + ".* tensors");
        }
    }
}

// The token list is read by this engine (river checks) and by libllama; both need strings.
void check_token_list(const GgufFile& f, int n_vocab) {
    gguf_context* g = f.meta();
    const int64_t id = gguf_find_key(g, "tokenizer.ggml.tokens");
    if (id < 0) return;  // the vocabulary loader reports it
    if (gguf_get_kv_type(g, id) != GGUF_TYPE_ARRAY || gguf_get_arr_type(g, id) != GGUF_TYPE_STRING) {
        throw GgufFormatError("'" + f.path() + "': tokenizer.ggml.tokens is not an array of strings");
    }
    const size_t n = gguf_get_arr_n(g, id);
    if (n != static_cast<size_t>(n_vocab)) {
        throw GgufFormatError("'" + f.path() + "': tokenizer.ggml.tokens has " + std::to_string(n) +
                              " tokens but token_embd.weight has " + std::to_string(n_vocab) + " rows");
    }
}

bool valid_utf8(const std::string& s) {
    const auto* p = reinterpret_cast<const unsigned char*>(s.data());
    const size_t n = s.size();
    for (size_t i = 0; i < n;) {
        const unsigned char c = p[i];
        size_t len = 0;
        unsigned char lo = 0x80, hi = 0xBF;  // the allowed range of the second byte
        if (c < 0x80) len = 1;
        else if (c >= 0xC2 && c <= 0xDF) len = 2;
        else if (c >= 0xE0 && c <= 0xEF) len = 3, lo = c == 0xE0 ? 0xA0 : 0x80, hi = c == 0xED ? 0x9F : 0xBF;
        else if (c >= 0xF0 && c <= 0xF4) len = 4, lo = c == 0xF0 ? 0x90 : 0x80, hi = c == 0xF4 ? 0x8F : 0xBF;
        else return false;
        if (i + len > n) return false;
        for (size_t k = 1; k < len; ++k) {
            const unsigned char b = p[i + k];
            if (k == 1 ? (b < lo || b > hi) : (b < 0x80 || b > 0xBF)) return false;
        }
        i += len;
    }
    return true;
}

// GGUF text is UTF-8. Keys, string values and tensor names reach Python as str (metadata, the
// chat template, error messages), where other bytes would raise UnicodeDecodeError instead.
void check_text(const GgufFile& f) {
    gguf_context* g = f.meta();
    for (int64_t i = 0; i < gguf_get_n_kv(g); ++i) {
        const std::string key = gguf_get_key(g, i);
        if (!valid_utf8(key)) throw GgufFormatError("'" + f.path() + "': metadata key " + std::to_string(i) + " is not UTF-8 text");
        if (gguf_get_kv_type(g, i) == GGUF_TYPE_STRING && !valid_utf8(gguf_get_val_str(g, i))) {
            throw GgufFormatError("'" + f.path() + "': the value of " + key + " is not UTF-8 text");
        }
    }
    for (int64_t i = 0; i < gguf_get_n_tensors(g); ++i) {
        if (!valid_utf8(gguf_get_tensor_name(g, i))) {
            throw GgufFormatError("'" + f.path() + "': the name of tensor " + std::to_string(i) + " is not UTF-8 text");
        }
    }
}

// The exit defaults a River GGUF stores (written by the converter, docs/format.md): their types
// and ranges, so that a damaged value is a format error rather than a setting no call could ask.
FileExitDefaults read_exit_defaults(const GgufFile& f, int n_layer) {
    FileExitDefaults d;
    ExitSetting& s = d.setting;
    s.mode = ExitMode::River;
    const std::string rule = f.get_str("river.exit_rule", exit_rules()[0]->name);
    s.rule = exit_rule_code(rule);
    if (s.rule < 0) bad_value(f, "river.exit_rule", "'" + rule + "'", "one of " + exit_rule_names());
    d.threshold_stored = f.has_key("river.threshold");
    s.threshold = never_exit_threshold(exit_rule(s.rule));
    if (d.threshold_stored) {
        s.threshold = f.get_float("river.threshold", s.threshold);
        if (!std::isfinite(s.threshold)) bad_value(f, "river.threshold", num(s.threshold), "must be finite");
    }
    s.min_exit_layer = bounded_int(f, "river.min_exit_layer", s.min_exit_layer, 0, n_layer - 1);
    s.tail = bounded_int(f, "river.tail", s.tail, 0, n_layer - 1);
    if (f.has_key("river.head")) s.river_head = f.get_int("river.head", 0) != 0;  // a bool (or an integer)
    const std::string prefill = f.get_str("river.prefill", "backbone");
    if (prefill != "backbone" && prefill != "river") bad_value(f, "river.prefill", "'" + prefill + "'", "backbone or river");
    d.prefill_river = prefill == "river";
    f.get_str("river.presets");
    f.get_str("river.default_preset");
    return d;
}

}  // namespace

void bad_value(const GgufFile& f, const std::string& key, const std::string& value, const std::string& rule) {
    throw GgufFormatError("'" + f.path() + "': " + key + " = " + value + " is invalid (" + rule + ")");
}

int bounded_int(const GgufFile& f, const std::string& key, int64_t def, int64_t lo, int64_t hi) {
    if (!f.has_key(key)) {
        if (def < 0) throw GgufFormatError("'" + f.path() + "' lacks the required key " + key);
        return static_cast<int>(def);
    }
    return in_range(f, key, f.get_int(key, def), lo, hi);
}

float finite_float(const GgufFile& f, const std::string& key, float def, bool allow_zero) {
    const float v = f.get_float(key, def);
    if (!std::isfinite(v) || v < 0.0f || (!allow_zero && v == 0.0f)) {
        bad_value(f, key, num(v), allow_zero ? "must be finite and >= 0" : "must be finite and > 0");
    }
    return v;
}

void require_key(const GgufFile& f, const std::string& key) {
    if (!f.has_key(key)) throw GgufFormatError("'" + f.path() + "' lacks the required key " + key);
}

std::vector<bool> swa_pattern(int n_layer, int period) {
    std::vector<bool> swa(n_layer);
    for (int il = 0; il < n_layer; ++il) swa[il] = il % period < period - 1;
    return swa;
}

void require_head_sizes(const GgufFile& f, const HParams& hp, const std::string& a, bool model_wide, bool rope_whole_head) {
    if (hp.head_dim_v != hp.head_dim_k || (model_wide && int64_t(hp.head_dim_k) * hp.n_head != hp.n_embd)) {
        bad_value(f, a + "attention.key_length", std::to_string(hp.head_dim_k),
                  hp.arch_name + " needs key_length = value_length" +
                      (model_wide ? " = embedding_length / head_count = " + std::to_string(hp.n_embd / hp.n_head) : ""));
    }
    if (rope_whole_head && hp.n_rot != hp.head_dim_k) {
        bad_value(f, a + "rope.dimension_count", std::to_string(hp.n_rot),
                  hp.arch_name + " rotates whole heads: must equal the head size " + std::to_string(hp.head_dim_k));
    }
}

void read_yarn(const GgufFile& f, HParams& hp, const std::string& a) {
    hp.rope_ext_factor = 1.0f;
    hp.rope_beta_fast = finite_float(f, a + "rope.scaling.yarn_beta_fast", 32.0f, /*allow_zero=*/true);
    hp.rope_beta_slow = finite_float(f, a + "rope.scaling.yarn_beta_slow", 1.0f, /*allow_zero=*/true);
    const float log_mul = finite_float(f, a + "rope.scaling.yarn_log_multiplier", 0.0f, /*allow_zero=*/true);
    // llama.cpp's yarn_attn_factor (llama-context.cpp), in its float operations and order: the
    // magnitude correction for the scale, divided by the one ggml's YaRN rope applies itself.
    const float factor = 1.0f / hp.rope_freq_scale;
    auto mscale = [](float scale, float m) { return scale <= 1.0f ? 1.0f : (0.1f * m * logf(scale) + 1.0f); };
    float yarn = log_mul != 0.0f ? mscale(factor, 1.0f) / mscale(factor, log_mul) : mscale(factor, 1.0f);
    yarn *= 1.0f / (1.0f + 0.1f * logf(factor));
    hp.rope_attn_factor = yarn * hp.rope_attn_factor;
}

const char* supported_architectures() {
    static const std::string text = [] {
        std::string s;
        for (const ArchSpec* a : arch_specs()) s += (s.empty() ? "" : ", ") + std::string(a->name);
        return s;
    }();
    return text.c_str();
}

HParams read_hparams(const GgufFile& f) {
    check_text(f);
    HParams hp;
    hp.arch_name = f.get_str("general.architecture");
    hp.arch = find_arch(hp.arch_name);
    if (!hp.arch) {
        throw UnsupportedModelError("unsupported architecture '" + hp.arch_name + "' in '" + f.path() +
                                    "'; supported: " + supported_architectures());
    }
    const std::string a = hp.arch_name + ".";

    // Every integer is range-checked as the 64-bit value the file holds, before it becomes an int.
    hp.n_layer = bounded_int(f, a + "block_count", -1, 1, kMaxLayers);
    hp.n_embd = bounded_int(f, a + "embedding_length", -1, 1, kMaxEmbd);
    hp.n_ff = uniform_int(f, a + "feed_forward_length", -1, 1, kMaxFF);
    hp.n_head = uniform_int(f, a + "attention.head_count", -1, 1, kMaxHeads);
    hp.n_head_kv = uniform_int(f, a + "attention.head_count_kv", hp.n_head, 1, hp.n_head);
    hp.n_ctx_train = bounded_int(f, a + "context_length", 2048, 1, kMaxContext);
    if (hp.n_head % hp.n_head_kv != 0) {
        bad_value(f, a + "attention.head_count_kv", std::to_string(hp.n_head_kv),
                  "must divide attention.head_count = " + std::to_string(hp.n_head));
    }
    const int64_t default_head_dim = hp.n_embd / hp.n_head;
    if (!f.has_key(a + "attention.key_length") && default_head_dim < 1) {
        bad_value(f, a + "attention.head_count", std::to_string(hp.n_head),
                  "exceeds embedding_length = " + std::to_string(hp.n_embd));
    }
    hp.head_dim_k = bounded_int(f, a + "attention.key_length", default_head_dim, 1, kMaxHeadDim);
    hp.head_dim_v = bounded_int(f, a + "attention.value_length", std::max<int64_t>(default_head_dim, 1), 1, kMaxHeadDim);
    // ggml's rope rotates dimension pairs: an odd count, none, or more than a head holds
    // asserts or never finishes.
    hp.n_rot = bounded_int(f, a + "rope.dimension_count", hp.head_dim_k, 2, hp.head_dim_k);
    if (hp.n_rot % 2 != 0) bad_value(f, a + "rope.dimension_count", std::to_string(hp.n_rot), "must be even");
    hp.rms_eps = finite_float(f, a + "attention.layer_norm_rms_epsilon", 1e-5f, /*allow_zero=*/true);
    hp.rope_freq_base = finite_float(f, a + "rope.freq_base", 10000.0f, /*allow_zero=*/false);

    // Linear scaling may be given as a factor (new key) or directly as a scale (old key).
    const std::string scaling = f.get_str(a + "rope.scaling.type", "none");
    if (scaling != "none" && scaling != "linear" && scaling != "llama3" && scaling != "yarn") {
        throw UnsupportedModelError("rope scaling type '" + scaling +
                                    "' is not supported (none, linear, yarn, llama3 via rope_freqs)");
    }
    if (f.has_key(a + "rope.scaling.factor")) {
        const float factor = finite_float(f, a + "rope.scaling.factor", 1.0f, /*allow_zero=*/false);
        if (scaling == "linear" || scaling == "yarn") hp.rope_freq_scale = 1.0f / factor;
    }
    if (f.has_key(a + "rope.scale_linear")) {
        hp.rope_freq_scale = 1.0f / finite_float(f, a + "rope.scale_linear", 1.0f, /*allow_zero=*/false);
    }
    hp.n_ctx_orig = bounded_int(f, a + "rope.scaling.original_context_length", hp.n_ctx_train, 1, kMaxContext);
    hp.rope_attn_factor = finite_float(f, a + "rope.scaling.attn_factor", 1.0f, /*allow_zero=*/false);
    if (scaling == "yarn") read_yarn(f, hp, a);
    hp.rope_type = hp.arch->rope_type;
    hp.attn_scale = 1.0f / std::sqrt(float(hp.head_dim_k));
    hp.arch->read_hparams(f, hp, a);

    const ggml_tensor* emb = f.tensor("token_embd.weight");
    if (!emb) throw UnsupportedModelError("'" + f.path() + "' has no token_embd.weight");
    hp.n_vocab = in_range(f, "token_embd.weight rows", emb->ne[1], 1, kMaxVocab);

    check_layer_tensors(f, hp.n_layer, a + "block_count");
    check_token_list(f, hp.n_vocab);
    hp.exit_defaults = read_exit_defaults(f, hp.n_layer);
    return hp;
}

}  // namespace river
