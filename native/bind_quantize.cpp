// river_gguf._native: activation statistics (the importance matrix) and weighted quantization.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings.h"
#include "engine.h"
#include "imatrix.h"
#include "quantize.h"

namespace py = pybind11;

namespace river {

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
        "Run tokens through the backbone from n_past, adding the input statistics of every weight mat-mul "
        "to stats, the head's included for every token (its input, the final norm's output; the head "
        "itself does not run).");
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

}  // namespace river
