#include "engine.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <utility>

#include "engine_graph.h"
#include "errors.h"

// A step, in call order: eval (eval_on, where a draft step enters too), eval_chunk, run. The load
// is in engine_load.cpp, the graphs' building in engine_graph.cpp, the exit decision inside a
// running graph in engine_exit.cpp, and lossless decoding's draft in engine_draft.cpp.

namespace river {

void Engine::check_links() {
    if (!broken_.empty()) throw RpcError(broken_);
    for (const auto& link : links_) {
        if (link->failed()) {
            broken_ = link->failure() + "; this model cannot go on: close it and load it again";
            throw RpcError(broken_);
        }
    }
}

void Engine::truncate(int n, int seq) {
    if (seq < 0) throw std::invalid_argument("sequence id must be >= 0");
    if (n < 0 || n > cells_.length(seq)) throw std::invalid_argument("truncate position out of range");
    cells_.remove_tail(seq, n);
}

Engine::BatchCells Engine::place(const int32_t* seq_ids, int n, int seq) {
    BatchCells c;
    if (seq_ids) c.seq.assign(seq_ids, seq_ids + n);
    else c.seq.assign(n, seq);
    c.pos.resize(n);
    c.rows.resize(n);
    c.end_before = cells_.used_end();
    cells_.place(c.seq.data(), n, c.pos.data(), c.rows.data());
    return c;
}

int Engine::attended_rows(int n) const {
    // A token, or a short batch (a lossless verify batch, a step of several sequences), attends
    // over a padded n_kv (masked beyond each token's position and outside its sequence), as
    // llama.cpp does (its get_n_kv), so its graph stays the same for 256 rows: a decode step's,
    // and a verify batch's from one round to the next (graph_for keeps the last one built).
    // Without flash attention every row spanned enters the KQ softmax and the V product, whose
    // SIMD sums group the terms by the length: every batch gets llama.cpp's padded n_kv. With it,
    // a longer batch attends over exactly the rows in use: ggml's CPU kernel skips masked rows one
    // query row at a time, but its tiled kernel for batches of 64 rows and more reads whole V
    // tiles, masked rows too, where the cache's NaN poison (KvCache::poison, which makes a hole
    // read show) would spread. The rows are placed before this is asked (used_end counts them).
    constexpr int kPaddedBatch = 32;
    const int end = cells_.used_end();
    return n <= kPaddedBatch || !flash_attn_ ? padded_rows(end) : end;
}

int Engine::padded_rows(int end) const { return std::min(cache_->n_ctx(), std::max(256, (end + 255) / 256 * 256)); }

EvalResult Engine::eval(const EvalRequest& req) { return eval_on(req, 0); }

EvalResult Engine::eval_on(const EvalRequest& req, int seq) {
    check_links();
    check_request(req);
    // Every token evaluated may be drafted later.
    note_draft_context(req.tokens.data(), static_cast<int>(req.tokens.size()));
    EvalResult out;
    out.exit_layer = hp_.n_layer - 1;
    const int n = static_cast<int>(req.tokens.size());
    // With sequences and without all_logits, the head runs the rows of each sequence's last token
    // (anywhere in the request): is_last marks them, row_token says which token each row is.
    const bool last_rows = !req.seq_ids.empty() && !(req.all_logits || req.embeddings);
    std::vector<char> is_last(last_rows ? n : 0);
    if (last_rows) {
        std::map<int32_t, int> last;
        for (int i = 0; i < n; ++i) last[req.seq_ids[i]] = i;
        for (const auto& [s, i] : last) is_last[i] = 1;
    }
    std::vector<size_t> row_token;
    for (int start = 0; start < n; start += n_batch_) {
        const int len = std::min(n_batch_, n - start);
        const int32_t* ids = req.seq_ids.empty() ? nullptr : req.seq_ids.data() + start;
        // A chunk that fails leaves no rows behind: each of its sequences goes back to its length.
        std::map<int, int> before;
        for (int i = 0; i < len; ++i) before.emplace(ids ? ids[i] : seq, cells_.length(ids ? ids[i] : seq));
        BatchCells cells = place(ids, len, seq);
        if (last_rows) {
            for (int i = 0; i < len; ++i) if (is_last[start + i]) cells.out.push_back(i);
            if (cells.out.empty()) cells.out.push_back(len - 1);  // a row the result drops
            for (int32_t i : cells.out) row_token.push_back(size_t(start + i));
        }
        try {
            eval_chunk(req.tokens.data() + start, cells, req, out);
        } catch (const RpcError&) {
            for (const auto& [s, length] : before) cells_.remove_tail(s, length);
            throw;
        } catch (...) {
            for (const auto& [s, length] : before) cells_.remove_tail(s, length);
            check_links();  // a step that failed because a server did reports the server
            throw;
        }
    }
    // After a server failed, the step read placeholders (rpc_link.h): never return them.
    check_links();
    if (last_rows) keep_last_rows(req.seq_ids, row_token, out);
    return out;
}

void Engine::keep_last_rows(const std::vector<int32_t>& seq_ids, const std::vector<size_t>& row_token,
                            EvalResult& out) {
    std::vector<int32_t> order;  // the sequences in order of first appearance
    std::map<int32_t, size_t> last;
    for (size_t i = 0; i < seq_ids.size(); ++i) {
        if (!last.count(seq_ids[i])) order.push_back(seq_ids[i]);
        last[seq_ids[i]] = i;
    }
    std::map<size_t, size_t> row_of;  // token -> its row
    for (size_t r = 0; r < row_token.size(); ++r) row_of[row_token[r]] = r;
    const size_t width = size_t(out.n_cols);
    std::vector<float> rows(order.size() * width);
    for (size_t k = 0; k < order.size(); ++k) {
        std::copy_n(out.logits.begin() + row_of.at(last[order[k]]) * width, width, rows.begin() + k * width);
    }
    out.logits = std::move(rows);
    out.n_rows = static_cast<int>(order.size());
}

void Engine::check_request(const EvalRequest& req) const {
    const int n = static_cast<int>(req.tokens.size());
    if (n == 0) throw std::invalid_argument("no tokens to evaluate");
    if (n > cells_.free_rows()) {
        throw ContextOverflowError("context overflow: " + std::to_string(n) + " new tokens after " +
                                   std::to_string(cells_.used()) + " cached need " +
                                   std::to_string(cells_.used() + n) + " positions, but n_ctx is " +
                                   std::to_string(cache_->n_ctx()));
    }
    if (!req.seq_ids.empty()) {
        if (req.seq_ids.size() != req.tokens.size()) {
            throw std::invalid_argument("seq_ids must give one sequence id per token: " +
                                        std::to_string(req.seq_ids.size()) + " ids for " + std::to_string(n) +
                                        " tokens");
        }
        for (int32_t s : req.seq_ids) {
            if (s < 0) throw std::invalid_argument("sequence id " + std::to_string(s) + " is negative");
        }
        if (req.first_row != 0 || req.draft_vocab) {
            throw std::invalid_argument("seq_ids: first_row and draft_vocab apply to the default sequence alone");
        }
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
    if (req.draft_vocab && (!draft_rows_ || req.all_logits || req.embeddings || req.trace)) {
        throw std::invalid_argument("draft_vocab: one row of draft logits, from an engine with a draft vocabulary");
    }
    if (req.river_head && needs_river && !river_->head) {
        throw std::invalid_argument("river_head=True but the river has no output head");
    }
    if (std::isnan(req.threshold)) throw std::invalid_argument("threshold is NaN");
    if (req.decode_kernels && !decode_kernels_exact()) {
        throw std::invalid_argument(
            "decode_kernels: this engine's batches cannot take the single-token kernels (layers off the CPU, or "
            "repacked backbone weights)");
    }
    if (req.first_row != 0 && (req.first_row < 0 || req.first_row >= n || !(req.all_logits || req.embeddings) ||
                               n > n_batch_ || req.trace)) {
        throw std::invalid_argument("first_row needs all_logits and one batch of more than first_row tokens (and no "
                                    "trace)");
    }
    exit_rule(req.rule);  // throws for a code that names no rule
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

void Engine::eval_chunk(const int32_t* tokens, const BatchCells& cells, const EvalRequest& req, EvalResult& out) {
    const int n = static_cast<int>(cells.rows.size());
    const int last = hp_.n_layer - 1;
    const int river_last = last - req.tail;  // the river's last layer; the tail follows it
    const Head exit_head = req.river_head ? Head::River : Head::Backbone;
    auto note_exit = [&](int l) { out.exit_layer = std::min(out.exit_layer, l); };

    GraphSpec spec;
    spec.n = n;
    spec.n_kv = attended_rows(n);
    spec.all_logits = req.all_logits || req.embeddings;
    spec.n_out = static_cast<int>(cells.out.size());
    spec.first_row = spec.all_logits ? req.first_row : 0;
    spec.every_row = req.trace;  // the trace holds every row's score at every layer, whatever rows the head runs
    spec.backbone_attention = req.backbone_attention;
    spec.draft_vocab = req.draft_vocab;
    if (req.decode_kernels && n > 1) {
        // Row i attends as a decode step would that placed rows 0..i of this batch alone.
        spec.decode_kernels = true;
        int end = cells.end_before;
        for (int i = 0; i < n; ++i) {
            end = std::max(end, static_cast<int>(cells.rows[i]) + 1);
            spec.row_n_kv.push_back(padded_rows(end));
        }
        spec.n_kv = std::max(spec.n_kv, *std::max_element(spec.row_n_kv.begin(), spec.row_n_kv.end()));
    }

    int fixed = -2;  // fixed exit depth, when the whole depth is known before running
    if (req.mode == ExitMode::Backbone && !req.trace) fixed = last;
    if (req.mode == ExitMode::RiverOnly) fixed = -1;
    if (req.mode == ExitMode::Fixed) fixed = req.exit_layer;
    // No exit can happen: the whole backbone in one graph.
    const ExitRule& rule = exit_rule(req.rule);
    if (req.mode == ExitMode::River && !req.trace && (req.min_exit_layer >= river_last || req.threshold > rule.max_score)) {
        fixed = last;
    }
    if (fixed != -2) {
        const bool uses_river = fixed < river_last;
        spec.spans = depth_spans(fixed, req.tail, hp_.n_layer);
        spec.river_embd = fixed < 0 && uses_river && river_->tok_embd && req.river_head;
        spec.head = req.embeddings ? Head::Norm : uses_river ? exit_head : Head::Backbone;
        run(spec, tokens, cells, &out);
        note_exit(uses_river ? fixed : last);
        return;
    }

    // The whole backbone in one graph, an exit node after every layer. An exit node whose batch
    // passes the rule copies h aside and stops the graph; the river graph then finishes the depth.
    exit_ = ExitState{};
    exit_.may_exit = req.mode == ExitMode::River;
    exit_.rule = &rule;
    exit_.threshold = req.threshold;
    exit_.record_first = exit_.may_exit ? req.min_exit_layer : 0;
    exit_.record_last = req.trace ? last : last - 1;
    exit_.record_rows = req.trace;
    exit_.exit_first = req.min_exit_layer;
    exit_.exit_last = river_last - 1;  // the river needs at least one layer
    exit_.similarity = &out.similarity;
    spec.spans = {{0, last, false}};
    spec.exits = true;
    spec.rule = req.rule;
    spec.head = Head::Backbone;
    if (run(spec, tokens, cells, &out)) {
        note_exit(last);
        return;
    }
    const int k = exit_.exit_layer;
    GraphSpec rest = spec;
    rest.from_tokens = false;
    rest.exits = false;
    rest.rule = 0;
    rest.spans = {{k + 1, river_last, true}};
    if (req.tail > 0) rest.spans.push_back({river_last + 1, last, false});
    rest.head = exit_head;
    run(rest, nullptr, cells, &out);
    note_exit(k);
}

std::vector<std::vector<float>> Engine::river_tails(const std::vector<int32_t>& tokens, const std::vector<int>& tails,
                                                   bool backbone_attention, bool river_head, int first_row,
                                                   const TrunkState* start_state, std::vector<TrunkState>* kept) {
    check_links();
    const int n = static_cast<int>(tokens.size()), last = hp_.n_layer - 1;
    if (n < 1 || n > n_batch_) {
        throw std::invalid_argument("river_tails takes 1 to n_batch (" + std::to_string(n_batch_) + ") tokens, got " +
                                    std::to_string(n));
    }
    if (first_row < 0 || first_row >= n) {
        throw std::invalid_argument("first_row must be in [0, " + std::to_string(n - 1) + "]");
    }
    if (tails.empty()) throw std::invalid_argument("river_tails needs at least one tail");
    EvalRequest req;  // the checks of the same request to eval
    req.tokens = tokens;
    req.mode = ExitMode::RiverOnly;
    req.all_logits = true;
    req.backbone_attention = backbone_attention;
    req.river_head = river_head;
    for (int t : tails) {
        req.tail = t;
        check_request(req);
    }
    note_draft_context(tokens.data(), n);
    std::vector<int> order(tails.begin(), tails.end());
    std::sort(order.begin(), order.end(), std::greater<int>());  // the earliest branch first
    order.erase(std::unique(order.begin(), order.end()), order.end());
    if (start_state) {
        if (start_state->layer < 1 || start_state->layer > last - order.front() + 1) {
            throw std::invalid_argument("start: a hidden state entering river layer 1.." +
                                        std::to_string(last - order.front() + 1) + " (the earliest branch's next), got " +
                                        std::to_string(start_state->layer));
        }
        if (start_state->rows.size() != size_t(n) * hp_.n_embd) {
            throw std::invalid_argument("start: " + std::to_string(n) + " rows of " + std::to_string(hp_.n_embd) +
                                        " floats, got " + std::to_string(start_state->rows.size()) + " floats");
        }
    }
    std::map<int, std::vector<float>> by_tail;
    // The rows written are forgotten again at the end (the default sequence keeps its length).
    const int start = n_past();
    const BatchCells cells = place(nullptr, n);
    GraphSpec spec;
    spec.n = n;
    spec.n_kv = attended_rows(n);  // as eval_chunk: the same attention kernels as eval
    spec.backbone_attention = backbone_attention;
    spec.river_embd = river_->tok_embd && river_head;
    spec.first_row = first_row;
    const Head head = river_head ? Head::River : Head::Backbone;
    int next = 0;  // the first river layer not yet run
    // h_state_ is one contiguous F32 block of n_batch rows (make_state): n rows copy in one go.
    const size_t state_floats = size_t(n) * hp_.n_embd;
    float* state = static_cast<float*>(h_state_->data);
    if (start_state) {
        next = start_state->layer;
        std::copy_n(start_state->rows.data(), state_floats, state);
    }
    try {
        for (int t : order) {
            const int branch = last - t;  // the river's last layer with this tail
            EvalResult out;
            GraphSpec trunk = spec, rest = spec;
            trunk.spans = {{next, branch, true}};
            trunk.head = t > 0 ? Head::None : head;
            trunk.all_logits = t == 0;
            trunk.from_tokens = next == 0;
            // A start at this branch's next layer leaves the trunk nothing to run: h_state_ holds it.
            if (next <= branch || t == 0) run(trunk, tokens.data(), cells, t > 0 ? nullptr : &out);
            next = branch + 1;
            if (t > 0 && kept) kept->push_back({next, std::vector<float>(state, state + state_floats)});
            if (t > 0) {
                rest.from_tokens = false;
                rest.spans = {{branch + 1, last, false}};
                rest.head = head;
                rest.all_logits = true;
                run(rest, nullptr, cells, &out);
            }
            by_tail[t] = std::move(out.logits);
        }
    } catch (const RpcError&) {
        cells_.remove_tail(0, start);
        throw;
    } catch (...) {
        cells_.remove_tail(0, start);
        check_links();
        throw;
    }
    cells_.remove_tail(0, start);
    check_links();
    // Each tail's rows move out (a family's rows are large: tails x rows x vocabulary); a tail
    // asked twice gets a copy of its first answer.
    std::vector<std::vector<float>> result;
    std::map<int, size_t> first;
    for (int t : tails) {
        const auto seen = first.find(t);
        if (seen != first.end()) {
            std::vector<float> copy = result[seen->second];
            result.push_back(std::move(copy));
            continue;
        }
        first[t] = result.size();
        result.push_back(std::move(by_tail[t]));
    }
    return result;
}

bool Engine::run(const GraphSpec& spec, const int32_t* tokens, const BatchCells& cells, EvalResult* out) {
    Graph& g = graph_for(spec);
    const int n = spec.n;
    const std::vector<int32_t>& pos = cells.pos;
    const std::vector<int64_t>& rows = cells.rows;
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
    if (g.in.out_ids) ggml_backend_tensor_set(g.in.out_ids, cells.out.data(), 0, sizeof(int32_t) * cells.out.size());
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
    // Causal mask per sequence: token i sees the rows of its own sequence at positions up to its
    // own (this batch's earlier tokens included: they are placed already); free rows and padding
    // are masked. F16 for flash attention, F32 without, as llama.cpp (0 and -inf either way).
    const int n_kv = spec.n_kv;
    auto set_mask = [&](ggml_tensor* t, auto visible) {
        if (!t) return;
        if (t->type == GGML_TYPE_F32) {
            std::vector<float> mask(size_t(n_kv) * n);
            for (int i = 0; i < n; ++i)
                for (int j = 0; j < n_kv; ++j) mask[size_t(i) * n_kv + j] = visible(i, j) ? 0.0f : -INFINITY;
            ggml_backend_tensor_set(t, mask.data(), 0, mask.size() * sizeof(float));
        } else {
            const ggml_fp16_t zero = ggml_fp32_to_fp16(0.0f), neg_inf = ggml_fp32_to_fp16(-INFINITY);
            std::vector<ggml_fp16_t> mask(size_t(n_kv) * n);
            for (int i = 0; i < n; ++i)
                for (int j = 0; j < n_kv; ++j) mask[size_t(i) * n_kv + j] = visible(i, j) ? zero : neg_inf;
            ggml_backend_tensor_set(t, mask.data(), 0, mask.size() * sizeof(ggml_fp16_t));
        }
    };
    const int32_t* seq = cells.seq.data();
    set_mask(g.in.kq_mask, [&](int i, int j) { return cells_.visible(j, seq[i], pos[i]); });
    // Sliding window: token i sees only its sequence's last n_swa positions up to its own
    // (llama.cpp's standard window). Rows outside it stay in the cache, masked.
    set_mask(g.in.kq_mask_swa, [&](int i, int j) { return cells_.visible_swa(j, seq[i], pos[i], hp_.n_swa); });

    abort_ = false;
    ggml_status status;
    if (g.galloc) {
        compute_.run([&] { status = ggml_backend_graph_compute(cpu_.get(), g.gf); });
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
        compute_.run([&] { status = ggml_backend_sched_graph_compute(sched, g.gf); });
        last_splits_ = ggml_backend_sched_get_n_splits(sched);
        if (watch || observer_) ggml_backend_sched_set_eval_callback(sched, nullptr, nullptr);
        running_ = nullptr;
    }
    if (abort_) {
        abort_ = false;
        return false;  // an exit node stopped the backbone; the river graph takes over from h_state_
    }
    if (status != GGML_STATUS_SUCCESS) throw std::runtime_error("ggml graph compute failed");

    if (g.hidden) {
        const size_t row = sizeof(float) * hp_.n_embd;
        for (int i = 0; i < n; ++i) {
            ggml_backend_tensor_get(g.hidden, static_cast<char*>(h_state_->data) + i * h_state_->nb[1],
                                    i * g.hidden->nb[1], row);
        }
    }
    if (g.logits && out) {
        const int n_rows = static_cast<int>(g.logits->ne[1]);
        out->n_cols = static_cast<int>(g.logits->ne[0]);  // n_vocab, or n_embd for embeddings
        const size_t count = size_t(n_rows) * out->n_cols;
        if (spec.all_logits || spec.n_out > 0) {
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

}  // namespace river
