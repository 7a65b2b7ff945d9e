// The engine's kept graphs: what Engine::build makes and Engine::run computes (engine_graph.cpp
// builds them, engine.cpp runs them). Private to the engine's files.
#pragma once
#include <vector>

#include "engine.h"
#include "ggml-alloc.h"
#include "layer_graph.h"

namespace river {

struct Engine::ExitNode {
    Engine* engine;
    int layer;
    ggml_tensor* similarity = nullptr;  // graph decisions: the exit rule's score per token, F32 [1, n]
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
    ggml_tensor* hidden = nullptr;     // a graph without a head: its last hidden state, kept in h_state_
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

// Nodes per decoder layer are about 40; leave room for the head and inputs.
inline size_t graph_size(const HParams& hp) { return 128 * size_t(hp.n_layer) + 512; }

}  // namespace river
