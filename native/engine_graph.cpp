// An engine's graphs: which spec gets a kept graph, and building one (inputs, layers, exit
// nodes, head), with its allocation.
#include "engine_graph.h"

#include <algorithm>
#include <tuple>

#include "field_count.h"

namespace river {

static_assert(field_count<Span>() == std::tuple_size_v<decltype(Span{}.key())>,
              "Span::key() must list every field of Span");

bool Engine::GraphSpec::operator==(const GraphSpec& o) const {
    static_assert(field_count<GraphSpec>() == std::tuple_size_v<decltype(GraphSpec{}.key())>,
                  "GraphSpec::key() must list every field of GraphSpec (see engine.h)");
    return key() == o.key();
}

Engine::Graph& Engine::graph_for(const GraphSpec& spec) {
    // Kept: single-token graphs, on every placement (position-independent: a step sets its
    // inputs and runs the same graph, so a GPU backend can replay it, e.g. as a CUDA graph). A
    // dynamic step alternates between the backbone graph and a river graph per exit depth, so one
    // reused graph would be rebuilt at every exit. On a CPU-only engine a kept graph owns its
    // compute buffer; with offloaded layers, or graph exit decisions (the scheduler's eval
    // callback), it owns a scheduler, whose buffers hold one token's activations.
    //
    // A batch of several sequences that returns a row per sequence (n_out > 0: a decode step of
    // several sequences, up to kKeptSequences tokens) is kept too: its dynamic steps alternate
    // between graphs in the same way.
    constexpr int kKeptSequences = 16;
    const bool keep = graph_reuse_ && (spec.n == 1 || (spec.n_out > 0 && spec.n <= kKeptSequences)) && !observer_;
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
    size_t n_graph = std::min(graph_size(hp_), 64 * n_layers + 128);
    // Decode kernels add a conversion per weight product (at most seven a layer, four nodes each:
    // contiguous copy, pad, convert, view) and an attention per row (at most fourteen nodes: its
    // views, the attention's own nodes, a concat), and the head's conversion.
    if (spec.decode_kernels) n_graph += (32 + 16 * size_t(spec.n)) * n_layers + 64;
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
    in.decode_kernels = spec.decode_kernels;
    in.row_n_kv = spec.row_n_kv;
    in.last_row_only = spec.head != Head::None && !spec.all_logits && n > 1 && spec.n_out == 0 && !spec.every_row;
    if (spec.head != Head::None && spec.n_out > 0) {
        in.out_ids = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, spec.n_out);
        ggml_set_input(in.out_ids);
    }
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
            if (h->ne[1] < h_in->ne[1]) {
                h_in = in.out_ids ? ggml_get_rows(ctx, h_in, in.out_ids)
                                  : ggml_view_2d(ctx, h_in, hp_.n_embd, h->ne[1], h_in->nb[1], h_in->nb[1] * (n - h->ne[1]));
            }
            if (spec.exits && exits_on_graph_) {
                // The rule's score per token, on the layer's device.
                ggml_tensor* s = exit_rule(spec.rule).graph_score(ctx, h_in, h);
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

    if (spec.head == Head::None && !spec.exits) {
        // A trunk shared by several continuations (Engine::river_tails): its output goes to
        // h_state_, where the next graph starts.
        g->hidden = h;
        ggml_set_output(h);
        ggml_build_forward_expand(gf, h);
    }
    if (spec.head != Head::None) {
        // The last layer kept its last row alone (last_row_only), or the rows out_ids names; a
        // graph without either keeps every row.
        if (in.out_ids && h->ne[1] != spec.n_out) h = ggml_get_rows(ctx, h, in.out_ids);
        if (!spec.all_logits && !in.out_ids && h->ne[1] > 1) h = ggml_view_2d(ctx, h, hp_.n_embd, 1, h->nb[1], h->nb[1] * (h->ne[1] - 1));
        if (spec.all_logits && spec.first_row > 0) {
            h = ggml_view_2d(ctx, h, hp_.n_embd, h->ne[1] - spec.first_row, h->nb[1], h->nb[1] * spec.first_row);
        }
        // A draft's head runs the draft vocabulary's rows where that head has them.
        ggml_tensor* w = spec.head == Head::River ? river_->head : backbone_.output;
        ggml_tensor* rows = spec.head == Head::River ? river_->draft_head : backbone_.draft_output;
        if (spec.draft_vocab && rows) w = rows;
        g->logits = spec.head == Head::Norm ? build_final_norm(ctx, hp_, backbone_.output_norm, h)
                                            : build_head(ctx, hp_, backbone_.output_norm, w, h, spec.decode_kernels);
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
    // The shared scheduler holds graphs of graph_size(hp_) tensors: a larger one (a long batch in
    // the decode kernels) gets a scheduler of its own, whose set counts its nodes and leaves.
    const bool larger = n_graph > graph_size(hp_);
    if (keep || larger) {
        g->sched.reset(ggml_backend_sched_new(backends_.data(), nullptr, static_cast<int>(backends_.size()),
                                              larger ? 2 * n_graph : n_graph, false, true));
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

}  // namespace river
