// Lossless decoding's draft vocabulary: the tokens a draft may propose. The head is a large
// share of a small model's weights (28% of Qwen2.5-0.5B's), and a draft runs it once per
// drafted token; restricted to the tokens text actually uses, it costs a fraction of that. The
// backbone verifies with its full head, so the text is the backbone's whatever the draft's
// vocabulary: a token outside it is never drafted, and only costs its round's acceptance.
#pragma once
#include <cstdint>
#include <vector>

namespace river {

// Rows of the draft head after the draft vocabulary's, for the context's other tokens: every
// token the engine evaluates outside the vocabulary takes one, the oldest giving way when all
// are taken. Text copies its prompt's names (a function's, a variable's), which a ranking made
// from other text does not hold: with these rows Qwen2.5-Coder drafts them too.
inline constexpr int kDraftContextRows = 512;
// At most this many of them hold pinned tokens (Engine::pin_draft_tokens); the rest rotate.
inline constexpr int kDraftPinnedRows = kDraftContextRows / 2;

// A River GGUF's ranking of tokens for the draft vocabulary: the converter's calibration text's
// tokens, most frequent first.
inline constexpr const char* kDraftTokensKey = "river.draft_tokens";

// The size EngineConfig::draft_vocab = -1 (auto) stands for: kAutoDraftVocab tokens for a
// vocabulary at least twice as large (Qwen's 151936, Llama 3's 128256, Gemma's 262144), else
// the whole vocabulary. On Qwen2.5-Coder the calibration ranking and ascending ids up to 32768
// tokens hold 97% of the HumanEval evaluation items' tokens; with the context rows, greedy
// drafts were accepted 93% against 95% with the whole vocabulary (BENCHMARKS.md), at a fifth of
// the head's rows.
inline constexpr int64_t kAutoDraftVocab = 32768;
inline int64_t draft_vocab_size(int64_t asked, int64_t n_vocab) {
    if (asked >= 0) return asked;
    return n_vocab >= 2 * kAutoDraftVocab ? kAutoDraftVocab : 0;
}

// The `size` best-ranked tokens in ascending id order. The ranking goes first; the ids it does
// not list follow in ascending order, which in a BPE vocabulary is its merge order, roughly most
// frequent first. Out-of-range and repeated entries of `ranking` are skipped. size <= 0 or a
// vocabulary at least n_vocab large: empty, meaning the whole vocabulary. (The end-of-generation
// tokens join it after the load: Engine::pin_draft_tokens.)
std::vector<int32_t> draft_vocabulary(const std::vector<int64_t>& ranking, int64_t n_vocab, int64_t size);

}  // namespace river
