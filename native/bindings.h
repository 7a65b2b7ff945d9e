// The Python module river_gguf._native, split by what it binds: each bind_* adds its part to the
// module (bindings.cpp makes the module, its errors and constants). Native work runs with the GIL
// released.
#pragma once
#include <pybind11/pybind11.h>

namespace river {

void bind_devices(pybind11::module_& m);   // bind_devices.cpp: devices, GPU placement, the RPC server
void bind_engine(pybind11::module_& m);    // bind_engine.cpp: Engine (eval, draft, the cache)
void bind_vocab(pybind11::module_& m);     // bind_vocab.cpp: Vocab (libllama's tokenizer)
void bind_imatrix(pybind11::module_& m);   // bind_quantize.cpp: activation statistics
void bind_quantize(pybind11::module_& m);  // bind_quantize.cpp: weighted quantization

}  // namespace river
