// Exit rules: when a token may leave the backbone after a layer (ExitMode::River).
//
// A rule scores each token from the layer's input and output hidden states, once as graph ops
// (on the layer's device, read by the scheduler's callback) and once on the CPU (the exit node's
// op); the two compute the same score. Scores rise as the hidden state settles, and the batch
// leaves when its lowest score passes the setting's threshold: a batch exits together, so its
// least settled token decides. A threshold at or above max_score never passes, and the engine
// then runs the backbone as one graph without exit nodes.
//
// A new rule is a file in native/exit_rules/ defining an ExitRule, plus its line in
// exit_rules.cpp; the bindings and the Python package take the list from there (EXIT_RULES), and
// a River GGUF names its default rule under river.exit_rule (hparams.cpp).
#pragma once
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "ggml.h"

namespace river {

struct ExitRule {
    const char* name;
    const char* about;  // what the score is and what its threshold means (the CLI's help)
    float max_score;    // no score exceeds it
    // The score of every token: h_in and h_out are F32 [n_embd, n]; the result F32 [1, n].
    ggml_tensor* (*graph_score)(ggml_context* ctx, ggml_tensor* h_in, ggml_tensor* h_out);
    // One token's score, from its rows of n_embd floats.
    float (*cpu_score)(const float* h_in, const float* h_out, int64_t n_embd);
};

// The rules in code order: a setting's `rule` is an index into this list.
const std::vector<const ExitRule*>& exit_rules();
// Throws std::invalid_argument for a code that names no rule.
const ExitRule& exit_rule(int code);
// The code of the rule of this name, or -1; and the names, as text for messages ("cosine, ...").
int exit_rule_code(const std::string& name);
std::string exit_rule_names();

// A threshold of this rule that no score passes ("never exit"): above its max_score. The default
// setting's threshold (exit_setting.h) is the default rule's.
inline float never_exit_threshold(const ExitRule& rule) { return rule.max_score + 1.0f; }

// Whether a batch with these scores leaves at `threshold` (the rule's shared decision).
inline bool batch_leaves(const float* scores, int64_t n, float threshold, float* lowest) {
    float s_min = INFINITY;
    for (int64_t i = 0; i < n; ++i) s_min = scores[i] < s_min ? scores[i] : s_min;
    *lowest = s_min;
    return s_min > threshold;
}

}  // namespace river
