// What makes each architecture family itself, in one place per family (native/models/, in the
// manner of llama.cpp's src/models/): its GGUF name, its rope, the hyperparameters it adds to
// llama's, the tensors of one of its layers, and its layer function. Everything else (the
// engine, the KV cache, the river) is shared and never asks which family it runs.
//
// Adding a family: a file in native/models/ that defines its ArchSpec, the entry in kArchSpecs
// (models/models.cpp), the file in CMakeLists.txt, and its parity test against llama.cpp
// (tests/test_architectures.py).
#pragma once
#include <string>
#include <vector>

#include "ggml.h"

namespace river {

class GgufFile;
struct HParams;
struct LayerWeights;
class LayerLoader;   // weights.h: a layer's tensors, looked up and checked
struct LayerGraph;   // layer_pieces.h: what a layer function builds with

// The per-dimension rope factors a family reads (llama.cpp's loaders ignore the others').
enum class RopeFactors {
    None,
    Freqs,     // rope_freqs.weight (llama3-style scaling)
    LongRope,  // rope_factors_long/short.weight, chosen by context length (phi3)
};

struct ArchSpec {
    const char* name;          // general.architecture
    int rope_type;             // GGML_ROPE_TYPE_NORMAL (adjacent pairs) or _NEOX (halves of a head)
    RopeFactors rope_factors;
    // The head is always the embedding table: llama.cpp's loader has no output.weight for the
    // family and refuses a file that holds one (a hybrid file must not get one either).
    bool tied_only;
    // The keys the family adds to llama's, with llama.cpp's names and defaults; `a` is
    // "<name>." (hp.attn_scale is already 1/sqrt(head size)).
    void (*read_hparams)(const GgufFile& f, HParams& hp, const std::string& a);
    // The tensors of one layer (backbone or river: the same shapes).
    void (*load_layer)(const LayerLoader& ld, LayerWeights& w);
    // One decoder layer on the residual stream h.
    ggml_tensor* (*build_layer)(const LayerGraph& L, ggml_tensor* h);
};

// The family named `name`, or nullptr.
const ArchSpec* find_arch(const std::string& name);
// Every family, in the order they are listed to users.
const std::vector<const ArchSpec*>& arch_specs();

}  // namespace river
