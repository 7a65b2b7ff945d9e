#include "engine.h"
#include "draft_vocab.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>

#include "errors.h"
#include "ggml-alloc.h"
#include "layer_graph.h"

// In call order, top-down: the graph types, loading (files, weights, placement, scheduler,
// cache), then a step: eval, eval_chunk, run, graph_for, build, and the exit node that runs
// inside a graph.

namespace river {

struct Engine::ExitNode {
    Engine* engine;
    int layer;
    ggml_tensor* similarity = nullptr;  // graph decisions: cos(h_in, h_out) per token, F32 [1, n]
    ggml_tensor* h_out = nullptr;
};

struct Engine::Graph {
    GraphSpec spec;
    std::vector<uint8_t> meta;  // the context's tensor and graph descriptions
    ggml_context* ctx = nullptr;
    ggml_cgraph* gf = nullptr;
    ggml_gallocr_t galloc = nullptr;  // a kept CPU graph's own compute buffer
    ggml_backend_sched_ptr sched;     // a kept graph's own scheduler (offloaded layers, graph exits)
    BatchInputs in;
    ggml_tensor* tok_in = nullptr;
    ggml_tensor* logits = nullptr;
    std::vector<ExitNode> exit_nodes;  // user data of the exit nodes; reserved, never moved

    Graph() = default;
    Graph(const Graph&) = delete;
    Graph& operator=(const Graph&) = delete;
    ~Graph() {
        sched.reset();  // its compute buffers before the tensor descriptions they back
        if (galloc) ggml_gallocr_free(galloc);
        if (ctx) ggml_free(ctx);
    }
};

namespace {

// The number of fields of an aggregate: the most values that convert to anything it can be
// brace-initialised with. Unlike a list written by hand, it cannot miss a field.
struct AnyField {
    template <class T>
    operator T() const;  // only named in unevaluated contexts
};

template <class T, class... A>
auto brace_initialisable(int) -> decltype(T{std::declval<A>()...}, std::true_type{});
template <class T, class... A>
std::false_type brace_initialisable(...);

template <class T, class... A>
constexpr size_t field_count() {
    if constexpr (decltype(brace_initialisable<T, A..., AnyField>(0))::value) {
        return field_count<T, A..., AnyField>();
    } else {
        return sizeof...(A);
    }
}

static_assert(field_count<Span>() == std::tuple_size_v<decltype(Span{}.key())>,
              "Span::key() must list every field of Span");

}  // namespace

bool Engine::GraphSpec::operator==(const GraphSpec& o) const {
    static_assert(field_count<GraphSpec>() == std::tuple_size_v<decltype(GraphSpec{}.key())>,
                  "GraphSpec::key() must list every field of GraphSpec (see engine.h)");
    return key() == o.key();
}

namespace {

// Nodes per decoder layer are about 40; leave room for the head and inputs.
size_t graph_size(const HParams& hp) { return 128 * size_t(hp.n_layer) + 512; }

// The river must be the backbone's own layers at another precision.
void check_same_model(const HParams& a, const HParams& b, const GgufFile& fa, const GgufFile& fb) {
    auto num = [](double v) {
        char buf[32];
        std::snprintf(buf, sizeof(buf), "%g", v);
        return std::string(buf);
    };
    auto differ = [&](const char* what, double x, double y) {
        if (x != y) {
            throw RiverMismatchError(std::string("river '") + fb.path() + "' does not match backbone '" + fa.path() +
                                     "': " + what + " is " + num(y) + " in the river but " + num(x) +
                                     " in the backbone");
        }
    };
    if (a.arch_name != b.arch_name) {
        throw RiverMismatchError("river '" + fb.path() + "' has architecture '" + b.arch_name + "' but backbone '" +
                                 fa.path() + "' has '" + a.arch_name + "'");
    }
    differ("block_count", a.n_layer, b.n_layer);
    differ("embedding_length", a.n_embd, b.n_embd);
    differ("feed_forward_length", a.n_ff, b.n_ff);
    differ("attention.head_count", a.n_head, b.n_head);
    differ("attention.head_count_kv", a.n_head_kv, b.n_head_kv);
    differ("attention.key_length", a.head_dim_k, b.head_dim_k);
    differ("attention.value_length", a.head_dim_v, b.head_dim_v);
    differ("vocabulary size", a.n_vocab, b.n_vocab);
    differ("rope.freq_base", a.rope_freq_base, b.rope_freq_base);
    differ("rope.dimension_count", a.n_rot, b.n_rot);
    differ("attention.sliding_window", a.n_swa, b.n_swa);
    differ("the attention scale", a.attn_scale, b.attn_scale);
    differ("attn_logit_softcapping", a.attn_softcap, b.attn_softcap);
    differ("final_logit_softcapping", a.final_softcap, b.final_softcap);
    differ("embedding_scale", a.embedding_scale, b.embedding_scale);
    differ("residual_scale", a.residual_scale, b.residual_scale);
    differ("logit_scale", a.logit_scale, b.logit_scale);
    differ("rope.scaling.factor", a.rope_freq_scale, b.rope_freq_scale);
    differ("the rope's YaRN mix", a.rope_ext_factor, b.rope_ext_factor);
    differ("attention.temperature_scale", a.attn_temp_scale, b.attn_temp_scale);
    if (a.swa_layers != b.swa_layers) throw RiverMismatchError("river '" + fb.path() + "' slides its window on other layers than backbone '" + fa.path() + "'");
    // Same vocabulary, token by token: a river from another tokenizer would be nonsense.
    const int64_t ka = gguf_find_key(fa.meta(), "tokenizer.ggml.tokens");
    const int64_t kb = gguf_find_key(fb.meta(), "tokenizer.ggml.tokens");
    if ((ka < 0) != (kb < 0)) throw RiverMismatchError("only one of backbone and river has a vocabulary");
    if (ka >= 0) {
        const size_t n = gguf_get_arr_n(fa.meta(), ka);
        differ("tokenizer token count", double(n), double(gguf_get_arr_n(fb.meta(), kb)));
        for (size_t i = 0; i < n; ++i) {
            if (std::strcmp(gguf_get_arr_str(fa.meta(), ka, i), gguf_get_arr_str(fb.meta(), kb, i)) != 0) {
                throw RiverMismatchError("river vocabulary differs from the backbone's at token " + std::to_string(i));
            }
        }
    }
}

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
    if (size > 0) {
        const GgufFile& ranked = river_file_ ? *river_file_ : *file_;
        draft_vocab_ = draft_vocabulary(ranked.get_int_array(kDraftTokensKey), hp_.n_vocab, size, cfg.draft_always);
    }
    if (!draft_vocab_.empty()) {
        draft_head_ = river_head ? &river_->draft_head : &backbone_.draft_output;
        draft_rows_ = std::make_unique<HeadRows>(river_head ? river_->head : backbone_.output, draft_vocab_,
                                                 kDraftContextRows);
        *draft_head_ = draft_rows_->tensor();
        draft_row_token_ = draft_vocab_;
        draft_row_token_.resize(draft_vocab_.size() + kDraftContextRows, -1);
        draftable_.assign(size_t(hp_.n_vocab), 0);
        for (int32_t t : draft_vocab_) draftable_[t] = 1;
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

void Engine::check_links() {
    if (!broken_.empty()) throw RpcError(broken_);
    for (const auto& link : links_) {
        if (link->failed()) {
            broken_ = link->failure() + "; this model cannot go on: close it and load it again";
            throw RpcError(broken_);
        }
    }
}

void Engine::truncate(int n) {
    if (n < 0 || n > n_past_) throw std::invalid_argument("truncate position out of range");
    n_past_ = n;
}

void Engine::note_draft_context(const int32_t* tokens, int n) {
    if (!draft_rows_) return;
    const size_t first = draft_vocab_.size();
    for (int i = 0; i < n; ++i) {
        const int32_t t = tokens[i];
        if (draftable_[t]) continue;
        const size_t row = first + size_t(draft_context_next_);
        if (draft_row_token_[row] >= 0) draftable_[draft_row_token_[row]] = 0;  // the oldest gives way
        draft_rows_->set_row(*draft_head_, int64_t(row), t);
        draft_row_token_[row] = t;
        draftable_[t] = 1;
        draft_context_next_ = (draft_context_next_ + 1) % kDraftContextRows;
        draft_context_used_ = std::min(draft_context_used_ + 1, kDraftContextRows);
    }
}

std::vector<int32_t> Engine::draft_context() const {
    std::vector<int32_t> out;
    if (!draft_rows_) return out;
    const size_t first = draft_vocab_.size();
    const int oldest = draft_context_used_ < kDraftContextRows ? 0 : draft_context_next_;
    for (int i = 0; i < draft_context_used_; ++i) {
        out.push_back(draft_row_token_[first + size_t((oldest + i) % kDraftContextRows)]);
    }
    return out;
}

EvalResult Engine::eval(const EvalRequest& req) {
    check_links();
    check_request(req);
    // Every token evaluated may be drafted later (a draft's own tokens already can).
    if (!req.draft_vocab) note_draft_context(req.tokens.data(), static_cast<int>(req.tokens.size()));
    EvalResult out;
    out.exit_layer = hp_.n_layer - 1;
    const int n = static_cast<int>(req.tokens.size());
    try {
        for (int start = 0; start < n; start += n_batch_) {
            const int len = std::min(n_batch_, n - start);
            eval_chunk(req.tokens.data() + start, len, req, out);
            n_past_ += len;
        }
    } catch (const RpcError&) {
        throw;
    } catch (...) {
        check_links();  // a step that failed because a server did reports the server
        throw;
    }
    // After a server failed, the step read placeholders (rpc_link.h): never return them.
    check_links();
    return out;
}

std::vector<int32_t> Engine::draft(int32_t token, EvalRequest how, int n_max, float p_min, std::vector<float>* probs,
                                   const DraftPicker* pick) {
    if (n_max < 0) throw std::invalid_argument("n_max must be >= 0");
    if (std::isnan(p_min)) throw std::invalid_argument("p_min is NaN");
    if (how.all_logits || how.embeddings || how.trace) throw std::invalid_argument("a draft takes one row of logits");
    // With a draft vocabulary the head runs its rows alone, and logit i is token draft_row_token_[i].
    how.draft_vocab = !draft_vocab_.empty();
    if (how.draft_vocab) {
        if (token < 0 || token >= hp_.n_vocab) throw std::invalid_argument("token id " + std::to_string(token) +
                                                                          " is outside the vocabulary");
        note_draft_context(&token, 1);
    }
    const int start = n_past_;
    // The verify batch evaluates `token` and every draft: all must fit the context.
    n_max = std::min(n_max, cache_->n_ctx() - start - 1);
    std::vector<int32_t> drafts;
    try {
        int32_t cur = token;
        for (int i = 0; i < n_max; ++i) {
            how.tokens.assign(1, cur);
            const EvalResult r = eval(how);
            const float* l = r.logits.data();
            // The draft head's rows in use (its unused context rows are zero), or every token.
            const bool rows = r.n_cols < hp_.n_vocab;
            const int n_vocab = rows ? static_cast<int>(draft_vocab_.size()) + draft_context_used_ : r.n_cols;
            if (pick) {
                const int32_t chosen = (*pick)(l, rows ? draft_row_token_.data() : nullptr, n_vocab);
                if (chosen < 0) break;
                if (chosen >= hp_.n_vocab) throw std::invalid_argument("the draft picker chose a token outside the vocabulary");
                drafts.push_back(chosen);
                cur = chosen;
                continue;
            }
            const int best = static_cast<int>(std::max_element(l, l + n_vocab) - l);
            if (p_min > 0.0f || probs) {
                double sum = 0;  // p(best) = 1 / sum_j exp(l_j - l_best)
                for (int j = 0; j < n_vocab; ++j) sum += std::exp(double(l[j]) - l[best]);
                const float p = static_cast<float>(1.0 / sum);
                if (!(p >= p_min)) break;  // a NaN row drafts nothing
                if (probs) probs->push_back(p);
            } else {
                // No probability asked for: only what made it NaN above stops the draft (a NaN
                // logit, or an infinite best), without a softmax over the vocabulary.
                bool finite = std::isfinite(l[best]);
                for (int j = 0; j < n_vocab && finite; ++j) finite = !std::isnan(l[j]);
                if (!finite) break;
            }
            // The head that ran had the draft vocabulary's rows, or all of them.
            const int32_t token = rows ? draft_row_token_[best] : best;
            drafts.push_back(token);
            cur = token;
        }
    } catch (...) {
        n_past_ = start;
        throw;
    }
    n_past_ = start;
    return drafts;
}

void Engine::check_request(const EvalRequest& req) const {
    const int n = static_cast<int>(req.tokens.size());
    if (n == 0) throw std::invalid_argument("no tokens to evaluate");
    if (n_past_ + n > cache_->n_ctx()) {
        throw ContextOverflowError("context overflow: " + std::to_string(n) + " new tokens after " +
                                   std::to_string(n_past_) + " cached need " + std::to_string(n_past_ + n) +
                                   " positions, but n_ctx is " + std::to_string(cache_->n_ctx()));
    }
    for (int32_t t : req.tokens) {
        if (t < 0 || t >= hp_.n_vocab) {
            throw std::invalid_argument("token id " + std::to_string(t) + " is outside the vocabulary [0, " +
                                        std::to_string(hp_.n_vocab) + ")");
        }
    }
    const bool needs_river = req.mode == ExitMode::River || req.mode == ExitMode::RiverOnly ||
                             (req.mode == ExitMode::Fixed && req.exit_layer < hp_.n_layer - 1);
    if (needs_river && !river_) throw std::invalid_argument("this mode needs a river, and the model has none");
    if (req.embeddings && (req.mode != ExitMode::Backbone || req.trace)) {
        throw std::invalid_argument("embeddings come from the backbone: mode must be backbone");
    }
    if (req.mode == ExitMode::Fixed && (req.exit_layer < -1 || req.exit_layer >= hp_.n_layer)) {
        throw std::invalid_argument("exit_layer must be in [-1, " + std::to_string(hp_.n_layer - 1) + "]");
    }
    if (req.backbone_attention && needs_river && !river_mixed_.size()) {
        throw std::invalid_argument(
            "backbone_attention needs each layer's backbone and river weights on one device: not available "
            "with rpc_weights='backbone' or 'river'");
    }
    if (req.draft_vocab && (draft_vocab_.empty() || req.all_logits || req.embeddings || req.trace)) {
        throw std::invalid_argument("draft_vocab: one row of draft logits, from an engine with a draft vocabulary");
    }
    if (req.river_head && needs_river && !river_->head) {
        throw std::invalid_argument("river_head=True but the river has no output head");
    }
    if (std::isnan(req.threshold)) throw std::invalid_argument("threshold is NaN");
    if (req.min_exit_layer < 0) throw std::invalid_argument("min_exit_layer must be >= 0");
    if (req.tail < 0 || req.tail >= hp_.n_layer) {
        throw std::invalid_argument("tail must be in [0, " + std::to_string(hp_.n_layer - 1) + "]");
    }
}

namespace {

// Backbone layers 0..k, river k+1..L-1-tail, backbone again for the tail; k = -1 is river from
// the start, k >= L-1-tail the backbone alone.
std::vector<Span> depth_spans(int k, int tail, int n_layer) {
    const int last = n_layer - 1, river_last = last - tail;
    if (k >= river_last) return {{0, last, false}};
    std::vector<Span> s;
    if (k >= 0) s.push_back({0, k, false});
    s.push_back({k + 1, river_last, true});
    if (tail > 0) s.push_back({river_last + 1, last, false});
    return s;
}

}  // namespace

void Engine::eval_chunk(const int32_t* tokens, int n, const EvalRequest& req, EvalResult& out) {
    const int last = hp_.n_layer - 1;
    const int river_last = last - req.tail;  // the river's last layer; the tail follows it
    const Head exit_head = req.river_head ? Head::River : Head::Backbone;
    auto note_exit = [&](int l) { out.exit_layer = std::min(out.exit_layer, l); };

    GraphSpec spec;
    spec.n = n;
    // A token, or a short batch (a lossless verify batch), attends over a padded n_kv (masked
    // beyond each token's position), as llama.cpp does (its get_n_kv), so its graph stays the same
    // for 256 positions: a decode step's, and a verify batch's from one round to the next
    // (graph_for keeps the last one built). Without flash attention every row spanned enters the
    // KQ softmax and the V product, whose SIMD sums group the terms by the length: every batch
    // gets llama.cpp's padded n_kv. With it, a longer batch attends over exactly what it needs:
    // ggml's CPU kernel skips masked rows one query row at a time, but its tiled kernel for
    // batches of 64 rows and more reads whole V tiles, masked rows too, where the cache's NaN
    // poison (KvCache::poison, which makes a hole read show) would spread.
    constexpr int kPaddedBatch = 32;
    const int padded = std::min(cache_->n_ctx(), std::max(256, (n_past_ + n + 255) / 256 * 256));
    spec.n_kv = n <= kPaddedBatch || !flash_attn_ ? padded : n_past_ + n;
    spec.all_logits = req.all_logits || req.embeddings;
    spec.backbone_attention = req.backbone_attention;
    spec.draft_vocab = req.draft_vocab;

    int fixed = -2;  // fixed exit depth, when the whole depth is known before running
    if (req.mode == ExitMode::Backbone && !req.trace) fixed = last;
    if (req.mode == ExitMode::RiverOnly) fixed = -1;
    if (req.mode == ExitMode::Fixed) fixed = req.exit_layer;
    // No exit can happen: the whole backbone in one graph. cos <= 1, so tau > 1 never passes.
    if (req.mode == ExitMode::River && !req.trace && (req.min_exit_layer >= river_last || req.threshold > 1.0f)) {
        fixed = last;
    }
    if (fixed != -2) {
        const bool uses_river = fixed < river_last;
        spec.spans = depth_spans(fixed, req.tail, hp_.n_layer);
        spec.river_embd = fixed < 0 && uses_river && river_->tok_embd && req.river_head;
        spec.head = req.embeddings ? Head::Norm : uses_river ? exit_head : Head::Backbone;
        run(spec, tokens, &out);
        note_exit(uses_river ? fixed : last);
        return;
    }

    // The whole backbone in one graph, an exit node after every layer. An exit node that sees
    // s > tau copies h aside and stops the graph; the river graph then finishes the depth.
    exit_ = ExitState{};
    exit_.may_exit = req.mode == ExitMode::River;
    exit_.threshold = req.threshold;
    exit_.record_first = exit_.may_exit ? req.min_exit_layer : 0;
    exit_.record_last = req.trace ? last : last - 1;
    exit_.exit_first = req.min_exit_layer;
    exit_.exit_last = river_last - 1;  // the river needs at least one layer
    exit_.similarity = &out.similarity;
    spec.spans = {{0, last, false}};
    spec.exits = true;
    spec.head = Head::Backbone;
    if (run(spec, tokens, &out)) {
        note_exit(last);
        return;
    }
    const int k = exit_.exit_layer;
    GraphSpec rest = spec;
    rest.from_tokens = false;
    rest.exits = false;
    rest.spans = {{k + 1, river_last, true}};
    if (req.tail > 0) rest.spans.push_back({river_last + 1, last, false});
    rest.head = exit_head;
    run(rest, nullptr, &out);
    note_exit(k);
}

bool Engine::run(const GraphSpec& spec, const int32_t* tokens, EvalResult* out) {
    Graph& g = graph_for(spec);
    const int n = spec.n;

    std::vector<int32_t> pos(n);
    std::vector<int64_t> rows(n);
    for (int i = 0; i < n; ++i) pos[i] = rows[i] = n_past_ + i;
    ggml_backend_tensor_set(g.in.positions, pos.data(), 0, sizeof(int32_t) * n);
    ggml_backend_tensor_set(g.in.kv_rows, rows.data(), 0, sizeof(int64_t) * n);
    if (g.in.v_idxs) {
        // Transposed V cache [n_ctx, n_embd_v_gqa]: dim j of token i goes to element j*n_ctx + row.
        const int64_t nv = hp_.n_embd_v_gqa(), n_ctx = cache_->n_ctx();
        std::vector<int64_t> idx(size_t(nv) * n);
        for (int i = 0; i < n; ++i)
            for (int64_t j = 0; j < nv; ++j) idx[size_t(i) * nv + j] = j * n_ctx + rows[i];
        ggml_backend_tensor_set(g.in.v_idxs, idx.data(), 0, idx.size() * sizeof(int64_t));
    }
    if (g.tok_in) ggml_backend_tensor_set(g.tok_in, tokens, 0, sizeof(int32_t) * n);
    if (g.in.attn_temp) {
        // llama.cpp's llm_graph_input_attn_temp, in its types: a float position over an unsigned
        // floor, the logarithm in double.
        const uint32_t floor_scale = static_cast<uint32_t>(hp_.attn_temp_floor);
        std::vector<float> temp(n);
        for (int i = 0; i < n; ++i) {
            const float p = static_cast<float>(pos[i]);
            temp[i] = static_cast<float>(std::log(std::floor(p / floor_scale) + 1.0) * hp_.attn_temp_scale + 1.0);
        }
        ggml_backend_tensor_set(g.in.attn_temp, temp.data(), 0, sizeof(float) * n);
    }
    // Causal mask: token i (at position n_past+i) sees positions 0..n_past+i; padding is masked.
    // F16 for flash attention, F32 without, as llama.cpp (0 and -inf either way).
    const int n_kv = spec.n_kv;
    auto set_mask = [&](ggml_tensor* t, auto visible) {
        if (!t) return;
        if (t->type == GGML_TYPE_F32) {
            std::vector<float> mask(size_t(n_kv) * n);
            for (int i = 0; i < n; ++i)
                for (int j = 0; j < n_kv; ++j) mask[size_t(i) * n_kv + j] = visible(n_past_ + i, j) ? 0.0f : -INFINITY;
            ggml_backend_tensor_set(t, mask.data(), 0, mask.size() * sizeof(float));
        } else {
            const ggml_fp16_t zero = ggml_fp32_to_fp16(0.0f), neg_inf = ggml_fp32_to_fp16(-INFINITY);
            std::vector<ggml_fp16_t> mask(size_t(n_kv) * n);
            for (int i = 0; i < n; ++i)
                for (int j = 0; j < n_kv; ++j) mask[size_t(i) * n_kv + j] = visible(n_past_ + i, j) ? zero : neg_inf;
            ggml_backend_tensor_set(t, mask.data(), 0, mask.size() * sizeof(ggml_fp16_t));
        }
    };
    set_mask(g.in.kq_mask, [](int p, int j) { return j <= p; });
    // Sliding window: token i sees only the last n_swa positions up to its own, p - j < n_swa
    // (llama.cpp's standard window). Rows outside it stay in the cache, masked.
    set_mask(g.in.kq_mask_swa, [this](int p, int j) { return j <= p && p - j < hp_.n_swa; });

    abort_ = false;
    ggml_status status;
    if (g.galloc) {
        status = ggml_backend_graph_compute(cpu_.get(), g.gf);
        last_splits_ = 1;
    } else {
        ggml_backend_sched_t sched = g.sched ? g.sched.get() : sched_.get();
        const bool watch = spec.exits && exits_on_graph_;
        if (watch) {
            running_ = &g;
            ggml_backend_sched_set_eval_callback(sched, &Engine::exit_eval, this);
        } else if (observer_) {
            ggml_backend_sched_set_eval_callback(sched, observer_, observer_data_);
        }
        status = ggml_backend_sched_graph_compute(sched, g.gf);
        last_splits_ = ggml_backend_sched_get_n_splits(sched);
        if (watch || observer_) ggml_backend_sched_set_eval_callback(sched, nullptr, nullptr);
        running_ = nullptr;
    }
    if (abort_) {
        abort_ = false;
        return false;  // an exit node stopped the backbone; the river graph takes over from h_state_
    }
    if (status != GGML_STATUS_SUCCESS) throw std::runtime_error("ggml graph compute failed");

    if (g.logits && out) {
        const int n_rows = static_cast<int>(g.logits->ne[1]);
        out->n_cols = static_cast<int>(g.logits->ne[0]);  // n_vocab, or n_embd for embeddings
        const size_t count = size_t(n_rows) * out->n_cols;
        if (spec.all_logits) {
            const size_t old = out->logits.size();
            out->logits.resize(old + count);
            ggml_backend_tensor_get(g.logits, out->logits.data() + old, 0, count * sizeof(float));
            out->n_rows += n_rows;
        } else {
            out->logits.resize(count);
            ggml_backend_tensor_get(g.logits, out->logits.data(), 0, count * sizeof(float));
            out->n_rows = n_rows;
        }
    }
    return true;
}

Engine::Graph& Engine::graph_for(const GraphSpec& spec) {
    // Kept: single-token graphs, on every placement (position-independent: a step sets its
    // inputs and runs the same graph, so a GPU backend can replay it, e.g. as a CUDA graph). A
    // dynamic step alternates between the backbone graph and a river graph per exit depth, so one
    // reused graph would be rebuilt at every exit. On a CPU-only engine a kept graph owns its
    // compute buffer; with offloaded layers, or graph exit decisions (the scheduler's eval
    // callback), it owns a scheduler, whose buffers hold one token's activations.
    const bool keep = graph_reuse_ && spec.n == 1 && !observer_;
    if (!keep) {
        // The scheduler's allocation stays with the last graph built for it: a step of the same
        // spec sets its inputs and runs that graph again (llama.cpp's can_reuse), so decoding
        // with offloaded layers does not rebuild and re-plan every step.
        if (graph_reuse_ && transient_ && transient_->spec == spec && !observer_) return *transient_;
        transient_.reset();
        transient_ = build(spec, false);
        return *transient_;
    }
    for (size_t i = 0; i < graphs_.size(); ++i) {
        if (graphs_[i]->spec == spec) {
            std::rotate(graphs_.begin() + i, graphs_.begin() + i + 1, graphs_.end());  // most recent last
            return *graphs_.back();
        }
    }
    // Enough for every exit depth of a few settings; the oldest graph goes first.
    const size_t max_kept = 2 * size_t(hp_.n_layer) + 8;
    if (graphs_.size() >= max_kept) graphs_.erase(graphs_.begin());
    graphs_.push_back(build(spec, true));
    return *graphs_.back();
}

std::unique_ptr<Engine::Graph> Engine::build(const GraphSpec& spec, bool keep) {
    ++graphs_built_;
    auto g = std::make_unique<Graph>();
    g->spec = spec;
    // Sized to this graph's layers (a decoder layer is about 40 nodes; 64 leaves room), so that
    // kept graphs carry no more metadata than they use.
    size_t n_layers = 0;
    for (const Span& s : spec.spans) n_layers += size_t(s.last - s.first + 1);
    const size_t n_graph = std::min(graph_size(hp_), 64 * n_layers + 128);
    g->meta.resize(ggml_tensor_overhead() * n_graph + ggml_graph_overhead_custom(n_graph, false));
    ggml_init_params params{g->meta.size(), g->meta.data(), /*no_alloc=*/true};
    g->ctx = ggml_init(params);
    ggml_context* ctx = g->ctx;
    ggml_cgraph* gf = ggml_new_graph_custom(ctx, n_graph, false);
    g->gf = gf;
    const int n = spec.n;

    BatchInputs& in = g->in;
    in.n_tokens = n;
    in.n_kv = spec.n_kv;
    in.positions = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n);
    ggml_set_input(in.positions);
    in.kv_rows = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, n);
    ggml_set_input(in.kv_rows);
    in.flash_attn = flash_attn_;
    in.last_row_only = spec.head != Head::None && !spec.all_logits && n > 1;
    if (!flash_attn_ && !spec.spans.empty()) {
        in.v_idxs = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, hp_.n_embd_v_gqa() * n);
        ggml_set_input(in.v_idxs);
    }
    const ggml_type mask_type = flash_attn_ ? GGML_TYPE_F16 : GGML_TYPE_F32;
    // Each mask only where a layer of this graph reads it: an input no node uses gets no memory
    // in the graph's allocation (a river graph may run only sliding-window layers, or none).
    bool runs_global = false, runs_swa = false;
    for (const Span& s : spec.spans) {
        for (int il = s.first; il <= s.last; ++il) (hp_.is_swa(il) ? runs_swa : runs_global) = true;
    }
    if (runs_global) {
        in.kq_mask = ggml_new_tensor_2d(ctx, mask_type, spec.n_kv, n);
        ggml_set_input(in.kq_mask);
    }
    if (runs_swa) {
        in.kq_mask_swa = ggml_new_tensor_2d(ctx, mask_type, spec.n_kv, n);
        ggml_set_input(in.kq_mask_swa);
    }
    if (hp_.attn_temp_scale != 0.0f && !spec.spans.empty()) {
        in.attn_temp = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, 1, 1, n);
        ggml_set_input(in.attn_temp);
    }

    ggml_tensor* h;
    if (spec.from_tokens) {
        g->tok_in = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n);
        ggml_set_input(g->tok_in);
        h = build_embedding(ctx, hp_, spec.river_embd ? river_->tok_embd : backbone_.tok_embd, g->tok_in);
    } else {
        h = ggml_view_2d(ctx, h_state_, hp_.n_embd, n, h_state_->nb[1], 0);
    }

    if (spec.exits) g->exit_nodes.reserve(hp_.n_layer);
    for (const Span& s : spec.spans) {
        for (int il = s.first; il <= s.last; ++il) {
            const LayerWeights& w = !s.river                 ? backbone_.layers[il]
                                    : spec.backbone_attention ? river_mixed_[il]
                                                              : river_->layers[il];
            ggml_tensor* h_in = h;
            h = build_decoder_layer(ctx, gf, hp_, w, rope_factors_, *cache_, il, in, h);
            // The last layer may keep only the last row (BatchInputs::last_row_only): its test
            // compares that row.
            if (h->ne[1] < h_in->ne[1]) h_in = ggml_view_2d(ctx, h_in, hp_.n_embd, h->ne[1], h_in->nb[1], h_in->nb[1] * (n - h->ne[1]));
            if (spec.exits && exits_on_graph_) {
                // cos(h_in, h_out) per token, on the layer's device: sum(a*b) / sqrt(sum(a^2) sum(b^2)).
                ggml_tensor* dot = ggml_sum_rows(ctx, ggml_mul(ctx, h_in, h));
                ggml_tensor* norms = ggml_mul(ctx, ggml_sum_rows(ctx, ggml_sqr(ctx, h_in)), ggml_sum_rows(ctx, ggml_sqr(ctx, h)));
                ggml_tensor* s = ggml_div(ctx, dot, ggml_sqrt(ctx, norms));
                ggml_format_name(s, "exit.%d", il);
                ggml_set_output(s);
                ggml_build_forward_expand(gf, s);
                g->exit_nodes.push_back({this, il, s, h});
            } else if (spec.exits) {
                g->exit_nodes.push_back({this, il});
                ggml_tensor* args[2] = {h_in, h};
                ggml_tensor* decision = ggml_custom_4d(ctx, GGML_TYPE_F32, 1, n, 1, 1, args, 2, &Engine::exit_node_op,
                                                       1, &g->exit_nodes.back());
                ggml_format_name(decision, "exit.%d", il);
                ggml_build_forward_expand(gf, decision);
            }
        }
    }

    if (spec.head != Head::None) {
        // The last layer kept its last row alone (last_row_only); a graph without it keeps every row.
        if (!spec.all_logits && h->ne[1] > 1) h = ggml_view_2d(ctx, h, hp_.n_embd, 1, h->nb[1], h->nb[1] * (h->ne[1] - 1));
        // A draft's head runs the draft vocabulary's rows where that head has them.
        ggml_tensor* w = spec.head == Head::River ? river_->head : backbone_.output;
        ggml_tensor* rows = spec.head == Head::River ? river_->draft_head : backbone_.draft_output;
        if (spec.draft_vocab && rows) w = rows;
        g->logits = spec.head == Head::Norm ? build_final_norm(ctx, hp_, backbone_.output_norm, h)
                                            : build_head(ctx, hp_, backbone_.output_norm, w, h);
        ggml_set_output(g->logits);
        ggml_build_forward_expand(gf, g->logits);
    }

    // A kept graph owns its compute buffer (or scheduler), so switching between kept graphs
    // needs no re-planning (see graph_for).
    if (keep && placement_.local() && !(spec.exits && exits_on_graph_)) {
        g->galloc = ggml_gallocr_new(ggml_backend_get_default_buffer_type(cpu_.get()));
        if (!g->galloc || !ggml_gallocr_alloc_graph(g->galloc, gf)) {
            throw std::runtime_error("cannot allocate the compute graph");
        }
        return g;
    }
    ggml_backend_sched_t sched = sched_.get();
    if (keep) {
        g->sched.reset(ggml_backend_sched_new(backends_.data(), nullptr, static_cast<int>(backends_.size()), n_graph,
                                              false, true));
        if (!g->sched) throw std::runtime_error("cannot create the ggml scheduler");
        sched = g->sched.get();
    } else {
        ggml_backend_sched_reset(sched);
    }
    // CPU exit decisions run here: they read h through the CPU, and stop the CPU backend. (An
    // RPC device claims to support every op, a custom op included.)
    for (int i = 0; i < ggml_graph_n_nodes(gf); ++i) {
        ggml_tensor* node = ggml_graph_node(gf, i);
        if (node->op == GGML_OP_CUSTOM) ggml_backend_sched_set_tensor_backend(sched, node, cpu_.get());
    }
    if (!ggml_backend_sched_alloc_graph(sched, gf)) throw std::runtime_error("cannot allocate the compute graph");
    return g;
}

// Called by the CPU backend while a graph with exit nodes runs.
void Engine::exit_node_op(ggml_tensor* dst, int ith, int nth, void* user) {
    if (ith != 0) return;  // one thread decides; the others wait at the node's barrier
    const ExitNode& node = *static_cast<ExitNode*>(user);
    Engine& e = *node.engine;
    const ggml_tensor* h_in = dst->src[0];
    const ggml_tensor* h_out = dst->src[1];
    const int64_t d = h_out->ne[0], n = h_out->ne[1];
    for (int64_t i = 0; i < n; ++i) {
        const float* a = reinterpret_cast<const float*>(static_cast<const char*>(h_in->data) + i * h_in->nb[1]);
        const float* b = reinterpret_cast<const float*>(static_cast<const char*>(h_out->data) + i * h_out->nb[1]);
        double dot = 0, na = 0, nb = 0;
        for (int64_t j = 0; j < d; ++j) {
            dot += double(a[j]) * b[j];
            na += double(a[j]) * a[j];
            nb += double(b[j]) * b[j];
        }
        static_cast<float*>(dst->data)[i] = static_cast<float>(dot / std::sqrt(na * nb));
    }
    e.decide_exit(node.layer, static_cast<const float*>(dst->data), n, dst->src[1]);
}

bool Engine::decide_exit(int layer, const float* s, int64_t n, ggml_tensor* h_out) {
    ExitState& st = exit_;
    float s_min = INFINITY;
    for (int64_t i = 0; i < n; ++i) s_min = std::min(s_min, s[i]);  // the batch exits together: the minimum decides
    if (st.records(layer)) st.similarity->push_back(s_min);
    if (!(st.exit_allowed(layer) && s_min > st.threshold)) return false;
    // The river graph starts from this layer's output, read from whichever device holds it into
    // h_state_ (host memory).
    const size_t row = sizeof(float) * h_out->ne[0];
    for (int64_t i = 0; i < n; ++i) {
        ggml_backend_tensor_get(h_out, static_cast<char*>(h_state_->data) + i * h_state_->nb[1], i * h_out->nb[1], row);
    }
    st.exit_layer = layer;
    abort_ = true;
    return true;
}

bool Engine::exit_eval(ggml_tensor* t, bool ask, void* user) {
    Engine& e = *static_cast<Engine*>(user);
    // After an exit the scheduler still walks the graph's later splits: each computes one node
    // (ask -> true) and stops there (-> false). The CPU backend stops at once (abort_).
    if (e.abort_) return ask;
    const ExitState& st = e.exit_;
    for (const ExitNode& node : e.running_->exit_nodes) {
        if (node.similarity != t) continue;
        if (ask) return st.records(node.layer) || st.exit_allowed(node.layer);
        const int64_t n = t->ne[1];
        std::vector<float> s(n);
        ggml_backend_tensor_get(t, s.data(), 0, sizeof(float) * n);
        return !e.decide_exit(node.layer, s.data(), n, node.h_out);
    }
    return ask ? false : true;
}

bool Engine::abort_requested(void* engine) { return static_cast<Engine*>(engine)->abort_; }

}  // namespace river
