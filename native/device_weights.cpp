#include "device_weights.h"

#include <cstring>
#include <map>

#include "ggml-alloc.h"
#include "ggml-cpu.h"

#include "errors.h"

namespace river {

void check_device_matmul(ggml_backend_dev_t dev, ggml_backend_buffer_type_t buft, const std::vector<ggml_tensor**>& slots) {
    for (ggml_tensor** slot : slots) {
        const ggml_tensor* t = *slot;
        // 1-D tensors are F32 (checked at load) and feed only element-wise ops.
        if (!t || ggml_n_dims(t) < 2) continue;
        if (!buft_supports_matmul(dev, buft, t)) {
            throw UnsupportedModelError("weight '" + std::string(ggml_get_name(t)) + "' of type " + type_name(t->type) +
                                        " cannot be multiplied on " + ggml_backend_dev_name(dev) +
                                        "; load it with n_gpu_layers=0");
        }
    }
}

std::vector<ggml_backend_buffer_type_t> cpu_extra_buffer_types() {
    std::vector<ggml_backend_buffer_type_t> out;
    ggml_backend_dev_t dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    if (!dev) return out;
    auto get = reinterpret_cast<ggml_backend_dev_get_extra_bufts_t>(
        ggml_backend_reg_get_proc_address(ggml_backend_dev_backend_reg(dev), "ggml_backend_dev_get_extra_bufts"));
    if (!get) return out;
    for (ggml_backend_buffer_type_t* b = get(dev); b && *b; ++b) out.push_back(*b);
    return out;
}

bool buft_supports_matmul(ggml_backend_dev_t dev, ggml_backend_buffer_type_t buft, const ggml_tensor* w) {
    // Ask the device about a decode-shaped mul_mat whose weight sits in an empty buffer of `buft`.
    ggml_init_params params{ggml_tensor_overhead() * 4, nullptr, /*no_alloc=*/true};
    ggml_context* ctx = ggml_init(params);
    ggml_tensor* wc = ggml_dup_tensor(ctx, w);
    ggml_tensor* x = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, w->ne[0], 1);
    ggml_tensor* op = ggml_mul_mat(ctx, wc, x);
    ggml_backend_buffer_t probe = ggml_backend_buft_alloc_buffer(buft, 0);
    wc->buffer = probe;
    const bool ok = probe && ggml_backend_dev_supports_op(dev, op);
    if (probe) ggml_backend_buffer_free(probe);
    ggml_free(ctx);
    return ok;
}

namespace {

ggml_tensor* concat_shape(ggml_context* ctx, const std::vector<ggml_tensor*>& parts) {
    int64_t rows = 0;
    for (ggml_tensor* p : parts) rows += p->ne[1];
    return ggml_new_tensor_2d(ctx, parts[0]->type, parts[0]->ne[0], rows);
}

}  // namespace

bool concat_supported(ggml_backend_dev_t dev, ggml_backend_buffer_type_t buft, const std::vector<ggml_tensor*>& parts) {
    if (parts.empty()) return false;
    for (ggml_tensor* p : parts) {
        if (!p || !p->data || p->type != parts[0]->type || p->ne[0] != parts[0]->ne[0] || ggml_n_dims(p) > 2 ||
            !ggml_is_contiguous(p) || (p->buffer && !ggml_backend_buffer_is_host(p->buffer))) {
            return false;
        }
    }
    ggml_init_params params{ggml_tensor_overhead() * 2, nullptr, /*no_alloc=*/true};
    ggml_context* ctx = ggml_init(params);
    const bool ok = buft_supports_matmul(dev, buft, concat_shape(ctx, parts));
    ggml_free(ctx);
    return ok;
}

DeviceWeights::~DeviceWeights() {
    if (buffer_) ggml_backend_buffer_free(buffer_);
    if (ctx_) ggml_free(ctx_);
}

void DeviceWeights::move(ggml_backend_buffer_type_t buft, const std::vector<ggml_tensor**>& slots,
                         const std::vector<Concat>& concats) {
    ggml_init_params params{ggml_tensor_overhead() * (slots.size() + concats.size() + 1), nullptr, /*no_alloc=*/true};
    ctx_ = ggml_init(params);
    std::vector<ggml_tensor*> made;
    for (const Concat& c : concats) {
        made.push_back(concat_shape(ctx_, c.parts));
        ggml_set_name(made.back(), c.name.c_str());
    }
    // The same source tensor may fill several slots (a tied head); copy it once.
    std::map<ggml_tensor*, ggml_tensor*> copies;
    for (ggml_tensor** slot : slots) {
        if (!*slot || copies.count(*slot)) continue;
        ggml_tensor* c = ggml_dup_tensor(ctx_, *slot);
        ggml_set_name(c, ggml_get_name(*slot));
        copies[*slot] = c;
    }
    buffer_ = ggml_backend_alloc_ctx_tensors_from_buft(ctx_, buft);
    if (!buffer_) throw std::runtime_error(std::string("out of memory placing weights in ") + ggml_backend_buft_name(buft));
    ggml_backend_buffer_set_usage(buffer_, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    for (auto& [src, dst] : copies) ggml_backend_tensor_set(dst, src->data, 0, ggml_nbytes(src));
    for (ggml_tensor** slot : slots) if (*slot) *slot = copies[*slot];
    // A repacking buffer converts layout in set_tensor and takes only whole tensors, so the
    // parts are joined on the host first.
    std::vector<uint8_t> staging;
    for (size_t i = 0; i < concats.size(); ++i) {
        staging.resize(ggml_nbytes(made[i]));
        size_t off = 0;
        for (ggml_tensor* p : concats[i].parts) {
            std::memcpy(staging.data() + off, p->data, ggml_nbytes(p));
            off += ggml_nbytes(p);
        }
        ggml_backend_tensor_set(made[i], staging.data(), 0, staging.size());
        *concats[i].target = made[i];
    }
}

HeadRows::HeadRows(const ggml_tensor* head, const std::vector<int32_t>& ids, int n_spare) : head_(head) {
    if (!head->data) throw std::runtime_error("the head's rows are not in host memory");
    ggml_init_params params{ggml_tensor_overhead(), nullptr, /*no_alloc=*/true};
    ctx_.reset(ggml_init(params));
    if (!ctx_) throw std::runtime_error("cannot create the draft head's context");
    tensor_ = ggml_new_tensor_2d(ctx_.get(), head->type, head->ne[0], static_cast<int64_t>(ids.size()) + n_spare);
    ggml_format_name(tensor_, "%s.draft", ggml_get_name(head));
    buffer_.reset(ggml_backend_alloc_ctx_tensors_from_buft(ctx_.get(), ggml_backend_cpu_buffer_type()));
    if (!buffer_) throw std::runtime_error("out of memory for the draft head");
    ggml_backend_buffer_set_usage(buffer_.get(), GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    ggml_backend_buffer_clear(buffer_.get(), 0);
    for (size_t i = 0; i < ids.size(); ++i) {
        if (ids[i] < 0 || ids[i] >= head->ne[1]) {
            throw std::invalid_argument("draft vocabulary token " + std::to_string(ids[i]) + " is outside [0, " +
                                        std::to_string(head->ne[1]) + ")");
        }
        set_row(tensor_, int64_t(i), ids[i]);
    }
}

void HeadRows::set_row(ggml_tensor* placed, int64_t row, int32_t token) const {
    ggml_backend_tensor_set(placed, static_cast<const char*>(head_->data) + size_t(token) * head_->nb[1],
                            size_t(row) * placed->nb[1], head_->nb[1]);
}

}  // namespace river
