// Closeness of a configuration's next-token distributions to a reference's, row by row, as
// llama-perplexity --kl-divergence measures a quant: KL(P || Q) over the whole vocabulary in
// double, whether the two put their top token on the same id, and -log Q of the actual next token.
#pragma once
#include <cstdint>

namespace river {

// One configuration's rows and where its measures go: logits float32 [n_rows, n_vocab] raw
// logits (Q is their softmax); kld, same_top, nll: n_rows each.
struct DivergenceOutput {
    const float* logits;
    double* kld;
    uint8_t* same_top;
    double* nll;
};

// reference: float32 [n_rows, n_vocab] raw logits (P is their softmax); targets: the actual next
// token per row; configs: the configurations compared with the same reference (the reference's
// log-sum-exp and probabilities are computed once per row for all of them). Rows are split over
// n_threads; each row is summed by one thread in vocabulary order, so the result does not depend
// on the thread count nor on which other configurations are compared in the same call. A row
// equal to the reference's gives exactly 0. A token P gives probability 0 (its exp underflows)
// adds nothing.
void divergence_rows(const float* reference, const int32_t* targets, int64_t n_rows, int64_t n_vocab,
                     const DivergenceOutput* configs, int64_t n_configs, int n_threads);

}  // namespace river
