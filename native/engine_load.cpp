// An engine's load, in order: the files and weights (the river's checked against the
// backbone's), the CPU backend, the placement of weights, the scheduler, the KV cache and the
// hidden state handed between graphs.
#include "engine.h"

#include <cstdlib>
#include <cstring>

#include "draft_vocab.h"
#include "engine_graph.h"
#include "errors.h"
#include "model_check.h"

namespace river {

namespace {

// Test hook: RIVER_GGUF_FAIL_LOAD_AT=<stage> makes a load throw at that stage, so that tests can
// show a load failing late frees everything it made (tests/test_leaks.py). One getenv per stage.
void fail_point(const char* stage) {
    const char* at = std::getenv("RIVER_GGUF_FAIL_LOAD_AT");
    if (at && std::strcmp(at, stage) == 0) {
        throw std::runtime_error(std::string("load stopped at stage '") + stage + "' (RIVER_GGUF_FAIL_LOAD_AT)");
    }
}

}  // namespace

Engine::Engine(const EngineConfig& cfg)
    : graph_reuse_(cfg.graph_reuse), flash_attn_(cfg.flash_attn), n_batch_(cfg.n_batch) {
    try {
        load(cfg);
    } catch (const RpcError&) {
        throw;
    } catch (...) {
        check_links();  // whatever failed while a server was failing is reported as that failure
        throw;
    }
}

// Members free themselves in reverse order of declaration (see engine.h); Graph is complete here.
Engine::~Engine() = default;

void Engine::load(const EngineConfig& cfg) {
    if (cfg.n_ctx <= 0) throw std::invalid_argument("n_ctx must be positive");
    if (cfg.n_threads <= 0) throw std::invalid_argument("n_threads must be positive");
    if (cfg.n_batch <= 0) throw std::invalid_argument("n_batch must be positive");

    load_weights(cfg);
    // From here on every resource goes straight into its owning member (engine.h), so a throw
    // anywhere below frees all of them.
    start_cpu(cfg);
    fail_point("backend");
    place_weights(cfg, hp_, cpu_.get(), backbone_, river_.get(), links_, [this] { check_links(); }, placement_);
    fail_point("weights");
    rope_factors_ = backbone_.rope_factors(hp_, cfg.n_ctx);  // after placement, which may move tensors
    // Placement is final: whether every backbone weight product is the CPU's plain kernels'
    // (decode_kernels_exact).
    auto plain = [](const ggml_tensor* w) { return !w || (w->buffer && ggml_backend_buffer_is_host(w->buffer)); };
    decode_kernels_exact_ = placement_.local() && plain(backbone_.output);
    for (LayerWeights& w : backbone_.layers) {
        for (ggml_tensor** slot : matmul_slots(w)) decode_kernels_exact_ = decode_kernels_exact_ && plain(*slot);
    }
    if (river_ && (placement_.remote.empty() || cfg.rpc_weights == 0)) {
        // Placement is final: the mixed layers point at the placed (joined, repacked) tensors.
        // A layer's backbone and river weights are on one device (as RPC with rpc_weights="all"),
        // except on a GPU that took the river first (Placement::river_first): there a deep
        // layer's backbone attention stays in host memory and the scheduler splits its mixed
        // layer between the CPU and the GPU.
        for (int il = 0; il < hp_.n_layer; ++il) river_mixed_.push_back(with_attention_of(river_->layers[il],
                                                                                      backbone_.layers[il]));
    }
    start_scheduler();
    exits_on_graph_ = cfg.exit_decision == ExitDecision::Graph ||
                      (cfg.exit_decision == ExitDecision::Auto && !placement_.local());
    cache_ = std::make_unique<KvCache>(hp_, cfg.n_ctx, GGML_TYPE_F16, placement_.layer_backend,
                                       /*v_trans=*/!cfg.flash_attn);
    cells_ = KvCells(cfg.n_ctx);
    check_links();
    fail_point("cache");
    make_state();
    fail_point("end");
}

// The backbone's file and weights, and the river's (in the same file or a separate one).
void Engine::load_weights(const EngineConfig& cfg) {
    file_ = std::make_unique<GgufFile>(cfg.path, cfg.use_mmap);
    hp_ = read_hparams(*file_);
    backbone_ = load_backbone(*file_, hp_);
    if (!cfg.river_path.empty()) {
        if (has_river_layers(*file_)) {
            throw RiverMismatchError("'" + cfg.path + "' already holds a river; do not pass another");
        }
        river_file_ = std::make_unique<GgufFile>(cfg.river_path, cfg.use_mmap);
        HParams rhp = read_hparams(*river_file_);
        check_same_model(hp_, rhp, *file_, *river_file_);
        river_ = std::make_unique<RiverWeights>(load_river(*river_file_, hp_, ""));
    } else if (has_river_layers(*file_)) {
        river_ = std::make_unique<RiverWeights>(load_river(*file_, hp_, "river."));
    }
    // The draft vocabulary, ranked by the river's file (a separate river GGUF, or this one), and
    // the rows of the head a draft ends in: the river's own head where it has one, else the
    // backbone's. Auto (-1) restricts only a river's head: a backbone's is a plain model's head
    // at full precision, whose copy of the rows would cost more memory than it saves time.
    const bool river_head = river_ && river_->head;
    const int64_t size = river_head || cfg.draft_vocab >= 0 ? draft_vocab_size(cfg.draft_vocab, hp_.n_vocab) : 0;
    const GgufFile& ranked = river_file_ ? *river_file_ : *file_;
    const std::vector<int32_t> ids =
        size > 0 ? draft_vocabulary(ranked.get_int_array(kDraftTokensKey), hp_.n_vocab, size) : std::vector<int32_t>{};
    if (!ids.empty()) {
        draft_head_ = river_head ? &river_->draft_head : &backbone_.draft_output;
        draft_rows_ = std::make_unique<HeadRows>(river_head ? river_->head : backbone_.output, ids, kDraftContextRows);
        *draft_head_ = draft_rows_->tensor();
        draft_fixed_ = ids.size();
        draft_row_token_ = ids;
        draft_row_token_.resize(ids.size() + kDraftContextRows, -1);
        draftable_.assign(size_t(hp_.n_vocab), 0);
        for (int32_t t : ids) draftable_[t] = 1;
    }
}

void Engine::start_cpu(const EngineConfig& cfg) {
    cpu_.reset(ggml_backend_cpu_init());
    if (!cpu_) throw std::runtime_error("cannot start the ggml CPU backend");
    ggml_backend_t cpu = cpu_.get();
    ggml_backend_cpu_set_n_threads(cpu, cfg.n_threads);
    // A persistent pool: a decode step runs several small graphs, and starting threads
    // for each would cost more than the graphs themselves.
    ggml_threadpool_params tpp = ggml_threadpool_params_default(cfg.n_threads);
    // Workers sleep between graphs rather than spin: on a small shared machine a spinning
    // worker steals the core the next graph needs (measured: 100x slower decode under load).
    // RIVER_GGML_POLL=1..100 turns polling back on for dedicated machines. This governs ggml's
    // own pool only: a ggml built with OpenMP (llama-cpp-python's default build) runs its
    // threads as OpenMP's, whose waiting OMP_WAIT_POLICY / GOMP_SPINCOUNT set, for both sides.
    tpp.poll = 0;
    if (const char* poll = std::getenv("RIVER_GGML_POLL")) tpp.poll = static_cast<uint32_t>(std::atoi(poll));
    threadpool_.reset(ggml_threadpool_new(&tpp));
    if (threadpool_) ggml_backend_cpu_set_threadpool(cpu, threadpool_.get());
}

void Engine::start_scheduler() {
    if (placement_.gpu) backends_.push_back(placement_.gpu.get());
    for (auto& r : placement_.remote) backends_.push_back(r.get());
    backends_.push_back(cpu_.get());
    sched_.reset(ggml_backend_sched_new(backends_.data(), nullptr, static_cast<int>(backends_.size()),
                                        graph_size(hp_), false, true));
    if (!sched_) throw std::runtime_error("cannot create the ggml scheduler");
    // An exit node stops the backbone graph right after itself: the CPU backend asks this
    // after every node, so the decision costs one flag read per node and no graph split.
    ggml_backend_cpu_set_abort_callback(cpu_.get(), &Engine::abort_requested, this);
}

// The hidden state a stopped backbone graph hands to the river graph, in host memory: an exit
// reads the exit layer's output rows into it from whichever device computed them. (A copy kept on
// the GPU, device to device at the exit, was taken out while a tests_gpu segfault on lavapipe was
// traced; the segfault followed a phi3 LongRoPE case instead, but the device copy never had a
// passing device run.)
void Engine::make_state() {
    ggml_init_params sp{ggml_tensor_overhead() * 4, nullptr, /*no_alloc=*/true};
    state_ctx_.reset(ggml_init(sp));
    if (!state_ctx_) throw std::runtime_error("cannot create the hidden-state context");
    h_state_ = ggml_new_tensor_2d(state_ctx_.get(), GGML_TYPE_F32, hp_.n_embd, n_batch_);
    state_buf_.reset(ggml_backend_alloc_ctx_tensors(state_ctx_.get(), cpu_.get()));
    if (!state_buf_) throw std::runtime_error("out of memory for the hidden-state buffer");
}

}  // namespace river
