// The exit decision of a running graph: the exit node's CPU op, the scheduler's eval callback
// for exits on the graph, and the decision both make from a layer's scores (exit_rule.h).
#include <vector>

#include "engine_graph.h"

namespace river {

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
        static_cast<float*>(dst->data)[i] = e.exit_.rule->cpu_score(a, b, d);
    }
    e.decide_exit(node.layer, static_cast<const float*>(dst->data), n, dst->src[1]);
}

bool Engine::decide_exit(int layer, const float* s, int64_t n, ggml_tensor* h_out) {
    ExitState& st = exit_;
    float lowest;
    const bool leaves = batch_leaves(s, n, st.threshold, &lowest);
    if (st.records(layer)) {
        // A trace keeps every token's score (one per layer in decode); an exit test the lowest.
        if (st.record_rows) st.similarity->insert(st.similarity->end(), s, s + n);
        else st.similarity->push_back(lowest);
    }
    if (!(st.exit_allowed(layer) && leaves)) return false;
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
