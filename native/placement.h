// Where each layer's weights and KV cache live: RPC servers' devices, a GPU, or the CPU (in
// repacked buffers where the CPU kernels read them faster, Q/K/V and gate/up joined on the way).
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "ggml-backend.h"
#include "ggml-cpp.h"
#include "hparams.h"
#include "rpc_link.h"
#include "weights.h"

namespace river {

struct EngineConfig;

// The devices a load placed layers on and the copies of weights it made there. Members are
// destroyed in reverse order: the copied weights before the backends they live on. An Engine
// holds its Placement after its CPU backend and before its scheduler and cache.
struct Placement {
    ggml_backend_ptr gpu;
    std::vector<ggml_backend_ptr> remote;   // one per device of the RPC servers, in order
    std::vector<std::string> remote_name;   // the server's host:port (#device when it has several)
    std::vector<ggml_backend_t> layer_backend;  // per layer: where its KV cache goes; not owned
    std::vector<std::string> layer_device;      // per layer: "CPU", "GPU" or the remote device's name
    std::vector<std::unique_ptr<DeviceWeights>> weights;  // GPU and remote copies, repacked CPU copies
    int gpu_layers = 0;                     // layers on the GPU (fewer than asked when they did not fit)
    bool gpu_head = false;                  // the output norm and head(s) on the GPU
    size_t gpu_free = 0;                    // the GPU's free memory before placing, as its backend reports it

    bool local() const { return !gpu && remote.empty(); }  // every layer on the CPU
};

// How much of a GPU offload fits: the most of the last `requested` layers whose bytes (weights
// and KV cache, layer_bytes[il]), taken from the last layer back, leave `reserve` bytes of
// `free_bytes` for compute buffers; the head too when every layer fits, `requested` exceeds the
// layer count (llama.cpp's n_gpu_layers), and head_bytes still fit. free_bytes 0 (a backend
// that reports no memory) fits everything asked.
struct GpuFit {
    int n_layers = 0;
    bool head = false;
};
GpuFit fit_gpu_layers(const std::vector<size_t>& layer_bytes, size_t head_bytes, size_t free_bytes, size_t reserve,
                      int requested);

// Connects cfg.rpc_servers (each through a new link appended to `links`, which must outlive
// `out`), starts a GPU backend when cfg.n_gpu_layers asks for one, and moves the layers'
// weights (and the heads, as llama.cpp does) to their devices: the backbone's and river's
// slots then point at the placed copies. `check_links` throws RpcError once a server failed.
// Fills `out` as it goes, so that a throw half-way leaves everything made so far owned by it.
void place_weights(const EngineConfig& cfg, const HParams& hp, ggml_backend_t cpu, BackboneWeights& backbone,
                   RiverWeights* river, std::vector<std::unique_ptr<RpcLink>>& links,
                   const std::function<void()>& check_links, Placement& out);

}  // namespace river
