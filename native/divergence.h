// Closeness of a configuration's next-token distributions to a reference's, row by row, as
// llama-perplexity --kl-divergence measures a quant: KL(P || Q) over the whole vocabulary in
// double, whether the two put their top token on the same id, and -log Q of the actual next token.
#pragma once
#include <cstdint>

namespace river {

// reference, logits: float32 [n_rows, n_vocab] raw logits (P and Q are their softmax); targets:
// the actual next token per row. Rows are split over n_threads; each row is summed by one thread
// in vocabulary order, so the result does not depend on the thread count. A row equal to the
// reference's gives exactly 0. A token P gives probability 0 (its exp underflows) adds nothing.
void divergence_rows(const float* reference, const float* logits, const int32_t* targets, int64_t n_rows,
                     int64_t n_vocab, int n_threads, double* kld, uint8_t* same_top, double* nll);

}  // namespace river
