#include "imatrix.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "engine.h"

namespace river {

namespace {

// Tokens per eval while observing: each eval returns every token's final-norm row, the head's
// input (256 x n_embd floats).
constexpr size_t kSliceTokens = 256;

bool ends_with(const std::string& s, const char* suffix) {
    const size_t n = std::strlen(suffix);
    return s.size() >= n && s.compare(s.size() - n, n, suffix) == 0;
}

}  // namespace

std::string weight_name(const ggml_tensor* t) {
    if (!t || t->op != GGML_OP_MUL_MAT || !t->src[0]) return {};
    const ggml_tensor* w = t->src[0];
    // A model weight is a leaf that owns its data: intermediate results are computed (op != NONE)
    // and reshapes/permutes of anything are views. The KV cache is a leaf too, but attention reads
    // it through flash attention, not mul_mat, and its tensors are not named "*.weight".
    if (w->op != GGML_OP_NONE || w->view_src != nullptr) return {};
    return file_weight_name(w->name);
}

std::string file_weight_name(std::string name) {
    // The scheduler names its copies of a weight for another backend "<backend>#<name>#<n>".
    const size_t first = name.find('#');
    if (first != std::string::npos) {
        const size_t last = name.rfind('#');
        if (last == first) return {};
        name = name.substr(first + 1, last - first - 1);
    }
    if (!ends_with(joined_parts(name)[0], ".weight")) return {};
    return name;
}

bool ActivationStats::wanted(const ggml_tensor* t) const {
    if (t->op != GGML_OP_MUL_MAT) return false;
    const ggml_tensor* w = t->src[0];
    const ggml_tensor* x = t->src[1];
    if (!w || !x) return false;
    // Rows of x must be plain floats to be squared; every mat-mul input in this engine's graphs is.
    if (x->type != GGML_TYPE_F32 || x->nb[0] != sizeof(float)) return false;
    // One matrix per weight (no stacked experts): one vector of column statistics describes it.
    if (w->ne[2] != 1 || w->ne[3] != 1) return false;
    if (x->ne[0] != w->ne[0]) return false;
    return !weight_name(t).empty();
}

void ActivationStats::accumulate(const ggml_tensor* t) {
    const ggml_tensor* x = t->src[1];
    const std::string name = weight_name(t);
    const int64_t ne0 = x->ne[0], ne1 = x->ne[1];
    const int64_t n_rows = ggml_nrows(x);
    const size_t row_bytes = size_t(ne0) * sizeof(float);

    std::lock_guard<std::mutex> lock(mu_);
    if (!error_.empty()) return;  // a failed collection stays failed until clear()

    // Copy x out through the backend (it may live in GPU memory), honouring its strides: the
    // rows of one plane are read in one call when they are packed, else one by one.
    rows_.resize(size_t(n_rows) * ne0);
    float* dst = rows_.data();
    for (int64_t i3 = 0; i3 < x->ne[3]; ++i3) {
        for (int64_t i2 = 0; i2 < x->ne[2]; ++i2) {
            const size_t plane = size_t(i2) * x->nb[2] + size_t(i3) * x->nb[3];
            if (x->nb[1] == row_bytes) {
                ggml_backend_tensor_get(x, dst, plane, row_bytes * ne1);
                dst += size_t(ne1) * ne0;
            } else {
                for (int64_t i1 = 0; i1 < ne1; ++i1, dst += ne0) {
                    ggml_backend_tensor_get(x, dst, plane + size_t(i1) * x->nb[1], row_bytes);
                }
            }
        }
    }

    add_locked(name, rows_.data(), n_rows, ne0);
}

void ActivationStats::add(const std::string& name, const float* rows, int64_t n_rows, int64_t n_cols) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!error_.empty()) return;
    add_locked(name, rows, n_rows, n_cols);
}

void ActivationStats::add_locked(const std::string& name, const float* rows, int64_t n_rows, int64_t ne0) {
    // Sum this batch on its own first so that a non-finite activation is caught before it
    // spoils the running totals (and named: it points at a broken model or an overflow).
    std::vector<double> batch(ne0, 0.0);
    const float* row = rows;
    for (int64_t r = 0; r < n_rows; ++r, row += ne0) {
        for (int64_t j = 0; j < ne0; ++j) batch[j] += double(row[j]) * row[j];
    }
    for (int64_t j = 0; j < ne0; ++j) {
        if (!std::isfinite(batch[j])) {
            error_ = "non-finite activation in the input of " + name;
            return;
        }
    }

    // A joined weight (Q/K/V, gate/up) has one input: each part saw exactly these rows.
    for (const std::string& part : joined_parts(name)) {
        Entry& e = entries_[part];
        if (e.sums.empty()) {
            e.sums.assign(ne0, 0.0);
        } else if (e.sums.size() != size_t(ne0)) {
            error_ = "the input width of " + part + " changed from " + std::to_string(e.sums.size()) + " to " +
                     std::to_string(ne0) + " (one ActivationStats used with two different models?)";
            return;
        }
        for (int64_t j = 0; j < ne0; ++j) e.sums[j] += batch[j];
        e.count += n_rows;
    }
}

bool ActivationStats::callback(ggml_tensor* t, bool ask, void* data) {
    auto* self = static_cast<ActivationStats*>(data);
    try {
        if (ask) {
            // Once something failed, want nothing more: the graph then runs without stopping.
            if (!self->error().empty()) return false;
            return self->wanted(t);
        }
        self->accumulate(t);
        return self->error().empty();  // false stops the graph; collect_activations then throws
    } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lock(self->mu_);
        if (self->error_.empty()) self->error_ = std::string("activation statistics: ") + e.what();
    } catch (...) {
        std::lock_guard<std::mutex> lock(self->mu_);
        if (self->error_.empty()) self->error_ = "activation statistics: unknown error";
    }
    return false;
}

std::map<std::string, ActivationStats::Entry> ActivationStats::snapshot() const {
    std::lock_guard<std::mutex> lock(mu_);
    return entries_;
}

std::string ActivationStats::error() const {
    std::lock_guard<std::mutex> lock(mu_);
    return error_;
}

void ActivationStats::clear() {
    std::lock_guard<std::mutex> lock(mu_);
    entries_.clear();
    error_.clear();
    rows_.clear();
    rows_.shrink_to_fit();
}

size_t ActivationStats::size() const {
    std::lock_guard<std::mutex> lock(mu_);
    return entries_.size();
}

namespace {

// Sets the engine's observer for one scope: removed however the scope is left, so a failed
// collection never leaves an engine that keeps observing (and keeps no single-token graphs).
class ObserverScope {
public:
    ObserverScope(Engine& e, ActivationStats& s) : e_(e) { e_.set_observer(&ActivationStats::callback, &s); }
    ~ObserverScope() { e_.set_observer(nullptr, nullptr); }
    ObserverScope(const ObserverScope&) = delete;
    ObserverScope& operator=(const ObserverScope&) = delete;

private:
    Engine& e_;
};

}  // namespace

void collect_activations(Engine& engine, const std::vector<int32_t>& tokens, ActivationStats& stats) {
    if (tokens.empty()) throw std::invalid_argument("collect_activations: no tokens");
    const std::string earlier = stats.error();
    if (!earlier.empty()) {
        throw std::runtime_error("these activation statistics come from a failed collection (" + earlier +
                                 "); clear() them first");
    }
    // The head's input is the final norm's output: each eval ends at the norm and returns those
    // rows, which are added under the head's name, one batch per graph (n_batch tokens) as the
    // layers' inputs are. The head's product itself, a vocabulary's worth of logits per token
    // that nothing reads, is never computed.
    const std::string head = file_weight_name(engine.head_weight_name());
    if (head.empty()) throw std::runtime_error("collect_activations: the backbone has no head weight");
    const size_t per_graph = size_t(std::max(1, engine.n_batch()));
    ObserverScope scope(engine, stats);
    for (size_t start = 0; start < tokens.size(); start += kSliceTokens) {
        EvalRequest req;
        req.tokens.assign(tokens.begin() + start, tokens.begin() + std::min(tokens.size(), start + kSliceTokens));
        req.mode = ExitMode::Backbone;
        req.embeddings = true;
        const EvalResult out = engine.eval(req);
        const std::string err = stats.error();
        if (!err.empty()) throw std::runtime_error(err);
        for (int first = 0; first < out.n_rows; first += int(per_graph)) {
            const int n = std::min(int(per_graph), out.n_rows - first);
            stats.add(head, out.logits.data() + size_t(first) * out.n_cols, n, out.n_cols);
        }
        const std::string head_err = stats.error();
        if (!head_err.empty()) throw std::runtime_error(head_err);
    }
}

}  // namespace river
