#include "quantize.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <thread>

#include "ggml.h"

namespace river {

namespace {

// The types ggml_quantize_chunk can produce (its switch), i.e. every type llama.cpp quantizes to.
bool quantizable(int type) {
    switch (type) {
        case GGML_TYPE_F32: case GGML_TYPE_F16: case GGML_TYPE_BF16:
        case GGML_TYPE_Q4_0: case GGML_TYPE_Q4_1: case GGML_TYPE_Q5_0: case GGML_TYPE_Q5_1: case GGML_TYPE_Q8_0:
        case GGML_TYPE_Q1_0: case GGML_TYPE_Q2_0: case GGML_TYPE_MXFP4: case GGML_TYPE_NVFP4:
        case GGML_TYPE_Q2_K: case GGML_TYPE_Q3_K: case GGML_TYPE_Q4_K: case GGML_TYPE_Q5_K: case GGML_TYPE_Q6_K:
        case GGML_TYPE_TQ1_0: case GGML_TYPE_TQ2_0:
        case GGML_TYPE_IQ2_XXS: case GGML_TYPE_IQ2_XS: case GGML_TYPE_IQ3_XXS: case GGML_TYPE_IQ3_S:
        case GGML_TYPE_IQ2_S: case GGML_TYPE_IQ1_S: case GGML_TYPE_IQ1_M: case GGML_TYPE_IQ4_NL: case GGML_TYPE_IQ4_XS:
            return true;
        default:
            return false;
    }
}

}  // namespace

size_t quantized_row_size(int type, int64_t ncols, bool has_importance) {
    if (type < 0 || type >= GGML_TYPE_COUNT || !quantizable(type)) {
        throw std::invalid_argument("ggml cannot quantize to type " + std::to_string(type));
    }
    const auto gt = static_cast<ggml_type>(type);
    const int64_t block = ggml_blck_size(gt);
    if (ncols <= 0 || ncols % block != 0) {
        throw std::invalid_argument(std::string(ggml_type_name(gt)) + " packs " + std::to_string(block) +
                                    " values per block; a row of " + std::to_string(ncols) + " is not a whole number of blocks");
    }
    if (!has_importance && ggml_quantize_requires_imatrix(gt)) {
        throw std::invalid_argument(std::string(ggml_type_name(gt)) + " needs an importance vector");
    }
    return ggml_row_size(gt, ncols);
}

std::vector<uint8_t> quantize_rows(int type, const float* data, int64_t nrows, int64_t ncols, const float* importance,
                                   int n_threads) {
    const size_t row_size = quantized_row_size(type, ncols, importance != nullptr);
    if (nrows < 0) throw std::invalid_argument("negative row count");
    const auto gt = static_cast<ggml_type>(type);
    std::vector<uint8_t> out(size_t(nrows) * row_size);
    if (nrows == 0) return out;
    ggml_quantize_init(gt);  // grids of the IQ types, built once before the threads share them

    // Rows are independent, so threads take contiguous runs of them (as llama.cpp's quantizer does).
    const int64_t n_parts = std::max<int64_t>(1, std::min<int64_t>(n_threads, nrows));
    std::vector<size_t> written(n_parts, 0);
    auto work = [&](int64_t part) {
        const int64_t r0 = nrows * part / n_parts, r1 = nrows * (part + 1) / n_parts;
        written[part] = ggml_quantize_chunk(gt, data + r0 * ncols, out.data() + size_t(r0) * row_size, 0, r1 - r0,
                                            ncols, importance);
    };
    {
        // Joins whatever was started on every exit path (a failed thread start included): a
        // std::thread destroyed while joinable would terminate the process.
        struct Joiner {
            std::vector<std::thread> threads;
            ~Joiner() {
                for (auto& th : threads) th.join();
            }
        } pool;
        pool.threads.reserve(n_parts - 1);
        for (int64_t p = 1; p < n_parts; ++p) pool.threads.emplace_back(work, p);
        work(0);
    }

    size_t total = 0;
    for (size_t w : written) total += w;
    if (total != out.size()) {
        throw std::runtime_error("ggml_quantize_chunk wrote " + std::to_string(total) + " bytes, expected " +
                                 std::to_string(out.size()));
    }
    return out;
}

}  // namespace river
