// The exit setting of a step: which weights run each of its layers. Declared once here; the
// bindings take an eval's or a draft's keyword arguments from kExitSettingFields and bind the
// struct itself (ExitSetting, EXIT_SETTING: its defaults), and the Python package builds its
// ExitOptions from them (EXIT_MODES, EXIT_RULES by name). A River GGUF stores a default setting
// under the river.* keys (hparams.h FileExitDefaults).
#pragma once
#include <iterator>
#include <variant>

#include "field_count.h"

namespace river {

enum class ExitMode {
    Backbone = 0,   // never exit
    River = 1,      // dynamic exit: the exit rule passes after a layer >= min_exit_layer
    RiverOnly = 2,  // every layer from the river
    Fixed = 3,      // exit after layer exit_layer for every token
};

// The one table of the modes' names and codes.
struct ExitModeName {
    const char* name;
    ExitMode mode;
};
inline constexpr ExitModeName kExitModes[] = {
    {"backbone", ExitMode::Backbone},
    {"river", ExitMode::River},
    {"river-only", ExitMode::RiverOnly},
    {"fixed", ExitMode::Fixed},
};
// Entry i is code i, so a code is valid when it indexes the table.
constexpr bool exit_modes_in_order() {
    for (size_t i = 0; i < std::size(kExitModes); ++i) {
        if (static_cast<size_t>(kExitModes[i].mode) != i) return false;
    }
    return true;
}
static_assert(exit_modes_in_order(), "kExitModes: entry i must be the mode of code i");
static_assert(std::size(kExitModes) == static_cast<size_t>(ExitMode::Fixed) + 1, "kExitModes misses a mode");
inline bool is_exit_mode(int code) { return code >= 0 && static_cast<size_t>(code) < std::size(kExitModes); }

struct ExitSetting {
    ExitMode mode = ExitMode::Backbone;
    int rule = 0;                // ExitMode::River's exit rule (exit_rule.h), by code
    // The rule's threshold. The default never passes: it is never_exit_threshold (exit_rule.h) of
    // the default rule, which exit_rules() checks.
    float threshold = 2.0f;
    int min_exit_layer = 0;      // backbone layers every token runs before it may exit
    int exit_layer = -1;         // for ExitMode::Fixed
    int tail = 0;                // an exited token rejoins the backbone for the last `tail` layers
    bool river_head = false;     // exited tokens use the river's quantized head
    // River layers run the backbone's attention weights (Q/K/V/O, their biases and norms) and
    // the river's FFN: precision where the KV cache and the sensitivity are, at a FFN's price.
    bool backbone_attention = false;
};

// Every field by name, for the bindings. The compiler counts the list against the struct.
struct ExitSettingField {
    const char* name;
    std::variant<ExitMode ExitSetting::*, int ExitSetting::*, float ExitSetting::*, bool ExitSetting::*> member;
};
inline constexpr ExitSettingField kExitSettingFields[] = {
    {"mode", &ExitSetting::mode},
    {"rule", &ExitSetting::rule},
    {"threshold", &ExitSetting::threshold},
    {"min_exit_layer", &ExitSetting::min_exit_layer},
    {"exit_layer", &ExitSetting::exit_layer},
    {"tail", &ExitSetting::tail},
    {"river_head", &ExitSetting::river_head},
    {"backbone_attention", &ExitSetting::backbone_attention},
};
static_assert(std::size(kExitSettingFields) == field_count<ExitSetting>(), "kExitSettingFields must list every field of ExitSetting");

}  // namespace river
