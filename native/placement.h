// Where each layer's weights and KV cache live: RPC servers' devices, a GPU, or the CPU (in
// repacked buffers where the CPU kernels read them faster, Q/K/V and gate/up joined on the way).
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "engine_config.h"
#include "ggml-backend.h"
#include "ggml-cpp.h"
#include "hparams.h"
#include "rpc_link.h"
#include "device_weights.h"
#include "weights.h"

namespace river {

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
    int gpu_layers = 0;                     // layers whose backbone is on the GPU (fewer than asked when
                                            // they did not fit)
    bool gpu_head = false;                  // the output norm and head(s) on the GPU
    bool river_first = false;               // the budget held the river, head and KV cache but not the whole
                                            // backbone: its deepest layers stayed in host memory
    size_t gpu_free = 0;                    // the GPU's free memory before placing, as its backend reports it
    size_t gpu_budget = 0;                  // what the placement could use: gpu_free, capped by cfg.gpu_memory
    size_t gpu_bytes = 0;                   // what it put there: weights, KV cache and the compute reserve
    // Per layer, where its weights are ("CPU", "GPU" or the remote device's name; "" for a
    // missing river). layer_device above is where its KV cache lives and attention reads it.
    std::vector<std::string> backbone_device, river_device;
    std::vector<size_t> backbone_bytes, river_bytes, kv_bytes;  // per layer, as the placement counted them
    size_t head_bytes = 0;

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

// What of each layer goes to the GPU. The bytes of a layer's backbone weights, river weights
// and KV cache are counted apart, because River makes the deep backbone layers rare: most
// tokens leave for the river early (the paper's VRAM eviction).
struct LayerBytes {
    size_t backbone = 0, river = 0, kv = 0;
};
struct GpuPlan {
    std::vector<char> backbone, river, kv;  // per layer: on the GPU
    bool head = false;
    bool river_first = false;
    size_t bytes = 0;  // what the plan puts on the GPU, the reserve included
};
// llama.cpp's fit (fit_gpu_layers: the last layers whole, then the head) whenever it places
// everything asked, the model has no river, or a layer count was asked (requested <= layer
// count). Otherwise, when every layer and the head were asked (requested > layer count) and the
// budget holds the reserve, the head, every layer's KV cache and the whole river: those, and
// then the backbone from its first layer on, as far as it fits without a gap. A budget of 0 (a
// backend that reports no memory, no gpu_memory given) fits everything asked.
GpuPlan plan_gpu(const std::vector<LayerBytes>& layers, size_t head_bytes, size_t budget, size_t reserve,
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
