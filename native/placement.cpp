#include "placement.h"

#include "devices.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <stdexcept>

#include "engine_config.h"
#ifdef RIVER_HAVE_RPC
#include "ggml-rpc.h"
#endif

namespace river {

namespace {

// RPC servers: each server's devices through ggml-rpc, reached through a guarded link.
void connect_servers(const EngineConfig& cfg, std::vector<std::unique_ptr<RpcLink>>& links,
                     const std::function<void()>& check_links, Placement& out) {
    for (const std::string& endpoint : cfg.rpc_servers) {
        links.push_back(std::make_unique<RpcLink>(endpoint, cfg.rpc_timeout));  // throws without RPC
#ifdef RIVER_HAVE_RPC
        ggml_backend_reg_t reg = ggml_backend_rpc_add_server(links.back()->local_endpoint().c_str());
        check_links();
        const size_t n_dev = reg ? ggml_backend_reg_dev_count(reg) : 0;
        if (n_dev == 0) throw RpcError("RPC server '" + endpoint + "' offers no devices");
        for (size_t i = 0; i < n_dev; ++i) {
            out.remote.emplace_back(ggml_backend_dev_init(ggml_backend_reg_dev_get(reg, i), nullptr));
            check_links();
            if (!out.remote.back()) throw RpcError("cannot start a backend on RPC server '" + endpoint + "'");
            out.remote_name.push_back(n_dev > 1 ? endpoint + "#" + std::to_string(i) : endpoint);
        }
#endif
    }
}

// Give each remote device its share of the remote layers (-1: local).
std::vector<int> place_remote_layers(const EngineConfig& cfg, int n_layer, const Placement& p) {
    std::vector<int> remote_of(n_layer, -1);
    if (p.remote.empty()) return remote_of;
    std::vector<int> layers = cfg.rpc_layers;
    if (layers.empty()) {
        const int n = cfg.rpc_n_layers < 0 ? n_layer : std::min(cfg.rpc_n_layers, n_layer);
        for (int il = n_layer - n; il < n_layer; ++il) layers.push_back(il);
    }
    std::sort(layers.begin(), layers.end());
    for (size_t i = 0; i < layers.size(); ++i) {
        if (layers[i] < 0 || layers[i] >= n_layer) {
            throw std::invalid_argument("rpc_layers: layer " + std::to_string(layers[i]) + " is outside [0, " +
                                        std::to_string(n_layer - 1) + "]");
        }
        if (i > 0 && layers[i] == layers[i - 1]) {
            throw std::invalid_argument("rpc_layers: layer " + std::to_string(layers[i]) + " is listed twice");
        }
    }
    // Each device's share: given, or its free memory (llama.cpp's default tensor_split).
    std::vector<double> share(p.remote.size(), 0.0);
    if (!cfg.rpc_split.empty()) {
        if (cfg.rpc_split.size() != p.remote.size()) {
            std::string names;
            for (const auto& n : p.remote_name) names += (names.empty() ? "" : ", ") + n;
            throw std::invalid_argument("rpc_split has " + std::to_string(cfg.rpc_split.size()) +
                                        " shares but there are " + std::to_string(p.remote.size()) +
                                        " remote devices (" + names + ")");
        }
        for (size_t d = 0; d < share.size(); ++d) {
            if (!(cfg.rpc_split[d] >= 0) || !std::isfinite(cfg.rpc_split[d])) {
                throw std::invalid_argument("rpc_split shares must be finite and >= 0");
            }
            share[d] = cfg.rpc_split[d];
        }
    } else {
        for (size_t d = 0; d < share.size(); ++d) {
            size_t free = 0, total = 0;
            ggml_backend_dev_memory(ggml_backend_get_device(p.remote[d].get()), &free, &total);
            share[d] = static_cast<double>(free);
        }
    }
    double sum = 0;
    for (double x : share) sum += x;
    if (sum <= 0) std::fill(share.begin(), share.end(), 1.0), sum = double(share.size());
    // Contiguous runs in device order, as llama.cpp splits layers: the k-th remote layer goes to
    // the first device whose cumulative share passes k / count.
    std::vector<double> cum(share.size());
    double acc = 0;
    for (size_t d = 0; d < share.size(); ++d) cum[d] = (acc += share[d]) / sum;
    for (size_t k = 0; k < layers.size(); ++k) {
        const double at = double(k) / double(layers.size());
        size_t d = std::upper_bound(cum.begin(), cum.end(), at) - cum.begin();
        remote_of[layers[k]] = static_cast<int>(std::min(d, share.size() - 1));
    }
    return remote_of;
}

// CPU mat-mul weights go to the first extra buffer type that takes them (repacked Q4_0/Q8_0/...
// layouts), where the CPU kernels read them faster than from the mapping. They are copied there
// anyway, so Q/K/V and gate/up are joined on the way (`fuse`).
void repack_cpu_weights(ggml_backend_t cpu, const std::vector<LayerWeights*>& cpu_layers,
                        std::vector<ggml_tensor**> cpu_matmuls, bool fuse, Placement& out) {
    ggml_backend_dev_t cpu_dev = ggml_backend_get_device(cpu);
    // Last, the plain CPU buffer type: layers no repacked type takes (F16, K-quants) are
    // still joined, in a copy; the mapping's pages they came from are then left unread.
    std::vector<ggml_backend_buffer_type_t> bufts = cpu_extra_buffer_types();
    bufts.push_back(ggml_backend_cpu_buffer_type());
    for (ggml_backend_buffer_type_t buft : bufts) {
        const bool plain = buft == ggml_backend_cpu_buffer_type();
        std::vector<DeviceWeights::Concat> concats;
        std::set<ggml_tensor**> joined;
        auto join = [&](std::vector<ggml_tensor**> parts, ggml_tensor** target, const char* what) {
            std::vector<ggml_tensor*> ts;
            for (auto p : parts) ts.push_back(*p);
            if (*target || !concat_supported(cpu_dev, buft, ts)) return;
            concats.push_back({ts, target, std::string(ggml_get_name(ts[0])) + what});
            joined.insert(parts.begin(), parts.end());
        };
        if (fuse) {
            for (LayerWeights* w : cpu_layers) {
                for (const LayerJoin& j : layer_joins()) {
                    std::vector<ggml_tensor**> parts;
                    for (auto slot : j.parts) parts.push_back(&(w->*slot));
                    join(parts, &(w->*j.joined), j.suffix);
                }
            }
        }
        std::vector<ggml_tensor**> take, rest;
        for (auto s : cpu_matmuls) {
            if (joined.count(s)) continue;
            // Unjoined weights stay in the mapping rather than be copied to a plain buffer.
            (!plain && buft_supports_matmul(cpu_dev, buft, *s) ? take : rest).push_back(s);
        }
        if (!take.empty() || !concats.empty()) {
            out.weights.push_back(std::make_unique<DeviceWeights>());
            out.weights.back()->move(buft, take, concats);
        }
        cpu_matmuls.swap(rest);
    }
}

}  // namespace

GpuFit fit_gpu_layers(const std::vector<size_t>& layer_bytes, size_t head_bytes, size_t free_bytes, size_t reserve,
                      int requested) {
    const int n_layer = static_cast<int>(layer_bytes.size());
    const int want = std::clamp(requested, 0, n_layer);
    GpuFit fit;
    size_t used = reserve;
    for (int il = n_layer - 1; il >= n_layer - want; --il) {
        if (free_bytes && used + layer_bytes[il] > free_bytes) break;
        used += layer_bytes[il];
        ++fit.n_layers;
    }
    fit.head = requested > n_layer && fit.n_layers == n_layer && (!free_bytes || used + head_bytes <= free_bytes);
    return fit;
}

GpuPlan plan_gpu(const std::vector<LayerBytes>& layers, size_t head_bytes, size_t budget, size_t reserve,
                 int requested) {
    const int n_layer = static_cast<int>(layers.size());
    std::vector<size_t> whole(n_layer);
    size_t kv = 0, river = 0;
    for (int il = 0; il < n_layer; ++il) {
        whole[il] = layers[il].backbone + layers[il].river + layers[il].kv;
        kv += layers[il].kv;
        river += layers[il].river;
    }
    const GpuFit fit = fit_gpu_layers(whole, head_bytes, budget, reserve, requested);
    GpuPlan plan;
    plan.backbone.assign(n_layer, 0);
    plan.river.assign(n_layer, 0);
    plan.kv.assign(n_layer, 0);
    plan.head = fit.head;
    plan.bytes = reserve + (fit.head ? head_bytes : 0);
    for (int il = n_layer - fit.n_layers; il < n_layer; ++il) {
        plan.backbone[il] = plan.river[il] = plan.kv[il] = 1;
        plan.bytes += whole[il];
    }
    const bool all_placed = fit.n_layers == n_layer && fit.head;
    size_t used = reserve + head_bytes + kv + river;
    if (all_placed || requested <= n_layer || river == 0 || budget == 0 || used > budget) return plan;

    GpuPlan first;
    first.river_first = first.head = true;
    first.river.assign(n_layer, 1);
    first.kv.assign(n_layer, 1);
    first.backbone.assign(n_layer, 0);
    for (int il = 0; il < n_layer && used + layers[il].backbone <= budget; ++il) {
        used += layers[il].backbone;
        first.backbone[il] = 1;
    }
    first.bytes = used;
    return first;
}

void place_weights(const EngineConfig& cfg, const HParams& hp, ggml_backend_t cpu, BackboneWeights& backbone,
                   RiverWeights* river, std::vector<std::unique_ptr<RpcLink>>& links,
                   const std::function<void()>& check_links, Placement& out) {
    connect_servers(cfg, links, check_links, out);
    const std::vector<int> remote_of = place_remote_layers(cfg, hp.n_layer, out);

    // Offload the last n_gpu_layers layers (and the head once all layers are), as llama.cpp does,
    // or, for a River model asked to offload everything that does not fit, the river, head and
    // KV cache and the early backbone layers (plan_gpu); layers placed on RPC servers stay there.
    out.layer_backend.assign(hp.n_layer, cpu);
    if (cfg.n_gpu_layers > 0) {
        // Discrete GPUs first, then integrated ones; main_gpu picks one (devices.h).
        if (ggml_backend_dev_t dev = choose_gpu(cfg.main_gpu)) {
            out.gpu.reset(ggml_backend_dev_init(dev, nullptr));
        }
    }
    // Each head gets its own slot: a tied head is placed apart from the embedding table,
    // which stays in the mapping for get_rows.
    std::vector<ggml_tensor**> heads = {&backbone.output};
    if (river && river->head) heads.push_back(&river->head);
    // The draft vocabulary's rows of a head go where the heads go on a GPU, but on the CPU stay
    // in their plain layout (never a repacked one): the engine rewrites its context rows in place.
    std::vector<ggml_tensor**> gpu_heads = heads;
    if (backbone.draft_output) gpu_heads.push_back(&backbone.draft_output);
    if (river && river->draft_head) gpu_heads.push_back(&river->draft_head);
    GpuPlan plan;
    if (out.gpu) {
        // As many of the asked layers as fit the GPU's free memory (llama.cpp's --fit), or the
        // river first when the whole model does not (plan_gpu): the rest runs on the CPU rather
        // than the load failing on an allocation.
        auto bytes_of = [](const std::vector<ggml_tensor**>& slots) {
            size_t b = 0;
            for (auto s : slots) b += *s ? ggml_nbytes(*s) : 0;
            return b;
        };
        const size_t kv_row = size_t(hp.n_embd_k_gqa() + hp.n_embd_v_gqa()) * ggml_type_size(GGML_TYPE_F16);
        std::vector<LayerBytes> layer_bytes(hp.n_layer);
        for (int il = 0; il < hp.n_layer; ++il) {
            if (remote_of[il] >= 0) continue;  // on its RPC server: nothing of it on the GPU
            layer_bytes[il].backbone = bytes_of(layer_slots(backbone.layers[il]));
            layer_bytes[il].kv = size_t(cfg.n_ctx) * kv_row;
            if (river) layer_bytes[il].river = bytes_of(layer_slots(river->layers[il]));
        }
        for (const LayerBytes& b : layer_bytes) {
            out.backbone_bytes.push_back(b.backbone);
            out.river_bytes.push_back(b.river);
            out.kv_bytes.push_back(b.kv);
        }
        std::vector<ggml_tensor**> head_slots = gpu_heads;
        head_slots.push_back(&backbone.output_norm);
        out.head_bytes = bytes_of(head_slots);
        size_t free = 0, total = 0;
        ggml_backend_dev_memory(ggml_backend_get_device(out.gpu.get()), &free, &total);
        out.gpu_free = free;
        out.gpu_budget = cfg.gpu_memory == 0 ? free : free == 0 ? cfg.gpu_memory : std::min(free, cfg.gpu_memory);
        // Compute buffers: the logits of a batch, and a margin for the layers' activations.
        const size_t reserve = (size_t(512) << 20) + size_t(cfg.n_batch) * hp.n_vocab * sizeof(float);
        plan = plan_gpu(layer_bytes, out.head_bytes, out.gpu_budget, reserve, cfg.n_gpu_layers);
        out.gpu_head = plan.head;
        out.river_first = plan.river_first;
        // A head the device cannot multiply (lavapipe: Qwen's 151936-row Q8_0 head exceeds its
        // largest buffer range) stays on the CPU with the output norm, as llama.cpp keeps a
        // weight the device's buffer type does not support in host memory.
        ggml_backend_buffer_type_t buft = ggml_backend_get_default_buffer_type(out.gpu.get());
        for (ggml_tensor** s : gpu_heads) {
            if (out.gpu_head && *s && !buft_supports_matmul(ggml_backend_get_device(out.gpu.get()), buft, *s)) {
                out.gpu_head = false;
            }
        }
        out.gpu_bytes = plan.bytes - (plan.head && !out.gpu_head ? out.head_bytes : 0);
        if (std::count(plan.kv.begin(), plan.kv.end(), 1) == 0) out.gpu.reset();  // nothing fits: CPU only
    }
    auto on_gpu = [&](const std::vector<char>& part, int il) {
        return out.gpu && remote_of[il] < 0 && part[il];
    };
    const bool head_on_gpu = out.gpu && out.gpu_head;
    // Whose weights of a remote layer live with it; the others stay local and the scheduler
    // runs them here, reading the layer's cache there.
    auto backbone_remote = [&](int il) { return remote_of[il] >= 0 && cfg.rpc_weights != 2; };
    auto river_remote = [&](int il) { return remote_of[il] >= 0 && cfg.rpc_weights != 1; };
    for (size_t d = 0; d < out.remote.size(); ++d) {
        std::vector<ggml_tensor**> slots;
        for (int il = 0; il < hp.n_layer; ++il) {
            if (remote_of[il] != static_cast<int>(d)) continue;
            out.layer_backend[il] = out.remote[d].get();
            if (backbone_remote(il)) for (auto s : layer_slots(backbone.layers[il])) slots.push_back(s);
            if (river && river_remote(il)) for (auto s : layer_slots(river->layers[il])) slots.push_back(s);
        }
        if (slots.empty()) continue;
        out.weights.push_back(std::make_unique<DeviceWeights>());
        out.weights.back()->move(ggml_backend_get_default_buffer_type(out.remote[d].get()), slots);
        check_links();
    }
    if (out.gpu) {
        std::vector<ggml_tensor**> slots;
        for (int il = 0; il < hp.n_layer; ++il) {
            if (on_gpu(plan.kv, il)) out.layer_backend[il] = out.gpu.get();
            if (on_gpu(plan.backbone, il)) for (auto s : layer_slots(backbone.layers[il])) slots.push_back(s);
            if (river && on_gpu(plan.river, il)) for (auto s : layer_slots(river->layers[il])) slots.push_back(s);
        }
        if (head_on_gpu) {
            slots.push_back(&backbone.output_norm);
            slots.insert(slots.end(), gpu_heads.begin(), gpu_heads.end());
        }
        ggml_backend_buffer_type_t buft = ggml_backend_get_default_buffer_type(out.gpu.get());
        check_device_matmul(ggml_backend_get_device(out.gpu.get()), buft, slots);
        out.weights.push_back(std::make_unique<DeviceWeights>());
        out.weights.back()->move(buft, slots);
    }
    if (cfg.repack) {
        std::vector<LayerWeights*> cpu_layers;
        for (int il = 0; il < hp.n_layer; ++il) {
            if (cfg.repack_backbone && !backbone_remote(il) && !on_gpu(plan.backbone, il)) {
                cpu_layers.push_back(&backbone.layers[il]);
            }
            if (river && !river_remote(il) && !on_gpu(plan.river, il)) cpu_layers.push_back(&river->layers[il]);
        }
        std::vector<ggml_tensor**> cpu_matmuls;
        for (LayerWeights* w : cpu_layers) for (auto s : matmul_slots(*w)) cpu_matmuls.push_back(s);
        if (!head_on_gpu) {
            // The river's head is the river's; the backbone's goes with the backbone's layers.
            for (ggml_tensor** h : heads) if (cfg.repack_backbone || h != &backbone.output) cpu_matmuls.push_back(h);
        }
        repack_cpu_weights(cpu, cpu_layers, std::move(cpu_matmuls), cfg.fuse, out);
    }

    for (int il = 0; il < hp.n_layer; ++il) {
        const std::string local = out.layer_backend[il] == cpu ? "CPU" : "GPU";
        out.layer_device.push_back(remote_of[il] >= 0 ? out.remote_name[remote_of[il]] : local);
        out.backbone_device.push_back(backbone_remote(il) ? out.remote_name[remote_of[il]]
                                      : on_gpu(plan.backbone, il) ? "GPU" : "CPU");
        out.river_device.push_back(!river ? "" : river_remote(il) ? out.remote_name[remote_of[il]]
                                   : on_gpu(plan.river, il) ? "GPU" : "CPU");
        out.gpu_layers += out.backbone_device.back() == "GPU";
    }
}

}  // namespace river
