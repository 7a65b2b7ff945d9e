// The devices ggml sees, and which GPU an engine offloads to.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "ggml-backend.h"

struct DeviceInfo {
    std::string name;         // ggml's device name, e.g. "CPU", "CUDA0", "Vulkan0"
    std::string description;  // the driver's, e.g. the GPU's product name
    std::string type;         // "CPU", "GPU" (discrete), "IGPU" (integrated) or "ACCEL"
    size_t memory_free = 0;
    size_t memory_total = 0;
};

// Every device of every registered backend, in ggml's order.
std::vector<DeviceInfo> list_devices();

// The GPUs an engine may offload to, in llama.cpp's order of preference: discrete GPUs first,
// then integrated ones (each group in ggml's order). Index i of this list is main_gpu = i.
std::vector<ggml_backend_dev_t> offload_gpus();

// offload_gpus()[main_gpu], or nullptr when there is no GPU at all (the engine then stays on
// the CPU, as llama.cpp does). A main_gpu past the end throws std::invalid_argument naming the GPUs.
ggml_backend_dev_t choose_gpu(int main_gpu);
