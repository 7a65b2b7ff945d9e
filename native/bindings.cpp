// The Python module: thin wrappers over Engine and Vocab. Native work runs with the GIL released.
#include <cmath>
#include <cstdlib>
#include <cstring>

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "devices.h"
#include "engine.h"
#include "errors.h"
#include "ggml.h"
#include "imatrix.h"
#include "quantize.h"
#include "rpc_link.h"
#include "vocab.h"

namespace py = pybind11;
using namespace pybind11::literals;  // "name"_a = value in py::dict
using namespace river;

namespace {

py::dict metadata(const GgufFile& f) {
    py::dict d;
    gguf_context* g = f.meta();
    for (int64_t i = 0; i < gguf_get_n_kv(g); ++i) {
        const char* key = gguf_get_key(g, i);
        switch (gguf_get_kv_type(g, i)) {
            case GGUF_TYPE_STRING: d[key] = py::str(gguf_get_val_str(g, i)); break;
            case GGUF_TYPE_FLOAT32: d[key] = gguf_get_val_f32(g, i); break;
            case GGUF_TYPE_FLOAT64: d[key] = gguf_get_val_f64(g, i); break;
            case GGUF_TYPE_BOOL: d[key] = gguf_get_val_bool(g, i); break;
            // Exact: get_int refuses values past INT64_MAX, which only hyperparameters must fit.
            case GGUF_TYPE_UINT64: d[key] = py::int_(gguf_get_val_u64(g, i)); break;
            case GGUF_TYPE_ARRAY: break;  // vocab-sized arrays; read them with the gguf package if needed
            default: d[key] = f.get_int(key, 0); break;
        }
    }
    return d;
}

py::dict hparams(const HParams& hp) {
    py::dict d;
    d["arch"] = hp.arch_name;
    d["n_layer"] = hp.n_layer;
    d["n_embd"] = hp.n_embd;
    d["n_head"] = hp.n_head;
    d["n_head_kv"] = hp.n_head_kv;
    d["n_ff"] = hp.n_ff;
    d["head_dim"] = hp.head_dim_k;
    d["n_rot"] = hp.n_rot;
    d["n_vocab"] = hp.n_vocab;
    d["n_ctx_train"] = hp.n_ctx_train;
    d["rms_eps"] = hp.rms_eps;
    d["rope_freq_base"] = hp.rope_freq_base;
    d["rope_freq_scale"] = hp.rope_freq_scale;
    d["n_swa"] = hp.n_swa;
    return d;
}

// The exit setting of an eval or draft call.
EvalRequest exit_request(int mode, float threshold, int min_exit_layer, int exit_layer, bool river_head, int tail,
                         bool backbone_attention) {
    if (!is_exit_mode(mode)) throw std::invalid_argument("bad mode");
    EvalRequest req;
    req.mode = static_cast<ExitMode>(mode);
    req.threshold = threshold;
    req.min_exit_layer = min_exit_layer;
    req.exit_layer = exit_layer;
    req.river_head = river_head;
    req.tail = tail;
    req.backbone_attention = backbone_attention;
    return req;
}

py::tuple eval(Engine& e, std::vector<int32_t> tokens, int mode, float threshold, int min_exit_layer,
               int exit_layer, bool river_head, bool all_logits, bool trace, int tail, bool backbone_attention,
               bool embeddings) {
    EvalRequest req = exit_request(mode, threshold, min_exit_layer, exit_layer, river_head, tail, backbone_attention);
    req.tokens = std::move(tokens);
    req.all_logits = all_logits;
    req.trace = trace;
    req.embeddings = embeddings;
    EvalResult res;
    {
        py::gil_scoped_release release;
        res = e.eval(req);
    }
    // Rows of logits (n_vocab wide), or of embeddings (n_embd wide).
    const int width = res.n_rows ? res.n_cols : (embeddings ? e.hparams().n_embd : e.hparams().n_vocab);
    py::array_t<float> logits({res.n_rows, width});
    std::memcpy(logits.mutable_data(), res.logits.data(), res.logits.size() * sizeof(float));
    return py::make_tuple(logits, res.exit_layer, res.similarity);
}

py::tuple draft(Engine& e, int32_t token, int n_max, float p_min, int mode, float threshold, int min_exit_layer,
                int exit_layer, bool river_head, int tail, bool backbone_attention) {
    EvalRequest how = exit_request(mode, threshold, min_exit_layer, exit_layer, river_head, tail, backbone_attention);
    std::vector<float> probs;
    std::vector<int32_t> tokens;
    {
        py::gil_scoped_release release;
        tokens = e.draft(token, std::move(how), n_max, p_min, &probs);
    }
    return py::make_tuple(tokens, probs);
}

}  // namespace

// Activation statistics, and weighted quantization (defined at the end of this file).
void bind_imatrix(py::module_& m);
void bind_quantize(py::module_& m);

PYBIND11_MODULE(_native, m) {
    m.doc() = "river_gguf native engine (ggml)";
    // ggml-vulkan reorders each split's nodes (its graph_optimize) and fuses neighbours. Graph exit
    // decisions compute a split only up to a similarity node (the scheduler's eval callback), and
    // such a partial split crashed lavapipe's heap (tests_gpu: a random qwen2 River GGUF, dynamic
    // exits across the 256-row padding boundary); with the reordering off it runs and exits as the
    // CPU op does. ggml-vulkan reads the variable at its first graph, so it is set here, before
    // any, unless the user set it. llama.cpp in the same process runs without the reordering too.
    if (!std::getenv("GGML_VK_DISABLE_GRAPH_OPTIMIZE")) {
#ifdef _WIN32
        _putenv_s("GGML_VK_DISABLE_GRAPH_OPTIMIZE", "1");
#else
        setenv("GGML_VK_DISABLE_GRAPH_OPTIMIZE", "1", 0);
#endif
    }

    static PyObject* format_error =
        py::register_exception<GgufFormatError>(m, "GGUFFormatError", PyExc_ValueError).ptr();
    static PyObject* unsupported_error =
        py::register_exception<UnsupportedModelError>(m, "UnsupportedModelError", PyExc_ValueError).ptr();
    static PyObject* mismatch_error =
        py::register_exception<RiverMismatchError>(m, "RiverMismatchError", PyExc_ValueError).ptr();
    static PyObject* overflow_error =
        py::register_exception<ContextOverflowError>(m, "ContextOverflowError", PyExc_ValueError).ptr();
    // An RPC server refused, reset, timed out or failed mid-generation (rpc_link.h).
    static PyObject* rpc_error = py::register_exception<RpcError>(m, "RpcError", PyExc_ConnectionError).ptr();
    // Messages quote names, keys and paths, whose bytes need not be UTF-8; pybind's own
    // translation would then raise UnicodeDecodeError in place of the error. Tried before it.
    py::register_exception_translator([](std::exception_ptr p) {
        auto set = [](PyObject* type, const char* what) {
            PyObject* msg = PyUnicode_DecodeUTF8(what, static_cast<Py_ssize_t>(std::strlen(what)), "replace");
            PyErr_SetObject(type, msg);
            Py_XDECREF(msg);
        };
        try {
            if (p) std::rethrow_exception(p);
        } catch (const GgufFormatError& e) {
            set(format_error, e.what());
        } catch (const UnsupportedModelError& e) {
            set(unsupported_error, e.what());
        } catch (const RiverMismatchError& e) {
            set(mismatch_error, e.what());
        } catch (const ContextOverflowError& e) {
            set(overflow_error, e.what());
        } catch (const RpcError& e) {
            set(rpc_error, e.what());
        } catch (const std::invalid_argument& e) {
            set(PyExc_ValueError, e.what());
        }
    });

    m.attr("BUILT_LLAMA_CPP_PYTHON") = RIVER_LLAMA_CPP_PYTHON_VERSION;
    m.attr("BUILT_GGML_COMMIT") = RIVER_GGML_COMMIT;
    m.def("loaded_ggml_commit", [] { return std::string(ggml_commit()); });
    m.def("loaded_ggml_version", [] { return std::string(ggml_version()); });
    m.def("supported_architectures", [] { return std::string(supported_architectures()); });
    // Engine.eval's `mode` codes by name (engine.h kExitModes); river_gguf.options reads them.
    py::dict exit_modes;
    for (const ExitModeName& e : kExitModes) exit_modes[e.name] = static_cast<int>(e.mode);
    m.attr("EXIT_MODES") = exit_modes;
    // ggml's RPC backend: compiled in (HAS_RPC), present in the loaded ggml (rpc_available).
    m.attr("HAS_RPC") = rpc_compiled();
    m.attr("RPC_PROTOCOL") = rpc_protocol_version();
    m.def("rpc_available", &rpc_available);
    m.def(
        "devices",
        [] {
            py::list out;
            for (const auto& d : list_devices()) {
                py::dict e;
                e["name"] = d.name;
                e["description"] = d.description;
                e["type"] = d.type;
                e["memory_free"] = d.memory_free;
                e["memory_total"] = d.memory_total;
                out.append(e);
            }
            return out;
        },
        "The devices ggml sees: dicts of name, description, type (CPU, GPU, IGPU, ACCEL) and free and total memory "
        "in bytes.");
    m.def(
        "offload_gpus", [] {
            std::vector<std::string> names;
            for (auto dev : offload_gpus()) names.push_back(ggml_backend_dev_name(dev));
            return names;
        },
        "The GPUs an engine offloads to, in the order main_gpu indexes: discrete first, then integrated.");
    m.def(
        "rpc_serve",
        [](const std::string& host, int port, int n_threads, const std::string& cache_dir,
           const std::vector<std::string>& devices) {
            py::gil_scoped_release release;  // it serves until the process ends
            return rpc_serve(host, port, n_threads, cache_dir, devices);
        },
        py::arg("host"), py::arg("port"), py::arg("n_threads") = 1, py::arg("cache_dir") = "",
        py::arg("devices") = std::vector<std::string>{},
        "Serve this machine's devices with ggml's RPC server (ggml_backend_rpc_start_server). Blocks while it "
        "serves; returns a message when it could not start.");

    m.def(
        "fit_gpu_layers",
        [](const std::vector<size_t>& layer_bytes, size_t head_bytes, size_t free_bytes, size_t reserve, int requested) {
            const GpuFit f = fit_gpu_layers(layer_bytes, head_bytes, free_bytes, reserve, requested);
            return py::make_tuple(f.n_layers, f.head);
        },
        py::arg("layer_bytes"), py::arg("head_bytes"), py::arg("free_bytes"), py::arg("reserve"), py::arg("requested"),
        "How much of a GPU offload fits (placement.h): (layers, head on the GPU).");
    m.def(
        "plan_gpu",
        [](const std::vector<std::tuple<size_t, size_t, size_t>>& layers, size_t head_bytes, size_t budget,
           size_t reserve, int requested) {
            std::vector<LayerBytes> lb;
            for (const auto& [backbone, river, kv] : layers) lb.push_back({backbone, river, kv});
            const GpuPlan p = plan_gpu(lb, head_bytes, budget, reserve, requested);
            auto flags = [](const std::vector<char>& v) { return std::vector<bool>(v.begin(), v.end()); };
            return py::dict("backbone"_a = flags(p.backbone), "river"_a = flags(p.river), "kv_cache"_a = flags(p.kv),
                            "head"_a = p.head, "river_first"_a = p.river_first, "bytes"_a = p.bytes);
        },
        py::arg("layers"), py::arg("head_bytes"), py::arg("budget"), py::arg("reserve"), py::arg("requested"),
        "What of each layer goes to the GPU (placement.h plan_gpu); layers are (backbone, river, kv) bytes.");

    py::class_<Engine>(m, "Engine")
        .def(py::init([](const std::string& path, const std::string& river_path, int n_ctx, int n_threads,
                         int n_batch, int n_gpu_layers, bool repack, bool graph_reuse, bool fuse, bool use_mmap,
                         std::vector<std::string> rpc_servers, int rpc_n_layers, std::vector<int> rpc_layers,
                         std::vector<float> rpc_split, int rpc_weights, double rpc_timeout, int main_gpu, bool flash_attn,
                         const std::string& exit_decision, size_t gpu_memory) {
                 EngineConfig cfg;
                 cfg.path = path;
                 cfg.river_path = river_path;
                 cfg.n_ctx = n_ctx;
                 cfg.n_threads = n_threads;
                 cfg.n_batch = n_batch;
                 cfg.n_gpu_layers = n_gpu_layers;
                 cfg.main_gpu = main_gpu;
                 cfg.gpu_memory = gpu_memory;
                 cfg.repack = repack;
                 cfg.graph_reuse = graph_reuse;
                 cfg.fuse = fuse;
                 cfg.use_mmap = use_mmap;
                 cfg.flash_attn = flash_attn;
                 if (exit_decision == "auto") cfg.exit_decision = ExitDecision::Auto;
                 else if (exit_decision == "cpu") cfg.exit_decision = ExitDecision::Cpu;
                 else if (exit_decision == "graph") cfg.exit_decision = ExitDecision::Graph;
                 else throw std::invalid_argument("exit_decision must be 'auto', 'cpu' or 'graph', got '" + exit_decision + "'");
                 cfg.rpc_servers = std::move(rpc_servers);
                 cfg.rpc_n_layers = rpc_n_layers;
                 cfg.rpc_layers = std::move(rpc_layers);
                 cfg.rpc_split = std::move(rpc_split);
                 if (rpc_weights < 0 || rpc_weights > 2) throw std::invalid_argument("rpc_weights must be 0, 1 or 2");
                 cfg.rpc_weights = rpc_weights;
                 cfg.rpc_timeout = rpc_timeout;
                 py::gil_scoped_release release;
                 return std::make_unique<Engine>(cfg);
             }),
             py::arg("path"), py::arg("river_path") = "", py::arg("n_ctx") = 2048, py::arg("n_threads") = 1,
             py::arg("n_batch") = 512, py::arg("n_gpu_layers") = 0, py::arg("repack") = true,
             py::arg("graph_reuse") = true, py::arg("fuse") = true, py::arg("use_mmap") = true,
             py::arg("rpc_servers") = std::vector<std::string>{}, py::arg("rpc_n_layers") = -1,
             py::arg("rpc_layers") = std::vector<int>{}, py::arg("rpc_split") = std::vector<float>{},
             py::arg("rpc_weights") = 0, py::arg("rpc_timeout") = 120.0, py::arg("main_gpu") = 0, py::arg("flash_attn") = true,
             py::arg("exit_decision") = "auto", py::arg("gpu_memory") = size_t(0))
        .def("eval", &eval, py::arg("tokens"), py::arg("mode") = 0, py::arg("threshold") = 2.0f,
             py::arg("min_exit_layer") = 0, py::arg("exit_layer") = -1, py::arg("river_head") = false,
             py::arg("all_logits") = false, py::arg("trace") = false, py::arg("tail") = 0,
             py::arg("backbone_attention") = false, py::arg("embeddings") = false)
        .def("draft", &draft, py::arg("token"), py::arg("n_max"), py::arg("p_min") = 0.0f, py::arg("mode") = 0,
             py::arg("threshold") = 2.0f, py::arg("min_exit_layer") = 0, py::arg("exit_layer") = -1,
             py::arg("river_head") = false, py::arg("tail") = 0, py::arg("backbone_attention") = false,
             "Lossless decoding's draft: up to n_max greedy tokens after `token` under this exit setting, each "
             "kept while its probability is >= p_min; n_past is unchanged. Returns (tokens, probabilities).")
        .def("truncate", &Engine::truncate)
        .def_property_readonly("n_past", &Engine::n_past)
        .def_property_readonly("n_ctx", &Engine::n_ctx)
        .def_property_readonly("has_river", &Engine::has_river)
        .def_property_readonly("flash_attn", &Engine::flash_attn)
        .def_property_readonly("river_has_head", &Engine::river_has_head)
        .def_property_readonly("gpu_offload", &Engine::gpu_offload)
        .def_property_readonly("gpu_layers", &Engine::gpu_layers,
                               "Layers placed on the GPU: fewer than n_gpu_layers asked when they did not fit.")
        .def_property_readonly("gpu_free", &Engine::gpu_free, "The GPU's free bytes before placing, as reported.")
        .def_property_readonly("exits_on_graph", &Engine::exits_on_graph,
                               "Whether the exit decision runs as graph ops read by the scheduler (else a CPU op).")
        .def_property_readonly("layer_devices", &Engine::layer_devices,
                               "Where each layer and its KV cache live: 'CPU', 'GPU' or an RPC server's host:port.")
        .def_property_readonly(
            "placement",
            [](const Engine& e) {
                const Placement& p = e.placement();
                return py::dict("backbone"_a = p.backbone_device, "river"_a = p.river_device,
                                "kv_cache"_a = p.layer_device, "head"_a = p.gpu && p.gpu_head ? "GPU" : "CPU",
                                "river_first"_a = p.river_first, "gpu_free"_a = p.gpu_free,
                                "gpu_budget"_a = p.gpu_budget, "gpu_bytes"_a = p.gpu_bytes,
                                "backbone_bytes"_a = p.backbone_bytes, "river_bytes"_a = p.river_bytes,
                                "kv_bytes"_a = p.kv_bytes, "head_bytes"_a = p.head_bytes);
            },
            "Where each layer's backbone, river and KV cache went ('CPU', 'GPU' or an RPC device), the head's "
            "device, and the GPU's free memory, budget and use in bytes (counted only when a GPU was asked for).")
        .def_property_readonly("kept_graphs", &Engine::kept_graphs)
        .def_property_readonly("graphs_built", &Engine::graphs_built)
        .def_property_readonly("last_splits", &Engine::last_splits,
                               "Backend splits of the last graph computed: each is a sync point whose inputs are copied "
                               "across devices (1 on a CPU-only engine).")
        .def_property_readonly("hparams", [](const Engine& e) { return hparams(e.hparams()); })
        .def_property_readonly("metadata", [](const Engine& e) { return metadata(e.file()); })
        .def("cache_rows",
             [](const Engine& e, int layer, bool values, int n) {
                 std::vector<float> rows = e.cache().read(layer, values, n);
                 const int width = static_cast<int>(rows.size() / std::max(n, 1));
                 py::array_t<float> a({n, width});
                 std::memcpy(a.mutable_data(), rows.data(), rows.size() * sizeof(float));
                 return a;
             },
             "Cache layer `layer`, rows [0, n) of K (values=False) or V, as float32 (for tests).")
        .def("cache_poison",
             [](const Engine& e, int layer) {
                 return e.cache().finite_poison(layer) ? KvCache::poison_value_no_fa() : std::nanf("");
             },
             "What an unwritten entry of layer `layer`'s cache holds: NaN, or POISON_NO_FLASH where attention "
             "spans masked rows (no flash attention, or a cache in device memory); for tests.")
        .def_property_readonly_static(
            "POISON_NO_FLASH", [](py::object) { return KvCache::poison_value_no_fa(); },
            "What an unwritten cache entry holds without flash attention (NaN with it).");

    py::class_<Vocab>(m, "Vocab")
        .def(py::init([](const std::string& path) {
                 py::gil_scoped_release release;
                 return std::make_unique<Vocab>(path);
             }),
             py::arg("path"))
        .def("tokenize", [](const Vocab& v, const std::string& text, bool add_special, bool parse_special) {
                 return v.tokenize(text, add_special, parse_special);
             },
             py::arg("text"), py::arg("add_special") = true, py::arg("parse_special") = false)
        .def("token_to_piece", [](const Vocab& v, int32_t t, bool special) { return py::bytes(v.token_to_piece(t, special)); },
             py::arg("token"), py::arg("special") = false)
        .def("detokenize", [](const Vocab& v, const std::vector<int32_t>& t, bool special) {
                 return py::bytes(v.detokenize(t, special));
             },
             py::arg("tokens"), py::arg("special") = false)
        .def_property_readonly("n_tokens", &Vocab::n_tokens)
        .def_property_readonly("bos", &Vocab::bos)
        .def_property_readonly("eos", &Vocab::eos)
        .def_property_readonly("add_bos", &Vocab::add_bos)
        .def("is_eog", &Vocab::is_eog)
        .def("chat_template", &Vocab::chat_template)
        .def("meta", &Vocab::meta);

    bind_imatrix(m);
    bind_quantize(m);
}

void bind_imatrix(py::module_& m) {
    py::class_<ActivationStats>(m, "ActivationStats",
                                "Per-weight sums of squared mat-mul inputs and row counts (llama.cpp's imatrix "
                                "statistic), filled by Engine.collect_activations.")
        .def(py::init<>())
        .def("result",
             [](const ActivationStats& s) {
                 py::dict d;
                 for (const auto& kv : s.snapshot()) {
                     py::array_t<float> sums(static_cast<py::ssize_t>(kv.second.sums.size()));
                     float* p = sums.mutable_data();
                     for (size_t j = 0; j < kv.second.sums.size(); ++j) p[j] = static_cast<float>(kv.second.sums[j]);
                     d[py::str(kv.first)] = py::make_tuple(sums, kv.second.count);
                 }
                 return d;
             },
             "dict: weight name -> (float32 per-column sums of x^2, rows seen)")
        .def("clear", &ActivationStats::clear)
        .def("__len__", &ActivationStats::size);

    // Added to the Engine class registered above (its definition stays as it is).
    auto engine = py::reinterpret_borrow<py::class_<Engine>>(m.attr("Engine"));
    engine.def(
        "collect_activations",
        [](Engine& e, std::vector<int32_t> tokens, ActivationStats& stats) {
            py::gil_scoped_release release;
            collect_activations(e, tokens, stats);
        },
        py::arg("tokens"), py::arg("stats"),
        "Run tokens through the backbone from n_past (all of them through the head too), adding the input "
        "statistics of every weight mat-mul to stats.");
}

void bind_quantize(py::module_& m) {
    m.def(
        "quantize_rows",
        [](int type, py::array data, py::object importance, int n_threads) {
            auto is_f32 = [](const py::array& a) { return a.dtype().kind() == 'f' && a.itemsize() == 4; };
            if (!is_f32(data)) throw std::invalid_argument("data must be a float32 array, got " + std::string(py::str(data.dtype())));
            if (data.ndim() != 2) throw std::invalid_argument("data must be 2-D [rows, cols], got " + std::to_string(data.ndim()) + "-D");
            if (n_threads < 1) throw std::invalid_argument("n_threads must be >= 1");
            using F32 = py::array_t<float, py::array::c_style | py::array::forcecast>;
            const F32 x = F32::ensure(data);  // contiguous, native byte order
            const int64_t nrows = x.shape(0), ncols = x.shape(1);
            F32 w;
            const float* wp = nullptr;
            if (!importance.is_none()) {
                if (!py::isinstance<py::array>(importance)) throw std::invalid_argument("importance must be a numpy array or None");
                py::array ia = importance.cast<py::array>();
                if (!is_f32(ia)) throw std::invalid_argument("importance must be a float32 array, got " + std::string(py::str(ia.dtype())));
                if (ia.ndim() != 1 || ia.shape(0) != ncols) {
                    throw std::invalid_argument("importance must be 1-D with one value per column (" + std::to_string(ncols) + ")");
                }
                w = F32::ensure(ia);
                wp = w.data();
                for (int64_t j = 0; j < ncols; ++j) {
                    if (!std::isfinite(wp[j]) || wp[j] < 0.0f) throw std::invalid_argument("importance values must be finite and >= 0");
                }
            }
            const size_t row_size = quantized_row_size(type, ncols, wp != nullptr);
            const float* xp = x.data();
            for (int64_t i = 0; i < nrows * ncols; ++i) {
                if (!std::isfinite(xp[i])) throw std::invalid_argument("data holds a non-finite value");
            }
            std::vector<uint8_t> q;
            {
                py::gil_scoped_release release;
                q = quantize_rows(type, xp, nrows, ncols, wp, n_threads);
            }
            py::array_t<uint8_t> out({static_cast<py::ssize_t>(nrows), static_cast<py::ssize_t>(row_size)});
            if (!q.empty()) std::memcpy(out.mutable_data(), q.data(), q.size());
            return out;
        },
        py::arg("ggml_type"), py::arg("data"), py::arg("importance") = py::none(), py::arg("n_threads") = 1,
        "ggml's quantization (ggml_quantize_chunk) of float32 rows [rows, cols] to ggml_type, weighted per column "
        "by importance (e.g. mean squared activations) or plain when None. Returns uint8 [rows, bytes per row].");
    m.def(
        "quantized_row_size",
        [](int type, int64_t ncols) { return quantized_row_size(type, ncols, true); },
        py::arg("ggml_type"), py::arg("cols"), "Bytes per row of cols values in ggml_type (ValueError if not quantizable).");
}
