// river_gguf._native.Engine: load, eval and draft (GIL released), the KV cache, placement.
#include <cstring>
#include <memory>
#include <type_traits>
#include <variant>

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings.h"
#include "engine.h"

namespace py = pybind11;
using namespace pybind11::literals;  // "name"_a = value in py::dict

namespace river {

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

// A name's code in a table of names (kExitDecisions, kRpcWeights), from a name or a code.
template <size_t N>
int named_code(const char* const (&names)[N], const char* what, py::handle v) {
    std::string all;
    for (const char* n : names) all += (all.empty() ? "'" : ", '") + std::string(n) + "'";
    if (py::isinstance<py::str>(v)) {
        const std::string name = py::cast<std::string>(v);
        for (size_t i = 0; i < N; ++i) if (name == names[i]) return static_cast<int>(i);
        throw std::invalid_argument(std::string(what) + " must be one of " + all + ", got '" + name + "'");
    }
    const int code = py::cast<int>(v);
    if (code < 0 || static_cast<size_t>(code) >= N) throw std::invalid_argument(std::string(what) + " must be one of " + all);
    return code;
}

// The engine's config from Engine's keyword arguments: each names a field of EngineConfig
// (kEngineConfigFields); exit_decision and rpc_weights by name (or code).
EngineConfig read_engine_config(const py::kwargs& kw) {
    EngineConfig cfg;
    for (const auto& item : kw) {
        const std::string name = py::cast<std::string>(item.first);
        const EngineConfigField* f = nullptr;
        for (const EngineConfigField& c : kEngineConfigFields) if (name == c.name) f = &c;
        if (!f || name == "path" || name == "river_path") throw py::type_error("unexpected keyword argument '" + name + "'");
        std::visit(
            [&](auto member) {
                using T = std::remove_reference_t<decltype(cfg.*member)>;
                if constexpr (std::is_same_v<T, ExitDecision>) {
                    cfg.*member = static_cast<ExitDecision>(named_code(kExitDecisions, "exit_decision", item.second));
                } else if (name == "rpc_weights") {
                    cfg.rpc_weights = named_code(kRpcWeights, "rpc_weights", item.second);
                } else {
                    cfg.*member = py::cast<T>(item.second);
                }
            },
            f->member);
    }
    return cfg;
}

// EngineConfig's defaults by field name (exit_decision and rpc_weights by name).
py::dict engine_config_defaults() {
    const EngineConfig cfg;
    py::dict d;
    for (const EngineConfigField& f : kEngineConfigFields) {
        std::visit(
            [&](auto member) {
                using T = std::remove_reference_t<decltype(cfg.*member)>;
                if constexpr (std::is_same_v<T, const ExitDecision>) d[f.name] = kExitDecisions[static_cast<int>(cfg.*member)];
                else d[f.name] = cfg.*member;
            },
            f.member);
    }
    d["rpc_weights"] = kRpcWeights[cfg.rpc_weights];
    return d;
}

bool is_rule_field(const ExitSettingField& f) {
    const auto* m = std::get_if<int ExitSetting::*>(&f.member);
    return m && *m == &ExitSetting::rule;
}

// A field's value as Python sees it: the mode and the rule by name, the rest as they are.
py::object field_value(const ExitSetting& s, const ExitSettingField& f) {
    return std::visit(
        [&](auto member) -> py::object {
            const auto v = s.*member;
            if constexpr (std::is_same_v<std::remove_const_t<decltype(v)>, ExitMode>) {
                return py::str(kExitModes[static_cast<int>(v)].name);
            } else {
                if (is_rule_field(f)) return py::str(exit_rule(static_cast<int>(v)).name);
                return py::cast(v);
            }
        },
        f.member);
}

// Sets a field from Python: the mode and the rule by name or by code.
void set_field(ExitSetting& s, const ExitSettingField& f, py::handle v) {
    std::visit(
        [&](auto member) {
            using T = std::remove_reference_t<decltype(s.*member)>;
            if constexpr (std::is_same_v<T, ExitMode>) {
                int code = -1;
                if (py::isinstance<py::str>(v)) {
                    const std::string name = py::cast<std::string>(v);
                    for (const ExitModeName& e : kExitModes) if (name == e.name) code = static_cast<int>(e.mode);
                    if (code < 0) throw std::invalid_argument("bad mode '" + name + "'");
                } else {
                    code = py::cast<int>(v);
                }
                if (!is_exit_mode(code)) throw std::invalid_argument("bad mode");
                s.*member = static_cast<ExitMode>(code);
            } else if (is_rule_field(f) && py::isinstance<py::str>(v)) {
                const std::string name = py::cast<std::string>(v);
                const int code = exit_rule_code(name);
                if (code < 0) throw std::invalid_argument("exit rule '" + name + "' is not one of " + exit_rule_names());
                s.*member = static_cast<T>(code);
            } else {
                s.*member = py::cast<T>(v);
            }
        },
        f.member);
}

const ExitSettingField& setting_field(const std::string& name) {
    for (const ExitSettingField& c : kExitSettingFields) if (name == c.name) return c;
    throw py::type_error("unexpected keyword argument '" + name + "'");
}

// The exit setting of an eval or draft call, from its keyword arguments: each names a field of
// ExitSetting (kExitSettingFields); the ones not given keep their defaults.
void read_exit_setting(const py::kwargs& kw, ExitSetting& out) {
    for (const auto& item : kw) set_field(out, setting_field(py::cast<std::string>(item.first)), item.second);
}

py::dict setting_dict(const ExitSetting& s) {
    py::dict d;
    for (const ExitSettingField& f : kExitSettingFields) d[f.name] = field_value(s, f);
    return d;
}

// The exit setting as a Python class: its fields (kExitSettingFields) as attributes, the
// constructor's keywords, and as_dict(); the module's EXIT_SETTING is the defaults' dict.
void bind_exit_setting(py::module_& m) {
    py::class_<ExitSetting> cls(m, "ExitSetting",
                                "The exit setting of a step (native/exit_setting.h): keyword arguments name its fields; "
                                "the mode and the rule are names (or codes).");
    cls.def(py::init([](const py::kwargs& kw) {
        ExitSetting s;
        read_exit_setting(kw, s);
        return s;
    }));
    for (const ExitSettingField& f : kExitSettingFields) {
        const ExitSettingField* fp = &f;
        cls.def_property(
            f.name, py::cpp_function([fp](const ExitSetting& s) { return field_value(s, *fp); }),
            py::cpp_function([fp](ExitSetting& s, py::handle v) { set_field(s, *fp, v); }));
    }
    cls.def("as_dict", &setting_dict, "The fields by name, in declaration order.");
    cls.def("__eq__", [](const ExitSetting& a, const ExitSetting& b) {
        return setting_dict(a).equal(setting_dict(b));
    });
    cls.def("__repr__", [](const ExitSetting& s) {
        std::string r = "ExitSetting(";
        bool first = true;
        for (const ExitSettingField& f : kExitSettingFields) {
            r += (first ? "" : ", ") + std::string(f.name) + "=" + py::cast<std::string>(py::repr(field_value(s, f)));
            first = false;
        }
        return r + ")";
    });
    py::list names;
    for (const ExitSettingField& f : kExitSettingFields) names.append(f.name);
    cls.attr("FIELDS") = py::tuple(names);
    m.attr("EXIT_SETTING") = setting_dict(ExitSetting{});
}

// A float32 array [n, width] that owns `rows` (moved, not copied: a batch's logits are tens of MB).
py::array_t<float> owned_rows(std::vector<float>&& rows, py::ssize_t n, py::ssize_t width) {
    if (rows.size() != size_t(n) * size_t(width)) throw std::logic_error("engine rows: size does not match the shape");
    auto owned = std::make_unique<std::vector<float>>(std::move(rows));
    float* data = owned->data();
    py::capsule keep(owned.get(), [](void* p) { delete static_cast<std::vector<float>*>(p); });
    owned.release();
    return py::array_t<float>({n, width}, data, keep);
}

py::tuple eval(Engine& e, std::vector<int32_t> tokens, bool all_logits, bool trace, bool embeddings, int first_row,
               std::vector<int32_t> seq_ids, bool decode_kernels, const py::kwargs& setting) {
    EvalRequest req;
    read_exit_setting(setting, req);
    req.tokens = std::move(tokens);
    req.seq_ids = std::move(seq_ids);
    req.all_logits = all_logits;
    req.first_row = first_row;
    req.trace = trace;
    req.embeddings = embeddings;
    req.decode_kernels = decode_kernels;
    EvalResult res;
    {
        py::gil_scoped_release release;
        res = e.eval(req);
    }
    // Rows of logits (n_vocab wide), or of embeddings (n_embd wide).
    const int width = res.n_rows ? res.n_cols : (embeddings ? e.hparams().n_embd : e.hparams().n_vocab);
    return py::make_tuple(owned_rows(std::move(res.logits), res.n_rows, width), res.exit_layer, res.similarity);
}

// Per tail, its logits rows [n, n_vocab] (Engine::river_tails); with keep_hidden, also
// {layer: the hidden state entering that river layer [n, n_embd]} of each branch. start_hidden
// [n, n_embd] float32: the state entering river layer start_layer, where the pass begins.
py::object river_tails(Engine& e, std::vector<int32_t> tokens, std::vector<int> tails, bool backbone_attention,
                       bool river_head, int first_row, int start_layer, py::object start_hidden, bool keep_hidden) {
    std::vector<std::vector<float>> rows;
    std::vector<TrunkState> kept;
    TrunkState start;
    const py::ssize_t width_h = e.hparams().n_embd;
    if (!start_hidden.is_none()) {
        auto a = py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(start_hidden);
        if (!a || a.ndim() != 2 || a.shape(1) != width_h || a.shape(0) != static_cast<py::ssize_t>(tokens.size())) {
            throw std::invalid_argument("start_hidden: a float32 array [n_tokens, n_embd]");
        }
        start.layer = start_layer;
        start.rows.assign(a.data(), a.data() + a.size());
    } else if (start_layer != 0) {
        throw std::invalid_argument("start_layer needs start_hidden");
    }
    {
        py::gil_scoped_release release;
        rows = e.river_tails(tokens, tails, backbone_attention, river_head, first_row,
                             start_hidden.is_none() ? nullptr : &start, keep_hidden ? &kept : nullptr);
    }
    py::list out;
    const py::ssize_t n = static_cast<py::ssize_t>(tokens.size()) - first_row, width = e.hparams().n_vocab;
    // Each array owns its tail's rows (no copy: a family's rows would otherwise be held twice).
    for (auto& r : rows) out.append(owned_rows(std::move(r), n, width));
    if (!keep_hidden) return std::move(out);
    py::dict hidden;
    for (TrunkState& k : kept) {
        py::array_t<float> a({static_cast<py::ssize_t>(tokens.size()), width_h});
        std::memcpy(a.mutable_data(), k.rows.data(), k.rows.size() * sizeof(float));
        hidden[py::int_(k.layer)] = a;
    }
    return py::make_tuple(out, hidden);
}

py::tuple draft(Engine& e, int32_t token, int n_max, float p_min, int seq, bool with_probs, py::object pick,
                const py::kwargs& setting) {
    EvalRequest how;
    read_exit_setting(setting, how);
    std::vector<float> probs;
    std::vector<int32_t> tokens;
    // The picker sees the engine's own buffers as read-only arrays (no copy), valid during the call.
    Engine::DraftPicker picker = [&pick](const float* logits, const int32_t* ids, int n) -> int32_t {
        py::gil_scoped_acquire gil;
        py::capsule keep(logits, [](void*) {});
        py::array_t<float> l({n}, {sizeof(float)}, logits, keep);
        py::detail::array_proxy(l.ptr())->flags &= ~py::detail::npy_api::NPY_ARRAY_WRITEABLE_;
        py::object t = py::none();
        if (ids) {
            py::array_t<int32_t> a({n}, {sizeof(int32_t)}, ids, keep);
            py::detail::array_proxy(a.ptr())->flags &= ~py::detail::npy_api::NPY_ARRAY_WRITEABLE_;
            t = a;
        }
        return pick(l, t).cast<int32_t>();
    };
    {
        py::gil_scoped_release release;
        tokens = e.draft(token, seq, std::move(how), n_max, p_min, with_probs ? &probs : nullptr,
                         pick.is_none() ? nullptr : &picker);
    }
    return py::make_tuple(tokens, probs);
}

}  // namespace

void bind_engine(py::module_& m) {
    bind_exit_setting(m);
    m.attr("ENGINE_CONFIG") = engine_config_defaults();
    m.attr("EXIT_DECISIONS") = py::tuple(py::cast(std::vector<std::string>(std::begin(kExitDecisions), std::end(kExitDecisions))));
    m.attr("RPC_WEIGHTS") = py::tuple(py::cast(std::vector<std::string>(std::begin(kRpcWeights), std::end(kRpcWeights))));
    py::class_<Engine>(m, "Engine")
        .def(py::init([](const std::string& path, const std::string& river_path, const py::kwargs& kw) {
                 EngineConfig cfg = read_engine_config(kw);
                 cfg.path = path;
                 cfg.river_path = river_path;
                 py::gil_scoped_release release;
                 return std::make_unique<Engine>(cfg);
             }),
             py::arg("path"), py::arg("river_path") = "",
             "Load a model: the backbone (or River GGUF) at `path`, a separate river at `river_path` when given; "
             "the other fields of the engine's config come by keyword (ENGINE_CONFIG: their names and defaults).")
        .def("eval", &eval, py::arg("tokens"), py::kw_only(), py::arg("all_logits") = false,
             py::arg("trace") = false, py::arg("embeddings") = false, py::arg("first_row") = 0,
             py::arg("seq_ids") = std::vector<int32_t>{}, py::arg("decode_kernels") = false,
             "Evaluate tokens at the cache's end under the exit setting given by keyword (EXIT_SETTING's names). "
             "seq_ids (one per token) appends each token to that sequence of the cache, in one batch: a token "
             "attends to its own sequence alone, and without all_logits the logits hold each sequence's last "
             "row, in the order the sequences first appear; without seq_ids every token goes to sequence 0. "
             "One exit decision covers the batch (the lowest score). decode_kernels computes every row in the "
             "single-token kernels, bit for bit a decode step's row (needs decode_kernels_exact). Returns (logits, "
             "exit_layer, scores).")
        .def("draft", &draft, py::arg("token"), py::arg("n_max"), py::arg("p_min") = 0.0f, py::kw_only(),
             py::arg("seq") = 0, py::arg("with_probs") = true, py::arg("pick") = py::none(),
             "Lossless decoding's draft on sequence `seq` (default 0): up to n_max greedy tokens after `token` under "
             "this exit setting, each kept while its probability is >= p_min; every sequence's length is unchanged "
             "(the drafts' rows go again) and the other sequences' rows are untouched. Returns (tokens, probabilities); "
             "with_probs=False returns no probabilities and, with p_min <= 0, computes none. pick(logits, tokens) "
             "-> token (or -1 to stop), when given, chooses each draft from the draft's logits and their tokens "
             "(None: logit i is token i); both arrays are read-only and valid only during the call. The exit setting "
             "comes by keyword, as for eval.")
        .def("pin_draft_tokens", &Engine::pin_draft_tokens, py::arg("tokens"),
             "Keep these tokens draftable for good (the end-of-generation ones), in rows of their own.")
        .def("truncate", &Engine::truncate, py::arg("n"), py::arg("seq") = 0,
             "Forget positions n.. of sequence `seq` (n = 0 clears it); the other sequences are untouched.")
        .def("sequence_length", [](const Engine& e, int seq) { return e.cells().length(seq); }, py::arg("seq"),
             "Positions sequence `seq` holds (0 for a sequence the cache does not hold).")
        .def_property_readonly("sequences", [](const Engine& e) { return e.cells().sequences(); },
                               "The sequences the cache holds positions of, ascending.")
        .def("sequence_rows", [](const Engine& e, int seq) { return e.cells().rows(seq); }, py::arg("seq"),
             "The cache row of each position of sequence `seq`, in position order (for cache_rows).")
        .def_property_readonly("cache_used", [](const Engine& e) { return e.cells().used(); },
                               "Cache rows in use, over every sequence.")
        .def("river_tails", &river_tails, py::arg("tokens"), py::arg("tails"), py::arg("backbone_attention") = false,
             py::arg("river_head") = true, py::arg("first_row") = 0, py::arg("start_layer") = 0,
             py::arg("start_hidden") = py::none(), py::arg("keep_hidden") = false)
        .def_property_readonly("n_past", &Engine::n_past)
        .def_property_readonly(
            "file_exit_setting",
            [](const Engine& e) {
                ExitSetting s = e.hparams().exit_defaults.setting;
                if (!e.has_river()) return ExitSetting{};
                s.river_head = s.river_head && e.river_has_head();
                return s;
            },
            "The default exit setting the file stores (river.* keys; docs/format.md): mode 'river' with the "
            "file's rule, threshold (the rule's never-exit threshold when none is stored), min_exit_layer, "
            "tail and river_head (when the river has a head); a file without a river: ExitSetting().")
        .def_property_readonly("file_threshold_stored",
                               [](const Engine& e) { return e.hparams().exit_defaults.threshold_stored; },
                               "Whether the file stores a threshold (river.threshold).")
        .def_property_readonly(
            "file_prefill",
            [](const Engine& e) { return e.hparams().exit_defaults.prefill_river ? "river" : "backbone"; },
            "The file's prompt policy (river.prefill): 'backbone' or 'river'.")
        .def_property_readonly("draft_vocab", &Engine::draft_vocab,
                               "The tokens a draft may propose (empty: the whole vocabulary).")
        .def_property_readonly("draft_context", &Engine::draft_context,
                               "The evaluated tokens outside draft_vocab that drafts may propose too, oldest first.")
        .def_property_readonly("n_ctx", &Engine::n_ctx)
        .def_property_readonly("has_river", &Engine::has_river)
        .def_property_readonly("flash_attn", &Engine::flash_attn)
        .def_property_readonly("decode_kernels_exact", &Engine::decode_kernels_exact,
                               "Whether eval(decode_kernels=True) gives every row a decode step's bits: all layers "
                               "on the CPU, no backbone weight repacked.")
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
             "Cache layer `layer`, rows [0, n) of K (values=False) or V, as float32 (for tests): with one "
             "sequence, its positions [0, n).")
        .def("cache_poison",
             [](const Engine& e, int layer) {
                 return e.cache().finite_poison(layer) ? KvCache::poison_value_no_fa() : std::nanf("");
             },
             "What an unwritten entry of layer `layer`'s cache holds: NaN, or POISON_NO_FLASH where attention "
             "spans masked rows (no flash attention, or a cache in device memory); for tests.")
        .def_property_readonly_static(
            "POISON_NO_FLASH", [](py::object) { return KvCache::poison_value_no_fa(); },
            "What an unwritten cache entry holds without flash attention (NaN with it).");
}

}  // namespace river
