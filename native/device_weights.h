// Weights copied to where they run: another buffer type (a GPU's memory, or a CPU "extra"
// buffer type that repacks them), joined on the way, and the draft head's rows in host memory.
#pragma once
#include <string>
#include <vector>

#include "ggml-backend.h"
#include "weights.h"

namespace river {

// Copies of some tensors in another buffer type: a GPU's memory for offloaded layers, or a
// CPU "extra" buffer type that repacks weights for faster matrix kernels. Owns the buffer.
class DeviceWeights {
public:
    DeviceWeights() = default;
    ~DeviceWeights();
    DeviceWeights(const DeviceWeights&) = delete;
    DeviceWeights& operator=(const DeviceWeights&) = delete;
    // Tensors made by concatenating the rows of `parts` (same type and row length), stored
    // in *target.
    struct Concat {
        std::vector<ggml_tensor*> parts;
        ggml_tensor** target;
        std::string name;
    };
    // Replace each *slot by a copy living in a buffer of type `buft`, and fill each concat's
    // target with its row-concatenation in the same buffer.
    void move(ggml_backend_buffer_type_t buft, const std::vector<ggml_tensor**>& slots,
              const std::vector<Concat>& concats = {});

private:
    ggml_context* ctx_ = nullptr;
    ggml_backend_buffer_t buffer_ = nullptr;
};

// Some rows of a head, in host memory: the draft vocabulary of lossless decoding. Row i is
// token ids[i]'s row of `head`, followed by n_spare rows (zero) that set_row fills later, so a
// draft's logits cost these rows alone; placement then moves the tensor where the full head goes.
// Rows of a quantized type are whole blocks, so the rows are the head's own bytes, and their
// logits equal the full head's at those tokens.
class HeadRows {
public:
    // `head` must stay alive and in host memory (a file's tensor) for set_row.
    HeadRows(const ggml_tensor* head, const std::vector<int32_t>& ids, int n_spare);
    ggml_tensor* tensor() const { return tensor_; }
    // Row `row` of `placed` (this tensor where placement put it) becomes token's row of the head.
    void set_row(ggml_tensor* placed, int64_t row, int32_t token) const;

private:
    const ggml_tensor* head_;
    ggml_context_ptr ctx_;
    ggml_backend_buffer_ptr buffer_;  // declared after ctx_: freed before it
    ggml_tensor* tensor_ = nullptr;
};

// Throws UnsupportedModelError when `dev` cannot multiply by one of the 2-D weights in
// `slots` held in a buffer of type `buft`; call before moving them there (the scheduler
// would abort on a weight no backend can use).
void check_device_matmul(ggml_backend_dev_t dev, ggml_backend_buffer_type_t buft, const std::vector<ggml_tensor**>& slots);

// The CPU device's extra buffer types (repacked layouts), in preference order.
std::vector<ggml_backend_buffer_type_t> cpu_extra_buffer_types();
// Whether `buft` can hold `w` as the weight of a mul_mat on `dev` (llama.cpp's test too).
bool buft_supports_matmul(ggml_backend_dev_t dev, ggml_backend_buffer_type_t buft, const ggml_tensor* w);
// Whether `parts` can be row-concatenated (same type and row length, host data) and the
// result still placed in `buft`.
bool concat_supported(ggml_backend_dev_t dev, ggml_backend_buffer_type_t buft, const std::vector<ggml_tensor*>& parts);

}  // namespace river
