#include "engine.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "errors.h"
#include "layer_graph.h"

namespace river {

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

}  // namespace

Engine::Engine(const EngineConfig& cfg) : n_batch_(cfg.n_batch) {
    if (cfg.n_ctx <= 0) throw std::invalid_argument("n_ctx must be positive");
    if (cfg.n_threads <= 0) throw std::invalid_argument("n_threads must be positive");
    if (cfg.n_batch <= 0) throw std::invalid_argument("n_batch must be positive");

    file_ = std::make_unique<GgufFile>(cfg.path);
    hp_ = read_hparams(*file_);
    backbone_ = load_backbone(*file_, hp_);
    if (!cfg.river_path.empty()) {
        if (file_->tensor("river.blk.0.attn_q.weight")) {
            throw RiverMismatchError("'" + cfg.path + "' already holds a river; do not pass another");
        }
        river_file_ = std::make_unique<GgufFile>(cfg.river_path);
        HParams rhp = read_hparams(*river_file_);
        check_same_model(hp_, rhp, *file_, *river_file_);
        river_ = std::make_unique<RiverWeights>(load_river(*river_file_, hp_, ""));
    } else if (file_->tensor("river.blk.0.attn_q.weight")) {
        river_ = std::make_unique<RiverWeights>(load_river(*file_, hp_, "river."));
    }

    cpu_ = ggml_backend_cpu_init();
    if (!cpu_) throw std::runtime_error("cannot start the ggml CPU backend");
    ggml_backend_cpu_set_n_threads(cpu_, cfg.n_threads);
    // A persistent pool: a decode step runs several small graphs, and starting threads
    // for each would cost more than the graphs themselves.
    ggml_threadpool_params tpp = ggml_threadpool_params_default(cfg.n_threads);
    // Workers sleep between graphs rather than spin: on a small shared machine a spinning
    // worker steals the core the next graph needs (measured: 100x slower decode under load).
    // RIVER_GGML_POLL=1..100 turns polling back on for dedicated machines.
    tpp.poll = 0;
    if (const char* poll = std::getenv("RIVER_GGML_POLL")) tpp.poll = static_cast<uint32_t>(std::atoi(poll));
    threadpool_ = ggml_threadpool_new(&tpp);
    if (threadpool_) ggml_backend_cpu_set_threadpool(cpu_, threadpool_);

    // Offload the last n_gpu_layers layers (and the head once all layers are), as llama.cpp does.
    std::vector<ggml_backend_t> layer_backend(hp_.n_layer, cpu_);
    if (cfg.n_gpu_layers > 0) {
        if (ggml_backend_dev_t dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_GPU)) {
            gpu_ = ggml_backend_dev_init(dev, nullptr);
        }
    }
    const int first_gpu = gpu_ ? std::max(0, hp_.n_layer - cfg.n_gpu_layers) : hp_.n_layer;
    const bool head_on_gpu = gpu_ && cfg.n_gpu_layers > hp_.n_layer;
    // Each head gets its own slot: a tied head is placed apart from the embedding table,
    // which stays in the mapping for get_rows.
    std::vector<ggml_tensor**> heads = {&backbone_.output};
    if (river_ && river_->head) heads.push_back(&river_->head);
    if (gpu_) {
        std::vector<ggml_tensor**> slots;
        for (int il = first_gpu; il < hp_.n_layer; ++il) {
            layer_backend[il] = gpu_;
            for (auto s : layer_slots(backbone_.layers[il])) slots.push_back(s);
            if (river_) for (auto s : layer_slots(river_->layers[il])) slots.push_back(s);
        }
        if (head_on_gpu) {
            slots.push_back(&backbone_.output_norm);
            slots.insert(slots.end(), heads.begin(), heads.end());
        }
        placed_weights_.push_back(std::make_unique<DeviceWeights>());
        placed_weights_.back()->move(ggml_backend_get_default_buffer_type(gpu_), slots);
    }
    if (cfg.repack) {
        // CPU mat-mul weights go to the first extra buffer type that takes them (repacked
        // Q4_0/Q8_0/... layouts), where the CPU kernels read them faster than from the mapping.
        std::vector<ggml_tensor**> cpu_matmuls;
        for (int il = 0; il < first_gpu; ++il) {
            for (auto s : matmul_slots(backbone_.layers[il])) cpu_matmuls.push_back(s);
            if (river_) for (auto s : matmul_slots(river_->layers[il])) cpu_matmuls.push_back(s);
        }
        if (!head_on_gpu) cpu_matmuls.insert(cpu_matmuls.end(), heads.begin(), heads.end());
        ggml_backend_dev_t cpu_dev = ggml_backend_get_device(cpu_);
        for (ggml_backend_buffer_type_t buft : cpu_extra_buffer_types()) {
            std::vector<ggml_tensor**> take, rest;
            for (auto s : cpu_matmuls) (buft_supports_matmul(cpu_dev, buft, *s) ? take : rest).push_back(s);
            if (!take.empty()) {
                placed_weights_.push_back(std::make_unique<DeviceWeights>());
                placed_weights_.back()->move(buft, take);
            }
            cpu_matmuls.swap(rest);
        }
    }

    if (cfg.exit_chunk < 0) throw std::invalid_argument("exit_chunk must be >= 0");
    exit_chunk_ = cfg.exit_chunk > 0 ? cfg.exit_chunk : (gpu_ ? 1 : 8);

    std::vector<ggml_backend_t> backends;
    if (gpu_) backends.push_back(gpu_);
    backends.push_back(cpu_);
    sched_ = ggml_backend_sched_new(backends.data(), nullptr, static_cast<int>(backends.size()), graph_size(hp_),
                                    false, true);
    if (!sched_) throw std::runtime_error("cannot create the ggml scheduler");

    cache_ = std::make_unique<KvCache>(hp_, cfg.n_ctx, GGML_TYPE_F16, layer_backend);

    ggml_init_params sp{ggml_tensor_overhead() * 4, nullptr, /*no_alloc=*/true};
    state_ctx_ = ggml_init(sp);
    h_state_ = ggml_new_tensor_2d(state_ctx_, GGML_TYPE_F32, hp_.n_embd, n_batch_);
    sim_state_ = ggml_new_tensor_1d(state_ctx_, GGML_TYPE_F32, n_batch_);
    state_buf_ = ggml_backend_alloc_ctx_tensors(state_ctx_, cpu_);
    if (!state_buf_) throw std::runtime_error("out of memory for the hidden-state buffer");

    graph_meta_.resize(ggml_tensor_overhead() * graph_size(hp_) + ggml_graph_overhead_custom(graph_size(hp_), false));
}

Engine::~Engine() {
    if (sched_) ggml_backend_sched_free(sched_);
    cache_.reset();
    placed_weights_.clear();
    if (state_buf_) ggml_backend_buffer_free(state_buf_);
    if (state_ctx_) ggml_free(state_ctx_);
    if (gpu_) ggml_backend_free(gpu_);
    if (cpu_) ggml_backend_free(cpu_);
    if (threadpool_) ggml_threadpool_free(threadpool_);
}

void Engine::truncate(int n) {
    if (n < 0 || n > n_past_) throw std::invalid_argument("truncate position out of range");
    n_past_ = n;
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
    if (req.mode == ExitMode::Fixed && (req.exit_layer < -1 || req.exit_layer >= hp_.n_layer)) {
        throw std::invalid_argument("exit_layer must be in [-1, " + std::to_string(hp_.n_layer - 1) + "]");
    }
    if (req.river_head && needs_river && !river_->head) {
        throw std::invalid_argument("river_head=True but the river has no output head");
    }
    if (std::isnan(req.threshold)) throw std::invalid_argument("threshold is NaN");
    if (req.min_exit_layer < 0) throw std::invalid_argument("min_exit_layer must be >= 0");
}

EvalResult Engine::eval(const EvalRequest& req) {
    check_request(req);
    EvalResult out;
    out.exit_layer = hp_.n_layer - 1;
    const int n = static_cast<int>(req.tokens.size());
    for (int start = 0; start < n; start += n_batch_) {
        const int len = std::min(n_batch_, n - start);
        eval_chunk(req.tokens.data() + start, len, req, out);
        n_past_ += len;
    }
    return out;
}

void Engine::eval_chunk(const int32_t* tokens, int n, const EvalRequest& req, EvalResult& out) {
    const int last = hp_.n_layer - 1;
    const Head exit_head = req.river_head ? Head::River : Head::Backbone;
    auto note_exit = [&](int l) { out.exit_layer = std::min(out.exit_layer, l); };

    int fixed = -2;  // fixed exit depth, when the whole depth is known before running
    if (req.mode == ExitMode::Backbone && !req.trace) fixed = last;
    if (req.mode == ExitMode::RiverOnly) fixed = -1;
    if (req.mode == ExitMode::Fixed) fixed = req.exit_layer;
    // No exit can happen: the whole backbone in one graph. cos <= 1, so tau > 1 never passes.
    if (req.mode == ExitMode::River && !req.trace && (req.min_exit_layer >= last || req.threshold > 1.0f)) fixed = last;
    if (fixed != -2) {
        // One graph for the whole depth: backbone 0..fixed, river fixed+1..last.
        std::vector<Span> spans;
        if (fixed >= 0) spans.push_back({0, fixed, false});
        if (fixed < last) spans.push_back({fixed + 1, last, true});
        const bool river_embd = fixed < 0 && river_->tok_embd && req.river_head;
        run(tokens, n, true, river_embd, spans, fixed < last ? exit_head : Head::Backbone, req.all_logits, &out);
        note_exit(fixed);
        return;
    }

    // Backbone layers in chunks, one graph each; after every tested layer the scheduler's callback
    // hands over the exit-decision value and may cancel the rest of the graph. Short chunks keep
    // the graph an early exit abandons small; chunking at all saves most of the per-graph cost of
    // one graph per layer. With several backends (GPU offload) a cancelled graph might leave later
    // splits running, so there each chunk is one layer and the watched node is its last node.
    const bool may_exit = req.mode == ExitMode::River;
    ExitWatch w;
    w.first = may_exit ? req.min_exit_layer : 0;
    w.last = req.trace ? last : last - 1;
    w.max_exit = last - 1;
    w.may_exit = may_exit;
    w.threshold = req.threshold;
    w.similarity = &out.similarity;
    for (int start = 0; start <= last;) {
        // The first chunk also takes every layer before min_exit_layer, which cannot exit.
        const int end = std::min(last, std::max(start, w.first) + exit_chunk_ - 1);
        const Head head = end == last ? Head::Backbone : Head::None;
        run(tokens, n, start == 0, false, {{start, end, false}}, head, req.all_logits, &out, &w);
        if (w.exit_layer >= 0) {
            run(nullptr, n, false, false, {{w.exit_layer + 1, last, true}}, exit_head, req.all_logits, &out);
            note_exit(w.exit_layer);
            return;
        }
        start = end + 1;
    }
    note_exit(last);
}

bool Engine::on_node(ggml_tensor* t, bool ask, void* user) {
    // Watched nodes are named "#exit.<layer>"; a name check is cheap enough for every node.
    if (t->name[0] != '#') return !ask;
    if (ask) return true;
    auto* w = static_cast<ExitWatch*>(user);
    const int layer = std::atoi(t->name + 6);
    std::vector<float> sim(w->n);
    ggml_backend_tensor_get(w->sim_rows, sim.data(), 0, sizeof(float) * w->n);
    const float s = *std::min_element(sim.begin(), sim.end());  // the batch exits together
    w->similarity->push_back(s);
    if (w->may_exit && layer <= w->max_exit && s > w->threshold) {
        w->exit_layer = layer;
        return false;  // cancel the rest of the backbone graph
    }
    return true;
}

void Engine::run(const int32_t* tokens, int n, bool from_tokens, bool river_embd, const std::vector<Span>& spans,
                 Head head, bool all_logits, EvalResult* out, ExitWatch* watch) {
    ggml_init_params params{graph_meta_.size(), graph_meta_.data(), /*no_alloc=*/true};
    ggml_context* ctx = ggml_init(params);
    struct CtxFree { ggml_context* c; ~CtxFree() { ggml_free(c); } } ctx_guard{ctx};
    ggml_cgraph* gf = ggml_new_graph_custom(ctx, graph_size(hp_), false);

    const int n_kv = n_past_ + n;
    BatchInputs in;
    in.n_tokens = n;
    in.n_past = n_past_;
    in.positions = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n);
    ggml_set_input(in.positions);
    in.kq_mask = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, n_kv, n);
    ggml_set_input(in.kq_mask);

    ggml_tensor* tok_in = nullptr;
    ggml_tensor* h;
    if (from_tokens) {
        tok_in = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n);
        ggml_set_input(tok_in);
        h = ggml_get_rows(ctx, river_embd ? river_->tok_embd : backbone_.tok_embd, tok_in);
    } else {
        h = ggml_view_2d(ctx, h_state_, hp_.n_embd, n, h_state_->nb[1], 0);
    }

    ggml_tensor* h_in = h;
    ggml_tensor* h_rows = ggml_view_2d(ctx, h_state_, hp_.n_embd, n, h_state_->nb[1], 0);
    ggml_tensor* sim_rows = ggml_view_2d(ctx, sim_state_, 1, n, sim_state_->nb[0], 0);
    for (const Span& s : spans) {
        for (int il = s.first; il <= s.last; ++il) {
            const LayerWeights& w = s.river ? river_->layers[il] : backbone_.layers[il];
            h_in = h;
            h = build_decoder_layer(ctx, gf, hp_, w, backbone_.rope_freqs, *cache_, il, in, h);
            if (watch && il >= watch->first && il <= watch->last) {
                // Order matters, and nodes run in the order they are expanded: the similarity
                // reads h_in, which may be h_state_ itself (a chunk's input), before the copy of
                // this layer's output into h_state_ (kept for the river) overwrites it; the
                // watched node the callback observes comes last.
                ggml_tensor* sim = build_state_similarity(ctx, h_in, h);
                ggml_build_forward_expand(gf, sim);
                if (il < hp_.n_layer - 1) ggml_build_forward_expand(gf, ggml_cpy(ctx, h, h_rows));
                ggml_tensor* watched = ggml_cpy(ctx, sim, sim_rows);
                ggml_format_name(watched, "#exit.%d", il);
                ggml_build_forward_expand(gf, watched);
            }
        }
    }

    ggml_tensor* logits = nullptr;
    if (head == Head::None) {
        ggml_build_forward_expand(gf, ggml_cpy(ctx, h, h_rows));
    } else {
        if (!all_logits && n > 1) h = ggml_view_2d(ctx, h, hp_.n_embd, 1, h->nb[1], h->nb[1] * (n - 1));
        ggml_tensor* w = head == Head::River ? river_->head : backbone_.output;
        logits = build_head(ctx, hp_, backbone_.output_norm, w, h);
        ggml_set_output(logits);
        ggml_build_forward_expand(gf, logits);
    }

    ggml_backend_sched_reset(sched_);
    if (!ggml_backend_sched_alloc_graph(sched_, gf)) throw std::runtime_error("cannot allocate the compute graph");

    std::vector<int32_t> pos(n);
    for (int i = 0; i < n; ++i) pos[i] = n_past_ + i;
    ggml_backend_tensor_set(in.positions, pos.data(), 0, sizeof(int32_t) * n);
    if (tok_in) ggml_backend_tensor_set(tok_in, tokens, 0, sizeof(int32_t) * n);
    // Causal mask: token i (at position n_past+i) sees positions 0..n_past+i.
    std::vector<ggml_fp16_t> mask(size_t(n_kv) * n);
    const ggml_fp16_t zero = ggml_fp32_to_fp16(0.0f), neg_inf = ggml_fp32_to_fp16(-INFINITY);
    for (int i = 0; i < n; ++i)
        for (int j = 0; j < n_kv; ++j) mask[size_t(i) * n_kv + j] = j <= n_past_ + i ? zero : neg_inf;
    ggml_backend_tensor_set(in.kq_mask, mask.data(), 0, mask.size() * sizeof(ggml_fp16_t));

    if (watch) {
        watch->sim_rows = sim_rows;
        watch->n = n;
        ggml_backend_sched_set_eval_callback(sched_, &Engine::on_node, watch);
    }
    const ggml_status status = ggml_backend_sched_graph_compute(sched_, gf);
    if (watch) ggml_backend_sched_set_eval_callback(sched_, nullptr, nullptr);
    const bool stopped = watch && watch->exit_layer >= 0;
    if (status != GGML_STATUS_SUCCESS && !stopped) throw std::runtime_error("ggml graph compute failed");
    if (stopped) return;  // the river graph takes over from h_state_

    if (logits && out) {
        const int rows = static_cast<int>(logits->ne[1]);
        const size_t count = size_t(rows) * hp_.n_vocab;
        if (all_logits) {
            const size_t old = out->logits.size();
            out->logits.resize(old + count);
            ggml_backend_tensor_get(logits, out->logits.data() + old, 0, count * sizeof(float));
            out->n_rows += rows;
        } else {
            out->logits.resize(count);
            ggml_backend_tensor_get(logits, out->logits.data(), 0, count * sizeof(float));
            out->n_rows = rows;
        }
    }
}

}  // namespace river
