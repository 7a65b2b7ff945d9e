// Tokenizer and detokenizer: llama.cpp's own vocabulary, loaded vocab-only through libllama.
#pragma once
#include <string>
#include <vector>

struct llama_model;
struct llama_vocab;

namespace river {

// Checks what libllama's vocabulary loader asserts on or crashes over, before it sees the
// file: a supported tokenizer model, a token list of strings, no token with a NUL byte and no
// duplicate tokens. Throws GgufFormatError (UnsupportedModelError for another tokenizer).
void check_vocabulary(const std::string& path);

class Vocab {
public:
    explicit Vocab(const std::string& path);
    ~Vocab();
    Vocab(const Vocab&) = delete;
    Vocab& operator=(const Vocab&) = delete;

    std::vector<int32_t> tokenize(const std::string& text, bool add_special, bool parse_special) const;
    std::string token_to_piece(int32_t token, bool special) const;
    std::string detokenize(const std::vector<int32_t>& tokens, bool special) const;
    int n_tokens() const;
    int32_t bos() const;
    int32_t eos() const;
    bool is_eog(int32_t token) const;
    std::vector<int32_t> eog_tokens() const;  // every end-of-generation token, ascending
    bool add_bos() const;
    std::string chat_template() const;
    std::string meta(const std::string& key) const;

private:
    std::vector<int32_t> tokenize_unguarded(const std::string& text, bool add_special, bool parse_special) const;

    std::string path_;
    llama_model* model_ = nullptr;
    const llama_vocab* vocab_ = nullptr;
};

}  // namespace river
