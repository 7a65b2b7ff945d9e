// Whether a river is the backbone's own model at another precision: the one check, used by the
// engine when it loads a separate river file and by the converter through the bindings.
#pragma once
#include <string>
#include <vector>

#include "gguf_file.h"
#include "hparams.h"

namespace river {

// How river b's model differs from backbone a's: the architecture (alone: nothing else compares
// across architectures), each hyperparameter the graphs read, the sliding-window layers, and the
// vocabulary token by token. Empty: the same model.
std::vector<std::string> model_differences(const HParams& a, const HParams& b, const GgufFile& fa,
                                           const GgufFile& fb);
// Throws RiverMismatchError naming the first difference.
void check_same_model(const HParams& a, const HParams& b, const GgufFile& fa, const GgufFile& fb);

}  // namespace river
