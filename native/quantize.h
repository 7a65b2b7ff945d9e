// ggml's quantization of rows, weighted per column by an importance vector (imatrix.h collects
// the statistic it is usually made from) or plain.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace river {

// ggml's quantization of `nrows` rows of `ncols` floats to `type`, with per-column importance
// weights (`importance`: ncols floats, or nullptr for ggml's plain rounding), split over
// `n_threads` threads. Throws std::invalid_argument on a type ggml cannot quantize to, a width
// that is not a whole number of blocks, or a missing importance the type requires.
std::vector<uint8_t> quantize_rows(int type, const float* data, int64_t nrows, int64_t ncols, const float* importance,
                                   int n_threads);

// Bytes one row of `ncols` values takes in `type` (after the same checks as quantize_rows).
size_t quantized_row_size(int type, int64_t ncols, bool has_importance);

}  // namespace river
