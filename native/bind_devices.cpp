// river_gguf._native: the devices ggml sees, the GPU placement planner and the RPC server.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings.h"
#include "devices.h"
#include "placement.h"
#include "rpc_link.h"

namespace py = pybind11;
using namespace pybind11::literals;  // "name"_a = value in py::dict

namespace river {

void bind_devices(py::module_& m) {
    m.def("rpc_available", &rpc_available);
    m.def(
        "devices",
        [] {
            py::list out;
            for (const auto& d : list_devices()) {
                py::dict e;
                e["name"] = d.name;
                e["description"] = d.description;
                e["type"] = d.type;
                e["memory_free"] = d.memory_free;
                e["memory_total"] = d.memory_total;
                out.append(e);
            }
            return out;
        },
        "The devices ggml sees: dicts of name, description, type (CPU, GPU, IGPU, ACCEL) and free and total memory "
        "in bytes.");
    m.def(
        "offload_gpus", [] {
            std::vector<std::string> names;
            for (auto dev : offload_gpus()) names.push_back(ggml_backend_dev_name(dev));
            return names;
        },
        "The GPUs an engine offloads to, in the order main_gpu indexes: discrete first, then integrated.");
    m.def(
        "rpc_serve",
        [](const std::string& host, int port, int n_threads, const std::string& cache_dir,
           const std::vector<std::string>& devices) {
            py::gil_scoped_release release;  // it serves until the process ends
            return rpc_serve(host, port, n_threads, cache_dir, devices);
        },
        py::arg("host"), py::arg("port"), py::arg("n_threads") = 1, py::arg("cache_dir") = "",
        py::arg("devices") = std::vector<std::string>{},
        "Serve this machine's devices with ggml's RPC server (ggml_backend_rpc_start_server). Blocks while it "
        "serves; returns a message when it could not start.");

    m.def(
        "fit_gpu_layers",
        [](const std::vector<size_t>& layer_bytes, size_t head_bytes, size_t free_bytes, size_t reserve, int requested) {
            const GpuFit f = fit_gpu_layers(layer_bytes, head_bytes, free_bytes, reserve, requested);
            return py::make_tuple(f.n_layers, f.head);
        },
        py::arg("layer_bytes"), py::arg("head_bytes"), py::arg("free_bytes"), py::arg("reserve"), py::arg("requested"),
        "How much of a GPU offload fits (placement.h): (layers, head on the GPU).");
    m.def(
        "plan_gpu",
        [](const std::vector<std::tuple<size_t, size_t, size_t>>& layers, size_t head_bytes, size_t budget,
           size_t reserve, int requested) {
            std::vector<LayerBytes> lb;
            for (const auto& [backbone, river, kv] : layers) lb.push_back({backbone, river, kv});
            const GpuPlan p = plan_gpu(lb, head_bytes, budget, reserve, requested);
            auto flags = [](const std::vector<char>& v) { return std::vector<bool>(v.begin(), v.end()); };
            return py::dict("backbone"_a = flags(p.backbone), "river"_a = flags(p.river), "kv_cache"_a = flags(p.kv),
                            "head"_a = p.head, "river_first"_a = p.river_first, "bytes"_a = p.bytes);
        },
        py::arg("layers"), py::arg("head_bytes"), py::arg("budget"), py::arg("reserve"), py::arg("requested"),
        "What of each layer goes to the GPU (placement.h plan_gpu); layers are (backbone, river, kv) bytes.");
}

}  // namespace river
