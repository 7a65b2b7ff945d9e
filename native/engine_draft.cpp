// Lossless decoding's draft: the river's tokens after a step, and the draft vocabulary's head
// rows (draft_vocab.h) that a draft's head runs.
#include <algorithm>
#include <cmath>

#include "draft_vocab.h"
#include "engine.h"

namespace river {

void Engine::put_draft_row(size_t row, int32_t token) {
    if (draft_row_token_[row] >= 0) draftable_[draft_row_token_[row]] = 0;  // its token gives way
    draft_rows_->set_row(*draft_head_, int64_t(row), token);
    draft_row_token_[row] = token;
    draftable_[token] = 1;
}

void Engine::note_draft_context(const int32_t* tokens, int n) {
    if (!draft_rows_) return;
    const size_t first = draft_fixed_ + size_t(draft_pinned_);  // the rotating rows
    const int rotating = kDraftContextRows - draft_pinned_;
    for (int i = 0; i < n; ++i) {
        if (draftable_[tokens[i]]) continue;
        put_draft_row(first + size_t(draft_context_next_), tokens[i]);  // the oldest gives way
        draft_context_next_ = (draft_context_next_ + 1) % rotating;
        draft_context_used_ = std::min(draft_context_used_ + 1, rotating);
    }
}

void Engine::pin_draft_tokens(const std::vector<int32_t>& tokens) {
    if (!draft_rows_) return;
    for (int32_t t : tokens) {
        if (t < 0 || t >= hp_.n_vocab) {
            throw std::invalid_argument("token id " + std::to_string(t) + " is outside the vocabulary");
        }
    }
    // The rotating rows start again after the pinned ones.
    for (size_t row = draft_fixed_ + size_t(draft_pinned_); row < draft_row_token_.size(); ++row) {
        if (draft_row_token_[row] >= 0) draftable_[draft_row_token_[row]] = 0;
        draft_row_token_[row] = -1;
    }
    draft_context_used_ = draft_context_next_ = 0;
    for (int32_t t : tokens) {
        if (draftable_[t] || draft_pinned_ >= kDraftPinnedRows) continue;
        put_draft_row(draft_fixed_ + size_t(draft_pinned_++), t);
    }
}

std::vector<int32_t> Engine::draft_vocab() const {
    const size_t fixed = draft_fixed_ + size_t(draft_pinned_);
    std::vector<int32_t> out(draft_row_token_.begin(), draft_row_token_.begin() + fixed);
    std::sort(out.begin(), out.end());
    return out;
}

std::vector<int32_t> Engine::draft_context() const {
    std::vector<int32_t> out;
    if (!draft_rows_) return out;
    const size_t first = draft_fixed_ + size_t(draft_pinned_);
    const int rotating = kDraftContextRows - draft_pinned_;
    const int oldest = draft_context_used_ < rotating ? 0 : draft_context_next_;
    for (int i = 0; i < draft_context_used_; ++i) {
        out.push_back(draft_row_token_[first + size_t((oldest + i) % rotating)]);
    }
    return out;
}

std::vector<int32_t> Engine::draft(int32_t token, int seq, EvalRequest how, int n_max, float p_min,
                                   std::vector<float>* probs, const DraftPicker* pick) {
    if (seq < 0) throw std::invalid_argument("sequence id must be >= 0");
    if (n_max < 0) throw std::invalid_argument("n_max must be >= 0");
    if (std::isnan(p_min)) throw std::invalid_argument("p_min is NaN");
    if (how.all_logits || how.embeddings || how.trace) throw std::invalid_argument("a draft takes one row of logits");
    if (!how.seq_ids.empty()) throw std::invalid_argument("a draft's sequence is its seq argument, not seq_ids");
    // With a draft vocabulary the head runs its rows alone, and logit i is token draft_row_token_[i].
    how.draft_vocab = draft_rows_ != nullptr;
    const int start = cells_.length(seq);
    // The verify batch evaluates `token` and every draft: all must fit the cache's free rows.
    n_max = std::min(n_max, cells_.free_rows() - 1);
    std::vector<int32_t> drafts;
    try {
        int32_t cur = token;
        for (int i = 0; i < n_max; ++i) {
            // A draft step: the token on `seq`, evaluated as a decode step of sequence 0 is
            // (eval_on), so every sequence's drafts share one kept graph; the mask shows it
            // `seq`'s rows alone.
            how.tokens.assign(1, cur);
            const EvalResult r = eval_on(how, seq);
            const float* l = r.logits.data();
            // The draft head's rows in use (its unused context rows are zero), or every token.
            const bool rows = r.n_cols < hp_.n_vocab;
            const int n_vocab =
                rows ? static_cast<int>(draft_fixed_) + draft_pinned_ + draft_context_used_ : r.n_cols;
            if (pick) {
                const int32_t chosen = (*pick)(l, rows ? draft_row_token_.data() : nullptr, n_vocab);
                if (chosen < 0) break;
                if (chosen >= hp_.n_vocab) throw std::invalid_argument("the draft picker chose a token outside the vocabulary");
                drafts.push_back(chosen);
                cur = chosen;
                continue;
            }
            const int best = static_cast<int>(std::max_element(l, l + n_vocab) - l);
            if (p_min > 0.0f || probs) {
                double sum = 0;  // p(best) = 1 / sum_j exp(l_j - l_best)
                for (int j = 0; j < n_vocab; ++j) sum += std::exp(double(l[j]) - l[best]);
                const float p = static_cast<float>(1.0 / sum);
                if (!(p >= p_min)) break;  // a NaN row drafts nothing
                if (probs) probs->push_back(p);
            } else {
                // No probability asked for: only what made it NaN above stops the draft (a NaN
                // logit, or an infinite best), without a softmax over the vocabulary.
                bool finite = std::isfinite(l[best]);
                for (int j = 0; j < n_vocab && finite; ++j) finite = !std::isnan(l[j]);
                if (!finite) break;
            }
            // The head that ran had the draft vocabulary's rows, or all of them.
            const int32_t token = rows ? draft_row_token_[best] : best;
            drafts.push_back(token);
            cur = token;
        }
    } catch (...) {
        // A failed step has put its own row back (eval_on) and reported a failed server; the
        // drafts before it, or a picker that threw, leave rows of `seq` that go here, so a draft
        // that throws leaves the sequence as it found it, as one that returns does.
        cells_.remove_tail(seq, start);
        throw;
    }
    // The drafts' rows of `seq` go; the other sequences' rows were never touched.
    cells_.remove_tail(seq, start);
    return drafts;
}

}  // namespace river
