#include "model_check.h"

#include <cstdio>
#include <cstring>
#include <string>

#include "errors.h"

namespace river {

std::vector<std::string> model_differences(const HParams& a, const HParams& b, const GgufFile& fa,
                                           const GgufFile& fb) {
    auto num = [](double v) {
        char buf[32];
        std::snprintf(buf, sizeof(buf), "%g", v);
        return std::string(buf);
    };
    std::vector<std::string> out;
    if (a.arch_name != b.arch_name) {
        // Nothing else compares across architectures.
        out.push_back("it has architecture '" + b.arch_name + "' but the backbone has '" + a.arch_name + "'");
        return out;
    }
    auto differ = [&](const char* what, double x, double y) {
        if (x != y) out.push_back(std::string(what) + " is " + num(y) + " in the river but " + num(x) + " in the backbone");
    };
    differ("block_count", a.n_layer, b.n_layer);
    differ("embedding_length", a.n_embd, b.n_embd);
    differ("feed_forward_length", a.n_ff, b.n_ff);
    differ("attention.head_count", a.n_head, b.n_head);
    differ("attention.head_count_kv", a.n_head_kv, b.n_head_kv);
    differ("attention.key_length", a.head_dim_k, b.head_dim_k);
    differ("attention.value_length", a.head_dim_v, b.head_dim_v);
    differ("vocabulary size", a.n_vocab, b.n_vocab);
    differ("attention.layer_norm_rms_epsilon", a.rms_eps, b.rms_eps);
    differ("rope.freq_base", a.rope_freq_base, b.rope_freq_base);
    differ("rope.dimension_count", a.n_rot, b.n_rot);
    differ("attention.sliding_window", a.n_swa, b.n_swa);
    differ("the attention scale", a.attn_scale, b.attn_scale);
    differ("attn_logit_softcapping", a.attn_softcap, b.attn_softcap);
    differ("final_logit_softcapping", a.final_softcap, b.final_softcap);
    differ("embedding_scale", a.embedding_scale, b.embedding_scale);
    differ("residual_scale", a.residual_scale, b.residual_scale);
    differ("logit_scale", a.logit_scale, b.logit_scale);
    differ("rope.scaling.factor", a.rope_freq_scale, b.rope_freq_scale);
    differ("the rope's YaRN mix", a.rope_ext_factor, b.rope_ext_factor);
    differ("attention.temperature_scale", a.attn_temp_scale, b.attn_temp_scale);
    if (a.swa_layers != b.swa_layers) out.push_back("it slides its attention window on other layers than the backbone");
    // Same vocabulary, token by token: a river from another tokenizer would be nonsense.
    const int64_t ka = gguf_find_key(fa.meta(), "tokenizer.ggml.tokens");
    const int64_t kb = gguf_find_key(fb.meta(), "tokenizer.ggml.tokens");
    if ((ka < 0) != (kb < 0)) {
        out.push_back("only one of backbone and river has a vocabulary");
    } else if (ka >= 0) {
        const size_t n = gguf_get_arr_n(fa.meta(), ka), nb = gguf_get_arr_n(fb.meta(), kb);
        if (n != nb) {
            differ("tokenizer token count", double(n), double(nb));
        } else {
            for (size_t i = 0; i < n; ++i) {
                if (std::strcmp(gguf_get_arr_str(fa.meta(), ka, i), gguf_get_arr_str(fb.meta(), kb, i)) != 0) {
                    out.push_back("its vocabulary differs from the backbone's at token " + std::to_string(i));
                    break;
                }
            }
        }
    }
    return out;
}

void check_same_model(const HParams& a, const HParams& b, const GgufFile& fa, const GgufFile& fb) {
    const std::vector<std::string> d = model_differences(a, b, fa, fb);
    if (!d.empty()) {
        throw RiverMismatchError("river '" + fb.path() + "' does not match backbone '" + fa.path() + "': " + d.front());
    }
}

}  // namespace river
