// The decode loop: a backbone, an optional exit river, one shared KV cache, and the
// exit decision between them. Work runs as ggml graphs on ggml-backend (CPU, or a GPU
// backend for offloaded layers through the scheduler).
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "gguf_file.h"
#include "hparams.h"
#include "kv_cache.h"
#include "weights.h"

namespace river {

struct EngineConfig {
    std::string path;            // backbone GGUF (or a River GGUF)
    std::string river_path;      // a separate river GGUF; empty when none or when embedded
    int n_ctx = 2048;
    int n_threads = 1;
    int n_batch = 512;           // prompt tokens per graph
    int n_gpu_layers = 0;        // the last n layers go to a GPU backend, when one exists
    bool repack = true;          // CPU mat-mul weights in the CPU's repacked buffer types, as llama.cpp does
    int exit_chunk = 0;          // backbone layers per graph while exits are possible; 0: 8 on CPU, 1 with a GPU
};

enum class ExitMode {
    Backbone = 0,   // never exit
    River = 1,      // dynamic exit: cos(h_in, h_out) > threshold after layer >= min_exit_layer
    RiverOnly = 2,  // every layer from the river
    Fixed = 3,      // exit after layer exit_layer for every token
};

struct EvalRequest {
    std::vector<int32_t> tokens;
    ExitMode mode = ExitMode::Backbone;
    float threshold = 2.0f;
    int min_exit_layer = 0;
    int exit_layer = -1;         // for ExitMode::Fixed
    bool river_head = false;     // exited tokens use the river's quantized head
    bool all_logits = false;     // logits for every token, else for the last one only
    bool trace = false;          // run layer by layer and record every similarity
};

struct EvalResult {
    std::vector<float> logits;      // n_rows x n_vocab
    int n_rows = 0;
    int exit_layer = -1;            // last backbone layer run; n_layer-1 when no exit, -1 for river-only
    std::vector<float> similarity;  // min over the batch of cos(h_in, h_out) per backbone layer tested
};

class Engine {
public:
    explicit Engine(const EngineConfig& cfg);
    ~Engine();
    Engine(const Engine&) = delete;
    Engine& operator=(const Engine&) = delete;

    const HParams& hparams() const { return hp_; }
    const GgufFile& file() const { return *file_; }
    bool has_river() const { return river_ != nullptr; }
    bool river_has_head() const { return river_ && river_->head; }
    int n_ctx() const { return cache_->n_ctx(); }
    int n_past() const { return n_past_; }
    bool gpu_offload() const { return gpu_ != nullptr; }

    // Forget cache rows n.. (keeps a shared prefix for the next prompt).
    void truncate(int n);
    EvalResult eval(const EvalRequest& req);
    const KvCache& cache() const { return *cache_; }

private:
    struct Span { int first; int last; bool river; };
    enum class Head { None, Backbone, River };
    // The exit decision inside one fused backbone graph: after each watched layer the scheduler
    // hands us that layer's similarity, and we stop the graph when the token exits.
    struct ExitWatch {
        int first = 0;               // first layer tested
        int last = 0;                // last layer tested
        int max_exit = 0;            // deepest layer a token may leave after (the river needs a layer)
        bool may_exit = false;
        float threshold = 2.0f;
        int exit_layer = -1;         // set when the graph was stopped for an exit
        std::vector<float>* similarity = nullptr;
        ggml_tensor* sim_rows = nullptr;  // this graph's view of sim_state_
        int n = 0;
    };
    static bool on_node(ggml_tensor* t, bool ask, void* watch);

    void check_request(const EvalRequest& req) const;
    // One chunk of at most n_batch tokens, all at positions n_past_..
    void eval_chunk(const int32_t* tokens, int n, const EvalRequest& req, EvalResult& out);
    // Build and run one graph over `spans`, on the tokens' embeddings or on h_state_; with a
    // watch, the exit decision runs after each watched layer and may stop the graph there.
    void run(const int32_t* tokens, int n, bool from_tokens, bool river_embd, const std::vector<Span>& spans,
             Head head, bool all_logits, EvalResult* out, ExitWatch* watch = nullptr);

    std::unique_ptr<GgufFile> file_;
    std::unique_ptr<GgufFile> river_file_;
    HParams hp_;
    BackboneWeights backbone_;
    std::unique_ptr<RiverWeights> river_;

    ggml_backend_t cpu_ = nullptr;
    ggml_backend_t gpu_ = nullptr;
    ggml_threadpool_t threadpool_ = nullptr;
    ggml_backend_sched_t sched_ = nullptr;
    std::vector<std::unique_ptr<DeviceWeights>> placed_weights_;  // GPU copies, repacked CPU copies
    std::unique_ptr<KvCache> cache_;

    // Hidden state and similarity carried between the graphs of one step.
    ggml_context* state_ctx_ = nullptr;
    ggml_backend_buffer_t state_buf_ = nullptr;
    ggml_tensor* h_state_ = nullptr;    // F32 [n_embd, n_batch]
    ggml_tensor* sim_state_ = nullptr;  // F32 [n_batch]

    std::vector<uint8_t> graph_meta_;
    int n_batch_;
    int exit_chunk_;  // backbone layers per graph on the exit-capable path
    int n_past_ = 0;
};

}  // namespace river
