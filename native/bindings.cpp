// The Python module river_gguf._native: its errors and constants here; the classes and functions
// in the bind_*.cpp files (bindings.h).
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <variant>

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings.h"
#include "arch.h"
#include "divergence.h"
#include "draft_vocab.h"
#include "engine.h"
#include "errors.h"
#include "ggml.h"
#include "gguf_file.h"
#include "hparams.h"
#include "model_check.h"
#include "weights.h"
#include "rpc_link.h"

namespace py = pybind11;
using namespace river;

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
    m.def(
        "divergence",
        [](py::array_t<float, py::array::c_style | py::array::forcecast> reference, py::list configs,
           py::array_t<int32_t, py::array::c_style | py::array::forcecast> targets, int n_threads) {
            if (reference.ndim() != 2) throw std::invalid_argument("reference must be a 2-D array");
            const int64_t n = reference.shape(0), n_vocab = reference.shape(1);
            if (targets.ndim() != 1 || targets.shape(0) != n) {
                throw std::invalid_argument("need " + std::to_string(n) + " targets, one per row");
            }
            if (n > 0 && n_vocab == 0) throw std::invalid_argument("rows of no logits");
            const int32_t* t = targets.data();
            for (int64_t i = 0; i < n; ++i) {
                if (t[i] < 0 || t[i] >= n_vocab) throw std::invalid_argument("target " + std::to_string(t[i]) + " is outside the vocabulary");
            }
            using Rows = py::array_t<float, py::array::c_style | py::array::forcecast>;
            std::vector<Rows> logits;
            std::vector<py::array_t<double>> kld, nll;
            std::vector<py::array_t<bool>> same;
            std::vector<DivergenceOutput> outs;
            for (py::handle h : configs) {
                Rows q = Rows::ensure(h);
                if (!q || q.ndim() != 2 || q.shape(0) != n || q.shape(1) != n_vocab) {
                    throw std::invalid_argument("reference and logits must be 2-D arrays of one shape");
                }
                logits.push_back(q);
                kld.emplace_back(n);
                nll.emplace_back(n);
                same.emplace_back(n);
            }
            for (size_t c = 0; c < logits.size(); ++c) {
                outs.push_back({logits[c].data(), kld[c].mutable_data(),
                                reinterpret_cast<uint8_t*>(same[c].mutable_data()), nll[c].mutable_data()});
            }
            {
                py::gil_scoped_release release;
                divergence_rows(reference.data(), t, n, n_vocab, outs.data(), static_cast<int64_t>(outs.size()),
                                std::max(1, n_threads));
            }
            py::list result;
            for (size_t c = 0; c < outs.size(); ++c) result.append(py::make_tuple(kld[c], same[c], nll[c]));
            return result;
        },
        py::arg("reference"), py::arg("configs"), py::arg("targets"), py::arg("n_threads") = 1,
        "Per row of raw logits, for each configuration's rows (a list of arrays of the reference's shape): "
        "KL(P || Q) of the reference's softmax P and the configuration's Q in double, whether their top "
        "tokens agree, and -log Q of the target (llama-perplexity --kl-divergence's measures). The "
        "reference's probabilities are computed once per row for all the configurations. Returns a list "
        "of (kld float64, same_top bool, nll float64), one per configuration.");
    m.def(
        "model_differences",
        [](const std::string& backbone, const std::string& river) {
            py::gil_scoped_release release;
            const GgufFile a(backbone), b(river);
            return model_differences(read_hparams(a), read_hparams(b), a, b);
        },
        py::arg("backbone"), py::arg("river"),
        "How the river file's model differs from the backbone file's, as the engine checks a separate river "
        "(architecture, hyperparameters, sliding-window layers, vocabulary); empty when they are one model.");
    // Engine.eval's `mode` codes by name (exit_setting.h kExitModes); river_gguf.options reads them.
    py::dict exit_modes;
    for (const ExitModeName& e : kExitModes) exit_modes[e.name] = static_cast<int>(e.mode);
    m.attr("EXIT_MODES") = exit_modes;
    // Model facts the converter's cost model reads (weights.h): the GGUF tensor kinds of a layer's
    // attention group, and the kinds joined into one mat-mul when they share a type.
    py::list attention;
    for (const SlotKind& s : attention_group()) {
        if (!attention.contains(s.kind)) attention.append(s.kind);
    }
    m.attr("ATTENTION_TENSORS") = py::tuple(attention);
    py::list joins;
    for (const LayerJoin& j : layer_joins()) joins.append(py::tuple(py::cast(j.kinds)));
    m.attr("WEIGHT_JOINS") = py::tuple(joins);
    // The exit rules in code order (exit_rule.h): name, what the threshold means, the highest
    // score, and the threshold that never passes.
    py::list rules;
    for (const ExitRule* r : exit_rules()) {
        rules.append(py::make_tuple(r->name, r->about, r->max_score, never_exit_threshold(*r)));
    }
    m.attr("EXIT_RULES") = py::tuple(rules);
    // The key of a River GGUF's draft-vocabulary ranking (draft_vocab.h), which the converter writes.
    m.attr("DRAFT_TOKENS_KEY") = kDraftTokensKey;
    // ggml's RPC backend: compiled in (HAS_RPC), present in the loaded ggml (rpc_available).
    m.attr("HAS_RPC") = rpc_compiled();
    m.attr("RPC_PROTOCOL") = rpc_protocol_version();
    // Each family's facts that Python needs (arch.h): convert/hybrid.py writes no output.weight
    // for a family whose head is always its embedding table.
    py::dict archs;
    for (const ArchSpec* a : arch_specs()) archs[a->name] = py::dict(py::arg("tied_only") = a->tied_only);
    m.attr("ARCHITECTURES") = archs;

    bind_devices(m);
    bind_engine(m);
    bind_vocab(m);
    bind_imatrix(m);
    bind_quantize(m);
}
