#include "kv_cache.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <stdexcept>

namespace river {

namespace {
constexpr int kPoisonNoFaByte = 0x1E;
}

KvCache::KvCache(const HParams& hp, int n_ctx, ggml_type type, const std::vector<ggml_backend_t>& layer_backend,
                 bool v_trans)
    : n_ctx_(n_ctx), v_trans_(v_trans), k_(hp.n_layer), v_(hp.n_layer) {
    // One context and buffer per backend, so offloaded layers keep their cache on the device.
    std::map<ggml_backend_t, ggml_context*> by_backend;
    for (int il = 0; il < hp.n_layer; ++il) {
        ggml_backend_t be = layer_backend[il];
        if (!by_backend.count(be)) {
            ggml_init_params params{ggml_tensor_overhead() * 2 * hp.n_layer, nullptr, /*no_alloc=*/true};
            ctxs_.emplace_back(ggml_init(params));
            if (!ctxs_.back()) throw std::runtime_error("cannot create a KV cache context");
            by_backend[be] = ctxs_.back().get();
        }
        k_[il] = ggml_new_tensor_2d(by_backend[be], type, hp.n_embd_k_gqa(), n_ctx);
        v_[il] = v_trans ? ggml_new_tensor_2d(by_backend[be], type, n_ctx, hp.n_embd_v_gqa())
                         : ggml_new_tensor_2d(by_backend[be], type, hp.n_embd_v_gqa(), n_ctx);
        ggml_format_name(k_[il], "cache_k_l%d", il);
        ggml_format_name(v_[il], "cache_v_l%d", il);
    }
    for (auto& [be, ctx] : by_backend) {
        buffers_.emplace_back(ggml_backend_alloc_ctx_tensors(ctx, be));
        ggml_backend_buffer_t buf = buffers_.back().get();
        if (!buf) throw std::runtime_error("out of memory allocating the KV cache (n_ctx=" + std::to_string(n_ctx) + ")");
        ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_ANY);
    }
    poison();
}

bool KvCache::finite_poison_in(ggml_backend_buffer_t buf) const {
    return v_trans_ || !ggml_backend_buffer_is_host(buf);
}

bool KvCache::finite_poison(int il) const {
    if (il < 0 || il >= static_cast<int>(k_.size())) throw std::out_of_range("layer index out of range");
    return finite_poison_in(k_[il]->buffer);
}

void KvCache::poison() {
    // 0x7E7E as f16 and 0x7E7E7E7E as f32 are both NaN; the finite poison is bytes 0x1E.
    std::vector<uint8_t> chunk;
    for (auto& b : buffers_) {
        const uint8_t byte = finite_poison_in(b.get()) ? kPoisonNoFaByte : 0x7E;
        if (ggml_backend_buffer_is_host(b.get())) {
            ggml_backend_buffer_clear(b.get(), byte);
            continue;
        }
        // A device buffer's clear is not a byte fill everywhere (ggml-vulkan fills 32-bit words
        // with the value, giving 7E 00 00 00), so its tensors get the bytes written, a chunk at
        // a time.
        if (chunk.empty()) chunk.assign(size_t(1) << 20, byte);
        for (size_t il = 0; il < k_.size(); ++il) {
            for (ggml_tensor* t : {k_[il], v_[il]}) {
                if (t->buffer != b.get()) continue;
                const size_t size = ggml_nbytes(t);
                for (size_t off = 0; off < size; off += chunk.size()) {
                    ggml_backend_tensor_set(t, chunk.data(), off, std::min(chunk.size(), size - off));
                }
            }
        }
    }
}

int KvCells::length(int seq) const {
    const auto it = rows_.find(seq);
    return it == rows_.end() ? 0 : static_cast<int>(it->second.size());
}

std::vector<int> KvCells::sequences() const {
    std::vector<int> out;
    for (const auto& [seq, rows] : rows_) out.push_back(seq);
    return out;
}

const std::vector<int64_t>& KvCells::rows(int seq) const {
    static const std::vector<int64_t> none;
    const auto it = rows_.find(seq);
    return it == rows_.end() ? none : it->second;
}

void KvCells::place(const int32_t* seq, int n, int32_t* pos, int64_t* row) {
    for (int i = 0; i < n; ++i) {
        while (seq_[lowest_free_] >= 0) ++lowest_free_;  // a free row exists: the caller checked
        const int j = lowest_free_++;
        std::vector<int64_t>& rows = rows_[seq[i]];
        pos[i] = pos_[j] = static_cast<int32_t>(rows.size());
        seq_[j] = seq[i];
        rows.push_back(j);
        row[i] = j;
        used_end_ = std::max(used_end_, j + 1);
    }
    used_ += n;
}

void KvCells::remove_tail(int seq, int n) {
    const auto it = rows_.find(seq);
    if (it == rows_.end()) return;
    std::vector<int64_t>& rows = it->second;
    while (static_cast<int>(rows.size()) > std::max(n, 0)) {
        const int j = static_cast<int>(rows.back());
        rows.pop_back();
        seq_[j] = pos_[j] = -1;
        lowest_free_ = std::min(lowest_free_, j);
        --used_;
    }
    if (rows.empty()) rows_.erase(it);
    while (used_end_ > 0 && seq_[used_end_ - 1] < 0) --used_end_;
}

float KvCache::poison_value_no_fa() {
    ggml_fp16_t h;
    std::memset(&h, kPoisonNoFaByte, sizeof(h));
    return ggml_fp16_to_fp32(h);
}

std::vector<float> KvCache::read(int il, bool values, int n) const {
    if (il < 0 || il >= static_cast<int>(k_.size())) throw std::out_of_range("layer index out of range");
    if (n < 0 || n > n_ctx_) throw std::out_of_range("position count out of range");
    ggml_tensor* t = values ? v_[il] : k_[il];
    auto to_float = [&](const std::vector<uint8_t>& raw, float* dst, int64_t count) {
        if (t->type == GGML_TYPE_F32) std::memcpy(dst, raw.data(), sizeof(float) * count);
        else ggml_get_type_traits(t->type)->to_float(raw.data(), dst, count);
    };
    if (values && v_trans_) {
        // [n_ctx, width]: the whole tensor, then positions [0, n) transposed into rows.
        const int64_t width = t->ne[1];
        std::vector<uint8_t> raw(ggml_nbytes(t));
        ggml_backend_tensor_get(t, raw.data(), 0, raw.size());
        std::vector<float> all(size_t(n_ctx_) * width);
        to_float(raw, all.data(), int64_t(all.size()));
        std::vector<float> out(size_t(width) * n);
        for (int p = 0; p < n; ++p)
            for (int64_t j = 0; j < width; ++j) out[size_t(p) * width + j] = all[size_t(j) * n_ctx_ + p];
        return out;
    }
    const int64_t row = t->ne[0];
    std::vector<uint8_t> raw(ggml_row_size(t->type, row) * n);
    ggml_backend_tensor_get(t, raw.data(), 0, raw.size());
    std::vector<float> out(row * n);
    to_float(raw, out.data(), row * n);
    return out;
}

}  // namespace river
