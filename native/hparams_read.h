// Reading hyperparameters from GGUF metadata: the checked readers hparams.cpp and each family's
// read_hparams (native/models/) share.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "gguf_file.h"
#include "hparams.h"

namespace river {

// Upper bounds on the integer hyperparameters. Far above any released model, low enough that
// every product the engine forms (rows x columns, heads x head size, cache sizes) fits in 64 bits
// and every value fits in an int.
constexpr int64_t kMaxLayers = 4096;
constexpr int64_t kMaxEmbd = int64_t(1) << 20;
constexpr int64_t kMaxFF = int64_t(1) << 22;
constexpr int64_t kMaxHeads = int64_t(1) << 14;
constexpr int64_t kMaxHeadDim = int64_t(1) << 14;
constexpr int64_t kMaxContext = int64_t(1) << 30;
constexpr int64_t kMaxVocab = int64_t(1) << 30;

[[noreturn]] void bad_value(const GgufFile& f, const std::string& key, const std::string& value, const std::string& rule);
// An integer key in [lo, hi]; `def` when absent (a negative def marks a required key).
int bounded_int(const GgufFile& f, const std::string& key, int64_t def, int64_t lo, int64_t hi);
// A float key, finite and >= 0 (> 0 unless allow_zero); `def` when absent.
float finite_float(const GgufFile& f, const std::string& key, float def, bool allow_zero);
// A key that must be present (GgufFormatError naming it otherwise).
void require_key(const GgufFile& f, const std::string& key);

// YaRN's keys (rope.scaling.yarn_*) and the magnitude correction llama.cpp derives from them;
// rope_freq_scale must already hold 1 / rope.scaling.factor.
void read_yarn(const GgufFile& f, HParams& hp, const std::string& a);

// Layer il slides its window unless it is the last of each group of `period` layers (llama.cpp's
// swa pattern: gemma2 alternates, gemma3 has one global layer in six).
std::vector<bool> swa_pattern(int n_layer, int period);
// Head sizes some families fix, which llama.cpp asserts or shapes its tensors by (a file that
// breaks them crashes stock llama.cpp): K and V heads of one size, Q/K/V as wide as the model
// (model_wide), rope over whole heads (rope_whole_head).
void require_head_sizes(const GgufFile& f, const HParams& hp, const std::string& a, bool model_wide,
                        bool rope_whole_head);

}  // namespace river
