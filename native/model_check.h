// Whether a river is the backbone's own model at another precision: the one check, used by the
// engine when it loads a separate river file and by the converter through the bindings.
#pragma once
#include "gguf_file.h"
#include "hparams.h"

namespace river {

// Throws RiverMismatchError naming the first difference (architecture, a hyperparameter, the
// sliding-window layers, the vocabulary token by token).
void check_same_model(const HParams& a, const HParams& b, const GgufFile& fa, const GgufFile& fb);

}  // namespace river
