#include "devices.h"

#include <stdexcept>

namespace {

const char* type_name(enum ggml_backend_dev_type t) {
    switch (t) {
        case GGML_BACKEND_DEVICE_TYPE_CPU: return "CPU";
        case GGML_BACKEND_DEVICE_TYPE_GPU: return "GPU";
        case GGML_BACKEND_DEVICE_TYPE_IGPU: return "IGPU";
        case GGML_BACKEND_DEVICE_TYPE_ACCEL: return "ACCEL";
    }
    return "?";
}

}  // namespace

std::vector<DeviceInfo> list_devices() {
    std::vector<DeviceInfo> out;
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_dev_t dev = ggml_backend_dev_get(i);
        DeviceInfo d;
        d.name = ggml_backend_dev_name(dev);
        d.description = ggml_backend_dev_description(dev);
        d.type = type_name(ggml_backend_dev_type(dev));
        ggml_backend_dev_memory(dev, &d.memory_free, &d.memory_total);
        out.push_back(std::move(d));
    }
    return out;
}

std::vector<ggml_backend_dev_t> offload_gpus() {
    std::vector<ggml_backend_dev_t> gpus;
    for (auto wanted : {GGML_BACKEND_DEVICE_TYPE_GPU, GGML_BACKEND_DEVICE_TYPE_IGPU}) {
        for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
            ggml_backend_dev_t dev = ggml_backend_dev_get(i);
            // RPC servers appear as GPU devices once connected; they are placed by rpc_servers.
            if (ggml_backend_dev_type(dev) == wanted && std::string(ggml_backend_dev_name(dev)).rfind("RPC", 0) != 0) {
                gpus.push_back(dev);
            }
        }
    }
    return gpus;
}

ggml_backend_dev_t choose_gpu(int main_gpu) {
    const auto gpus = offload_gpus();
    if (gpus.empty()) return nullptr;
    if (main_gpu < 0 || static_cast<size_t>(main_gpu) >= gpus.size()) {
        std::string names;
        for (size_t i = 0; i < gpus.size(); ++i) {
            names += (i ? ", " : "") + std::to_string(i) + ": " + ggml_backend_dev_name(gpus[i]);
        }
        throw std::invalid_argument("main_gpu=" + std::to_string(main_gpu) + " is not one of this machine's GPUs (" +
                                    names + ")");
    }
    return gpus[static_cast<size_t>(main_gpu)];
}
