// What an Engine is built with: the files, the context, threads, and where layers and the exit
// decision run. Read by the engine and by the placement of weights (placement.cpp). Its fields
// are listed once (kEngineConfigFields): the bindings take Engine's keyword arguments from the
// list and export the defaults (ENGINE_CONFIG).
#pragma once
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <string>
#include <variant>
#include <vector>

#include "field_count.h"

namespace river {

enum class ExitDecision {
    Auto = 0,   // on the graph when layers are offloaded (GPU or RPC), else the CPU op
    Cpu = 1,    // a CPU custom op after each tested layer
    Graph = 2,  // ggml ops on the layer's device, read by the scheduler's eval callback
};

// The names of ExitDecision and of rpc_weights' codes, code order.
inline constexpr const char* kExitDecisions[] = {"auto", "cpu", "graph"};
inline constexpr const char* kRpcWeights[] = {"all", "backbone", "river"};

struct EngineConfig {
    std::string path;            // backbone GGUF (or a River GGUF)
    std::string river_path;      // a separate river GGUF; empty when none or when embedded
    int n_ctx = 2048;
    int n_threads = 1;
    int n_batch = 512;           // prompt tokens per graph
    int n_gpu_layers = 0;        // the last n layers go to a GPU backend, when one exists
    int main_gpu = 0;            // which GPU: an index into devices.h offload_gpus() (discrete first)
    size_t gpu_memory = 0;       // bytes the GPU placement may use (0: its free memory); placement.h plan_gpu
    bool repack = true;          // CPU mat-mul weights in the CPU's repacked buffer types, as llama.cpp does
    bool repack_backbone = true; // with repack: the backbone's weights too (false: the river's alone)
    bool graph_reuse = true;     // keep single-token decode graphs (and their allocations) across steps
    bool fuse = true;            // repacked layers: Q/K/V and gate/up as one mul_mat each (same logits)
    bool use_mmap = true;        // map the GGUF files; false (or RIVER_GGUF_NO_MMAP=1) reads them
    // Attention as ggml_flash_attn_ext (llama.cpp with flash_attn on), else llama.cpp's
    // non-flash path (KQ, soft_max_ext, V^T x KQ) over a V cache stored transposed; each gives
    // llama.cpp's logits with the same setting.
    bool flash_attn = true;
    // Where the exit decision runs. The CPU op reads the hidden states in place and stops the
    // CPU backend; with layers on a GPU or an RPC server it pulls h_in and h_out to the CPU
    // after every tested layer, splitting the graph there. On the graph, the exit rule's score
    // (exit_rule.h graph_score) is computed by ggml ops on the layer's own device, and the
    // scheduler's eval callback reads one float per token and stops the graph at an exit.
    ExitDecision exit_decision = ExitDecision::Auto;
    // Layers on other machines through ggml-rpc (rpc_link.h). Layer l's KV cache lives on its device.
    std::vector<std::string> rpc_servers;  // host:port of each server
    int rpc_n_layers = -1;                 // the last n layers go remote (-1: all); ignored when rpc_layers is set
    std::vector<int> rpc_layers;           // exactly these layers go remote
    std::vector<float> rpc_split;          // share of the remote layers per remote device; empty: by free memory
    int rpc_weights = 0;                   // whose weights of a remote layer go with it: kRpcWeights
    double rpc_timeout = 120;              // seconds a server may take to answer; <= 0: no limit
    // Lossless decoding's draft vocabulary (draft_vocab.h): this many tokens (0: none, the whole
    // vocabulary; -1: draft_vocab_size's choice for a river with its own head). A draft's head
    // then runs these rows alone; the verify batch runs the backbone's full head, so the text is
    // the same. Off by default: an engine opened only to check or trace a file needs none.
    int draft_vocab = 0;
};

// Every field by name, for the bindings. The compiler counts the list against the struct.
struct EngineConfigField {
    const char* name;
    std::variant<std::string EngineConfig::*, int EngineConfig::*, size_t EngineConfig::*, bool EngineConfig::*,
                 double EngineConfig::*, ExitDecision EngineConfig::*, std::vector<std::string> EngineConfig::*,
                 std::vector<int> EngineConfig::*, std::vector<float> EngineConfig::*>
        member;
};
inline constexpr EngineConfigField kEngineConfigFields[] = {
    {"path", &EngineConfig::path},
    {"river_path", &EngineConfig::river_path},
    {"n_ctx", &EngineConfig::n_ctx},
    {"n_threads", &EngineConfig::n_threads},
    {"n_batch", &EngineConfig::n_batch},
    {"n_gpu_layers", &EngineConfig::n_gpu_layers},
    {"main_gpu", &EngineConfig::main_gpu},
    {"gpu_memory", &EngineConfig::gpu_memory},
    {"repack", &EngineConfig::repack},
    {"repack_backbone", &EngineConfig::repack_backbone},
    {"graph_reuse", &EngineConfig::graph_reuse},
    {"fuse", &EngineConfig::fuse},
    {"use_mmap", &EngineConfig::use_mmap},
    {"flash_attn", &EngineConfig::flash_attn},
    {"exit_decision", &EngineConfig::exit_decision},
    {"rpc_servers", &EngineConfig::rpc_servers},
    {"rpc_n_layers", &EngineConfig::rpc_n_layers},
    {"rpc_layers", &EngineConfig::rpc_layers},
    {"rpc_split", &EngineConfig::rpc_split},
    {"rpc_weights", &EngineConfig::rpc_weights},
    {"rpc_timeout", &EngineConfig::rpc_timeout},
    {"draft_vocab", &EngineConfig::draft_vocab},
};
static_assert(std::size(kEngineConfigFields) == field_count<EngineConfig>(),
              "kEngineConfigFields must list every field of EngineConfig");


}  // namespace river
