#include "draft_vocab.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace river {

std::vector<int32_t> draft_vocabulary(const std::vector<int64_t>& ranking, int64_t n_vocab, int64_t size) {
    if (size <= 0 || size >= n_vocab) return {};
    std::vector<char> in(size_t(n_vocab), 0);
    int64_t taken = 0;
    for (int64_t t : ranking) {
        if (taken >= size) break;
        if (t < 0 || t >= n_vocab || in[t]) continue;
        in[t] = 1;
        ++taken;
    }
    for (int64_t t = 0; t < n_vocab && taken < size; ++t) {
        if (in[t]) continue;
        in[t] = 1;
        ++taken;
    }
    if (taken >= n_vocab) return {};
    std::vector<int32_t> ids;
    ids.reserve(size_t(taken));
    for (int64_t t = 0; t < n_vocab; ++t) if (in[t]) ids.push_back(static_cast<int32_t>(t));
    return ids;
}

}  // namespace river
