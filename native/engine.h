// The decode loop: a backbone, an optional exit river, one shared KV cache, and the
// exit decision between them. Work runs as ggml graphs on ggml-backend (CPU, or a GPU
// backend for offloaded layers through the scheduler).
#pragma once
#include <functional>
#include <iterator>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "ggml-backend.h"
#include "ggml-cpp.h"
#include "ggml-cpu.h"
#include "compute_thread.h"
#include "engine_config.h"
#include "exit_rule.h"
#include "exit_setting.h"
#include "gguf_file.h"
#include "hparams.h"
#include "kv_cache.h"
#include "placement.h"
#include "rpc_link.h"
#include "device_weights.h"
#include "weights.h"

namespace river {

// One eval call: its tokens, its exit setting, and what it returns.
struct EvalRequest : ExitSetting {
    std::vector<int32_t> tokens;
    // The sequence each token is appended to (KvCells), one per token; empty: every token goes to
    // sequence 0, the default sequence the rest of the engine (n_past, draft, river_tails) works on.
    // With sequences, a token sees only its own sequence's earlier rows, and without all_logits
    // the result holds each sequence's last row, in the order the sequences first appear.
    std::vector<int32_t> seq_ids;
    bool all_logits = false;     // logits for every token, else for the last one only
    int first_row = 0;           // with all_logits: the head runs rows first_row.. only (one batch)
    // The final norm's output for every token (n_embd wide rows: llama.cpp's embeddings with
    // pooling none) instead of logits. Backbone mode only.
    bool embeddings = false;
    bool trace = false;          // run layer by layer and record every layer's score
    // The head computes the draft head's rows alone (EngineConfig::draft_vocab and the context
    // rows, Engine::draft): logits column i is that row's token. Set by draft().
    bool draft_vocab = false;
    // Every row of a batch in the single-token kernels (BatchInputs::decode_kernels): each row's
    // bits are a decode step's. Needs decode_kernels_exact().
    bool decode_kernels = false;
};

// Layers first..last, all from the backbone or all from the river.
struct Span {
    int first;
    int last;
    bool river;
    auto key() const { return std::tie(first, last, river); }  // every field; see Engine::GraphSpec
    bool operator==(const Span& o) const { return key() == o.key(); }
};

// The river's hidden state of a batch entering river layer `layer` (Engine::river_tails):
// n rows of n_embd floats.
struct TrunkState {
    int layer = 0;
    std::vector<float> rows;
};

struct EvalResult {
    std::vector<float> logits;      // n_rows x n_cols: logits (n_vocab), or embeddings (n_embd)
    int n_rows = 0;
    int n_cols = 0;
    int exit_layer = -1;            // last backbone layer run; n_layer-1 when no exit, -1 for river-only
    // Per backbone layer tested, the exit rule's lowest score in the batch; with trace, every
    // token's score (layer by layer, n per layer; per chunk of n_batch tokens).
    std::vector<float> similarity;
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
    bool flash_attn() const { return flash_attn_; }
    // Whether a batch in the single-token kernels (EvalRequest::decode_kernels) gives each
    // row's bits as a decode step does: every layer on the CPU, and every backbone weight
    // product read by ggml's plain CPU kernels (a repacked weight has kernels of its own for one
    // column and for several).
    bool decode_kernels_exact() const { return decode_kernels_exact_; }
    bool river_has_head() const { return river_ && river_->head; }
    // The backbone head's weight as the file names it ("output.weight", or "token_embd.weight"
    // when the embedding is tied): what the head's input statistics are kept under.
    std::string head_weight_name() const { return backbone_.output ? backbone_.output->name : std::string(); }
    // Tokens per graph: a longer request runs in chunks of this many.
    int n_batch() const { return n_batch_; }
    int n_ctx() const { return cache_->n_ctx(); }
    // Positions the default sequence (0) holds.
    int n_past() const { return cells_.length(0); }
    // Which sequence and position each cache row holds.
    const KvCells& cells() const { return cells_; }
    bool gpu_offload() const { return placement_.gpu != nullptr; }
    bool exits_on_graph() const { return exits_on_graph_; }
    // Layers on the GPU (fewer than n_gpu_layers asked when they did not fit its free memory).
    int gpu_layers() const { return placement_.gpu ? placement_.gpu_layers : 0; }
    size_t gpu_free() const { return placement_.gpu_free; }
    // Where each layer (and its KV cache) lives: "CPU", "GPU" or an RPC server's host:port.
    const std::vector<std::string>& layer_devices() const { return placement_.layer_device; }
    const Placement& placement() const { return placement_; }

    // Forget positions n.. of sequence `seq` (keeps a shared prefix for the next prompt; n = 0
    // clears the sequence). The other sequences' rows are untouched.
    void truncate(int n, int seq = 0);
    EvalResult eval(const EvalRequest& req);
    // River-only with each of several backbone tails, from one pass of the river's shared layers
    // (a calibration's static tails): `tokens` (at most n_batch, from n_past) run river layers
    // 0..L-1-t for the largest tail t first, the hidden state is kept, and each tail then runs
    // only its own layers: the backbone's L-t..L-1 and the head, while the river goes on from the
    // kept state to the next branch. Per tail (in the order given), the logits of rows
    // first_row.. [n - first_row, n_vocab] (the head runs those rows only), as eval(mode
    // river-only, tail t, all_logits) computes them up to the batch's rounding. The cache rows
    // written are left past n_past (truncate semantics): nothing continues from them.
    // start: the river's hidden state entering layer start->layer (a branch another call kept:
    // the layers before it are not run again, and the rows are the same bit for bit; its layer
    // at most the earliest branch's + 1). kept: each branch's hidden state (tails > 0), entering
    // river layer L-t, appended.
    std::vector<std::vector<float>> river_tails(const std::vector<int32_t>& tokens, const std::vector<int>& tails,
                                                bool backbone_attention, bool river_head, int first_row = 0,
                                                const TrunkState* start = nullptr, std::vector<TrunkState>* kept = nullptr);
    // The draft of lossless decoding on sequence `seq`: from `token` at that sequence's length, up
    // to n_max greedy tokens under the exit setting `how` (river-only, or River's exit; no
    // seq_ids), each kept only while its probability under the draft is at least p_min (with a
    // draft vocabulary: the greedy token of that vocabulary, its probability over it). The drafts'
    // cache rows of `seq` are removed again (the backbone's verify batch writes its own): the
    // sequence's length is the same on return, or when the draft throws, and the other sequences
    // are untouched. Each step is a decode step of `seq` run as eval runs one of sequence 0. Each
    // draft's probability goes to `probs` when given; without it and with p_min <= 0 none is
    // computed.
    //
    // `pick`, when given, chooses each draft instead of the greedy rule: it gets the draft's
    // logits (n of them) and the token of each (nullptr: logit i is token i, the whole
    // vocabulary), both valid during the call, and returns the draft token, or -1 to stop. p_min
    // and `probs` then do not apply. Lossless sampling drafts with a copy of the sampler chain.
    using DraftPicker = std::function<int32_t(const float* logits, const int32_t* tokens, int n)>;
    std::vector<int32_t> draft(int32_t token, int seq, EvalRequest how, int n_max, float p_min,
                               std::vector<float>* probs = nullptr, const DraftPicker* pick = nullptr);
    const KvCache& cache() const { return *cache_; }
    // The tokens a draft may propose for good, ascending: EngineConfig::draft_vocab's and the
    // pinned ones; empty: the whole vocabulary. The context's other tokens join them as they are
    // evaluated (draft_context()).
    std::vector<int32_t> draft_vocab() const;
    // Keep these tokens draftable for good (the end-of-generation ones: a draft can then end the
    // text), in context rows of their own (at most kDraftPinnedRows); the rotating rows start
    // again. Nothing without a draft vocabulary.
    void pin_draft_tokens(const std::vector<int32_t>& tokens);
    // The evaluated tokens outside draft_vocab() that drafts may propose too, oldest first.
    std::vector<int32_t> draft_context() const;

    // Observe every node through the scheduler's eval callback (used to collect activation
    // statistics); while set, no graph is kept. nullptr turns it off.
    void set_observer(ggml_backend_sched_eval_callback cb, void* data) { observer_ = cb; observer_data_ = data; }
    // Decode graphs currently kept for reuse.
    size_t kept_graphs() const { return graphs_.size(); }
    // Graphs built so far (kept or not): fewer than the steps run when graphs are reused.
    size_t graphs_built() const { return graphs_built_; }
    // Backend splits of the last graph computed (1 for a kept CPU graph): the sync points of a
    // step, each of which copies its inputs across devices.
    int last_splits() const { return last_splits_; }

private:
    // What the graph ends in: nothing, the backbone's or the river's head, or the final norm
    // alone (embeddings).
    enum class Head { None, Backbone, River, Norm };

    // What one graph computes. Single-token graphs are position-independent (the KV write goes
    // through row indices and the attention covers a padded n_kv), so equal specs can share one
    // built and allocated graph across decode steps.
    //
    // Equal specs must mean equal graphs: a field left out of the comparison would hand back a
    // kept graph built for another spec, silently. So == compares key(), one tuple of the fields,
    // and a static_assert (at operator==, engine_graph.cpp) counts the struct's fields against the
    // tuple's: a field added here but not to key() stops the build (a sizeof guard would hang
    // on padding and on the standard library's sizeof(std::vector); the count depends on neither).
    // This is llama.cpp's llm_graph_result::can_reuse (the kept graph is reused only when its
    // parameters all match), with the compiler checking that the list is whole.
    struct GraphSpec {
        int n = 0;                   // tokens
        int n_kv = 0;                // cache rows attended over (padded for one token)
        bool from_tokens = true;     // embed tokens, else start from h_state_
        bool river_embd = false;     // embed with the river's table
        std::vector<Span> spans;
        bool exits = false;          // an exit-decision node after every backbone layer
        int rule = 0;                // their exit rule (exit_rule.h), when exits
        Head head = Head::Backbone;
        bool all_logits = false;
        int first_row = 0;           // with all_logits: the head runs rows first_row.. only
        bool backbone_attention = false;  // river spans use river_mixed_
        bool draft_vocab = false;    // the head's draft-vocabulary rows alone
        int n_out = 0;               // > 0: the head runs the n_out rows BatchCells::out names
        bool decode_kernels = false;  // every row in the single-token kernels (n > 1)
        std::vector<int> row_n_kv;    // with decode_kernels: each row's n_kv, a decode step's
        bool every_row = false;       // every layer keeps every row (a trace records each row's score)
        auto key() const {
            return std::tie(n, n_kv, from_tokens, river_embd, spans, exits, rule, head, all_logits, first_row,
                            backbone_attention, draft_vocab, n_out, decode_kernels, row_n_kv, every_row);
        }
        bool operator==(const GraphSpec& o) const;
    };
    struct ExitNode;
    struct Graph;

    // The exit decision of the step being computed; exit nodes read and write it.
    struct ExitState {
        bool may_exit = false;
        const ExitRule* rule = nullptr;
        float threshold = 2.0f;
        int record_first = 0, record_last = -1;  // scores recorded for these layers
        bool record_rows = false;                // every token's score, not the batch's lowest (a trace)
        int exit_first = 0, exit_last = -1;      // layers a token may leave after
        int exit_layer = -1;                     // set when the backbone graph stopped for an exit
        std::vector<float>* similarity = nullptr;
        bool records(int l) const { return l >= record_first && l <= record_last; }
        bool exit_allowed(int l) const { return may_exit && l >= exit_first && l <= exit_last; }
    };
    static void exit_node_op(ggml_tensor* dst, int ith, int nth, void* node);
    static bool abort_requested(void* engine);
    // The scheduler's eval callback for graph exit decisions (ExitDecision::Graph).
    static bool exit_eval(ggml_tensor* t, bool ask, void* engine);
    // One exit decision from a tested layer's scores (both paths): records the lowest, and on
    // an exit copies h_out to h_state_ and marks the graph stopped.
    bool decide_exit(int layer, const float* s, int64_t n, ggml_tensor* h_out);

    void load(const EngineConfig& cfg);  // the constructor's work, in the steps below
    void load_weights(const EngineConfig& cfg);
    void start_cpu(const EngineConfig& cfg);
    void start_scheduler();
    void make_state();
    void check_request(const EvalRequest& req) const;
    // Throws RpcError (and keeps refusing work) once a server has failed; see rpc_link.h.
    void check_links();
    // Where a batch's tokens go: each token's sequence, position and cache row (KvCells::place),
    // and, in a batch of several sequences without all_logits, the tokens whose rows the head
    // computes (the last of a sequence in the request; empty: the usual rule).
    struct BatchCells {
        std::vector<int32_t> seq, pos;
        std::vector<int64_t> rows;
        std::vector<int32_t> out;
        int end_before = 0;  // one past the highest cache row in use before these were placed
    };
    // Cache rows for n tokens of the given sequences (nullptr: every token on sequence `seq`),
    // taken from cells_.
    BatchCells place(const int32_t* seq_ids, int n, int seq = 0);
    // Attended rows for a batch of n tokens: llama.cpp's padded n_kv (see eval_chunk).
    int attended_rows(int n) const;
    // llama.cpp's padded n_kv for a cache whose rows in use end at `end`: a decode step's.
    int padded_rows(int end) const;
    // eval's work, with the tokens of a request that names no sequences (no seq_ids) appended to
    // sequence `seq` instead of 0: eval is eval_on(req, 0), and a draft step on any sequence is a
    // one-token request here, so it runs exactly as a decode step of sequence 0 does (the same
    // checks, the same graph key: the head runs the last row, where a request with seq_ids names
    // its rows) and, as every chunk of eval, one that fails puts its sequences back to their
    // lengths before it. With seq_ids, `seq` is not used.
    EvalResult eval_on(const EvalRequest& req, int seq);
    // One chunk of at most n_batch tokens, placed at `cells`.
    void eval_chunk(const int32_t* tokens, const BatchCells& cells, const EvalRequest& req, EvalResult& out);
    // Run `spec` on `tokens` (or on h_state_) at `cells`; false when an exit node stopped it.
    bool run(const GraphSpec& spec, const int32_t* tokens, const BatchCells& cells, EvalResult* out);
    // The rows of a request with sequences (row r from token row_token[r]), reduced to each
    // sequence's last token's row, in the order the sequences first appear.
    static void keep_last_rows(const std::vector<int32_t>& seq_ids, const std::vector<size_t>& row_token,
                               EvalResult& out);
    std::unique_ptr<Graph> build(const GraphSpec& spec, bool own_sched);
    Graph& graph_for(const GraphSpec& spec);

    // Declared first, so destroyed last: each relays for ggml-rpc objects (backends, buffers,
    // the scheduler's compute buffers) until they are all freed.
    std::vector<std::unique_ptr<RpcLink>> links_;
    std::string broken_;                    // why this engine refuses work after a server failed

    std::unique_ptr<GgufFile> file_;
    std::unique_ptr<GgufFile> river_file_;
    HParams hp_;
    BackboneWeights backbone_;
    ggml_tensor* rope_factors_ = nullptr;  // backbone_.rope_factors for this context (river layers too)
    std::unique_ptr<RiverWeights> river_;
    // Per layer: the river's weights with the backbone's attention group (backbone_attention);
    // pointers into backbone_ and river_, set once their placement is final.
    std::vector<LayerWeights> river_mixed_;
    // The draft head's rows (a host copy; placement may move it): EngineConfig::draft_vocab's
    // tokens, then kDraftContextRows for the pinned and the context's tokens. Null: no draft
    // vocabulary.
    std::unique_ptr<HeadRows> draft_rows_;
    size_t draft_fixed_ = 0;                 // rows of EngineConfig::draft_vocab's tokens
    ggml_tensor** draft_head_ = nullptr;     // the slot of the placed draft head (river's or backbone's)
    std::vector<int32_t> draft_row_token_;   // row -> token: the fixed, the pinned, the rotating rows (-1: unused)
    std::vector<char> draftable_;            // per token: it has a row
    int draft_pinned_ = 0;                   // context rows pinned (pin_draft_tokens)
    int draft_context_used_ = 0;             // rotating context rows filled
    int draft_context_next_ = 0;             // the rotating row the next new token takes
    // Give `tokens` outside the draft head's rows a context row each (kDraftContextRows).
    void note_draft_context(const int32_t* tokens, int n);
    // Row `row` of the draft head becomes token's; the token it held stops being draftable.
    void put_draft_row(size_t row, int32_t token);

    // Every native resource is owned from the moment it is created, so a constructor that
    // throws half-way frees what it made. Members are destroyed in reverse order: the scheduler
    // before the buffers and backends it uses, buffers before their contexts, the CPU backend
    // before its thread pool.
    struct ThreadpoolFree {
        void operator()(ggml_threadpool_t tp) const { ggml_threadpool_free(tp); }
    };
    std::unique_ptr<ggml_threadpool, ThreadpoolFree> threadpool_;
    ggml_backend_ptr cpu_;
    // The GPU and remote backends and the weights placed on them (or repacked for the CPU).
    Placement placement_;
    std::vector<ggml_backend_t> backends_;  // the scheduler's list: GPU (if any), remote, CPU; not owned

    // Hidden state handed from a stopped backbone graph to the river graph.
    ggml_context_ptr state_ctx_;
    ggml_backend_buffer_ptr state_buf_;
    ggml_tensor* h_state_ = nullptr;    // F32 [n_embd, n_batch]

    std::unique_ptr<KvCache> cache_;
    ggml_backend_sched_ptr sched_;      // for graphs that are not kept (prompts)

    ExitState exit_;
    bool abort_ = false;                // set by an exit node, read by the CPU backend after each node
    bool exits_on_graph_ = false;       // the exit decision as graph ops (ExitDecision)
    const Graph* running_ = nullptr;    // the graph exit_eval watches

    std::vector<std::unique_ptr<Graph>> graphs_;  // kept decode graphs, most recently used last
    std::unique_ptr<Graph> transient_;  // the scheduler's graph (prompts, offloaded layers)
    size_t graphs_built_ = 0;
    int last_splits_ = 0;
    bool graph_reuse_;
    bool flash_attn_;
    bool decode_kernels_exact_ = false;
    int n_batch_;
    KvCells cells_{0};

    ggml_backend_sched_eval_callback observer_ = nullptr;
    void* observer_data_ = nullptr;

    // Where every graph computes (compute_thread.h); last, so it stops before anything it uses goes.
    ComputeThread compute_;
};

}  // namespace river
