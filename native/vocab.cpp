#include "vocab.h"

#include <mutex>
#include <stdexcept>

#include "errors.h"
#include "llama.h"

namespace river {

Vocab::Vocab(const std::string& path) {
    static std::once_flag once;
    std::call_once(once, [] { llama_backend_init(); });
    llama_model_params params = llama_model_default_params();
    params.vocab_only = true;
    model_ = llama_model_load_from_file(path.c_str(), params);
    if (!model_) throw GgufFormatError("llama.cpp could not load the vocabulary of '" + path + "'");
    vocab_ = llama_model_get_vocab(model_);
}

Vocab::~Vocab() {
    if (model_) llama_model_free(model_);
}

std::vector<int32_t> Vocab::tokenize(const std::string& text, bool add_special, bool parse_special) const {
    std::vector<int32_t> out(text.size() + 8);
    int32_t n = llama_tokenize(vocab_, text.data(), static_cast<int32_t>(text.size()), out.data(),
                               static_cast<int32_t>(out.size()), add_special, parse_special);
    if (n < 0) {  // the buffer was short; -n is the size needed
        out.resize(-n);
        n = llama_tokenize(vocab_, text.data(), static_cast<int32_t>(text.size()), out.data(),
                           static_cast<int32_t>(out.size()), add_special, parse_special);
    }
    if (n < 0) throw std::runtime_error("tokenization failed");
    out.resize(n);
    return out;
}

std::string Vocab::token_to_piece(int32_t token, bool special) const {
    if (token < 0 || token >= n_tokens()) throw std::invalid_argument("token id " + std::to_string(token) + " out of range");
    char buf[256];
    int32_t n = llama_token_to_piece(vocab_, token, buf, sizeof(buf), 0, special);
    if (n >= 0) return std::string(buf, n);
    std::string big(-n, '\0');
    n = llama_token_to_piece(vocab_, token, big.data(), static_cast<int32_t>(big.size()), 0, special);
    big.resize(std::max(n, 0));
    return big;
}

std::string Vocab::detokenize(const std::vector<int32_t>& tokens, bool special) const {
    for (int32_t t : tokens)
        if (t < 0 || t >= n_tokens()) throw std::invalid_argument("token id " + std::to_string(t) + " out of range");
    std::string out(tokens.size() * 8 + 16, '\0');
    int32_t n = llama_detokenize(vocab_, tokens.data(), static_cast<int32_t>(tokens.size()), out.data(),
                                 static_cast<int32_t>(out.size()), /*remove_special=*/false, /*unparse_special=*/special);
    if (n < 0) {
        out.resize(-n);
        n = llama_detokenize(vocab_, tokens.data(), static_cast<int32_t>(tokens.size()), out.data(),
                             static_cast<int32_t>(out.size()), /*remove_special=*/false, /*unparse_special=*/special);
    }
    out.resize(std::max(n, 0));
    return out;
}

int Vocab::n_tokens() const { return llama_vocab_n_tokens(vocab_); }
int32_t Vocab::bos() const { return llama_vocab_bos(vocab_); }
int32_t Vocab::eos() const { return llama_vocab_eos(vocab_); }
bool Vocab::is_eog(int32_t token) const { return llama_vocab_is_eog(vocab_, token); }
bool Vocab::add_bos() const { return llama_vocab_get_add_bos(vocab_); }

std::string Vocab::chat_template() const {
    const char* t = llama_model_chat_template(model_, nullptr);
    return t ? t : "";
}

std::string Vocab::meta(const std::string& key) const {
    char buf[512];
    int32_t n = llama_model_meta_val_str(model_, key.c_str(), buf, sizeof(buf));
    if (n < 0) return "";
    if (n < static_cast<int32_t>(sizeof(buf))) return std::string(buf, n);
    std::string big(n + 1, '\0');
    llama_model_meta_val_str(model_, key.c_str(), big.data(), big.size());
    big.resize(n);
    return big;
}

}  // namespace river
