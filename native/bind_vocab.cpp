// river_gguf._native.Vocab: libllama's tokenizer of a GGUF (vocab only).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings.h"
#include "vocab.h"

namespace py = pybind11;

namespace river {

void bind_vocab(py::module_& m) {
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
        .def_property_readonly("eog_tokens", &Vocab::eog_tokens)
        .def("chat_template", &Vocab::chat_template)
        .def("meta", &Vocab::meta);
}

}  // namespace river
