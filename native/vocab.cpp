#include "vocab.h"

#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <unordered_map>

#include "errors.h"
#include "ggml.h"
#include "gguf.h"
#include "llama.h"

namespace river {

namespace {

struct GgufFree {
    void operator()(gguf_context* g) const { gguf_free(g); }
};
struct FileClose {
    void operator()(FILE* f) const { std::fclose(f); }
};

// Reads a GGUF's key-value section straight from the file. gguf's API hands array strings
// out as C strings, which end at the first NUL byte, so a token's true bytes are only here.
class RawKvReader {
public:
    RawKvReader(const std::string& path) : path_(path), f_(ggml_fopen(path.c_str(), "rb")) {
        if (!f_) throw GgufFormatError("cannot open '" + path + "'");
    }

    // The strings of array `key`; throws if the key is absent or not an array of strings.
    std::vector<std::string> string_array(const std::string& key) {
        char magic[4];
        read(magic, 4);
        const uint32_t version = pod<uint32_t>();
        if (version < 2) fail("GGUF version " + std::to_string(version) + " is not supported");
        pod<int64_t>();  // tensor count
        const int64_t n_kv = pod<int64_t>();
        for (int64_t i = 0; i < n_kv; ++i) {
            const std::string k = str();
            const uint32_t type = pod<uint32_t>();
            if (k != key) {
                skip_value(type);
                continue;
            }
            if (type != GGUF_TYPE_ARRAY || pod<uint32_t>() != GGUF_TYPE_STRING) fail(key + " is not an array of strings");
            const uint64_t n = pod<uint64_t>();
            std::vector<std::string> out;
            out.reserve(static_cast<size_t>(std::min<uint64_t>(n, 1 << 24)));
            for (uint64_t j = 0; j < n; ++j) out.push_back(str());
            return out;
        }
        fail("it has no key " + key);
    }

private:
    [[noreturn]] void fail(const std::string& why) const {
        throw GgufFormatError("'" + path_ + "' has a corrupt vocabulary: " + why);
    }
    void read(void* p, size_t n) {
        if (n && std::fread(p, 1, n, f_.get()) != n) fail("its metadata ends early");
    }
    template <class T> T pod() {
        T v;
        read(&v, sizeof v);
        return v;
    }
    std::string str() {
        const uint64_t n = pod<uint64_t>();
        if (n > (uint64_t(1) << 32)) fail("a string of " + std::to_string(n) + " bytes");
        std::string s(static_cast<size_t>(n), '\0');
        read(s.data(), s.size());
        return s;
    }
    void skip(uint64_t n) {
        char buf[4096];
        while (n > 0) {
            const size_t step = static_cast<size_t>(std::min<uint64_t>(n, sizeof buf));
            read(buf, step);
            n -= step;
        }
    }
    static uint64_t scalar_size(uint32_t type) {
        switch (type) {
            case GGUF_TYPE_UINT8: case GGUF_TYPE_INT8: case GGUF_TYPE_BOOL: return 1;
            case GGUF_TYPE_UINT16: case GGUF_TYPE_INT16: return 2;
            case GGUF_TYPE_UINT32: case GGUF_TYPE_INT32: case GGUF_TYPE_FLOAT32: return 4;
            case GGUF_TYPE_UINT64: case GGUF_TYPE_INT64: case GGUF_TYPE_FLOAT64: return 8;
            default: return 0;
        }
    }
    void skip_value(uint32_t type) {
        if (type == GGUF_TYPE_STRING) {
            skip(pod<uint64_t>());
        } else if (type == GGUF_TYPE_ARRAY) {
            const uint32_t et = pod<uint32_t>();
            const uint64_t n = pod<uint64_t>();
            if (et == GGUF_TYPE_STRING) {
                for (uint64_t j = 0; j < n; ++j) skip(pod<uint64_t>());
            } else {
                const uint64_t size = scalar_size(et);
                if (size == 0 || n > (uint64_t(1) << 40)) fail("an array of an unknown type");
                skip(n * size);
            }
        } else {
            const uint64_t size = scalar_size(type);
            if (size == 0) fail("a value of unknown type " + std::to_string(type));
            skip(size);
        }
    }

    std::string path_;
    std::unique_ptr<FILE, FileClose> f_;
};

// A token for a message: printable ASCII kept, the rest escaped, long ones cut.
std::string shown(const std::string& s) {
    std::string out;
    for (unsigned char c : s.substr(0, 40)) {
        if (c >= 0x20 && c < 0x7f) {
            out += static_cast<char>(c);
        } else {
            char buf[8];
            std::snprintf(buf, sizeof buf, "\\x%02x", c);
            out += buf;
        }
    }
    return s.size() > 40 ? out + "..." : out;
}

}  // namespace

void check_vocabulary(const std::string& path) {
    std::unique_ptr<gguf_context, GgufFree> g(gguf_init_from_file(path.c_str(), gguf_init_params{true, nullptr}));
    if (!g) throw GgufFormatError("'" + path + "' is a corrupt or truncated GGUF (its header could not be read)");
    const std::string where = "'" + path + "': ";

    // libllama asserts on some tokenizers' missing pieces (rwkv's newline, bert's byte tokens,
    // none at all); the architectures here use SentencePiece ("llama") or byte-level BPE ("gpt2").
    const int64_t mk = gguf_find_key(g.get(), "tokenizer.ggml.model");
    if (mk < 0) throw GgufFormatError(where + "no vocabulary (no key tokenizer.ggml.model)");
    if (gguf_get_kv_type(g.get(), mk) != GGUF_TYPE_STRING) throw GgufFormatError(where + "tokenizer.ggml.model is not a string");
    const std::string model = gguf_get_val_str(g.get(), mk);
    if (model != "llama" && model != "gpt2") {
        throw UnsupportedModelError(where + "tokenizer '" + shown(model) + "' is not supported (llama, gpt2)");
    }

    const int64_t tk = gguf_find_key(g.get(), "tokenizer.ggml.tokens");
    if (tk < 0) throw GgufFormatError(where + "no vocabulary (no key tokenizer.ggml.tokens)");
    if (gguf_get_kv_type(g.get(), tk) != GGUF_TYPE_ARRAY || gguf_get_arr_type(g.get(), tk) != GGUF_TYPE_STRING) {
        throw GgufFormatError(where + "tokenizer.ggml.tokens is not an array of strings");
    }
    const size_t n = gguf_get_arr_n(g.get(), tk);
    if (n == 0 || n > size_t(INT32_MAX)) throw GgufFormatError(where + "tokenizer.ggml.tokens holds " + std::to_string(n) + " tokens");

    const std::vector<std::string> tokens = RawKvReader(path).string_array("tokenizer.ggml.tokens");
    if (tokens.size() != n) throw GgufFormatError(where + "tokenizer.ggml.tokens could not be read consistently");
    // libllama maps each token's text to its id and asserts that no two share one; it reads
    // texts up to a NUL byte and renames empty ones "[EMPTY_<id>]", so those are compared too.
    std::unordered_map<std::string, size_t> seen;
    seen.reserve(n);
    for (size_t i = 0; i < n; ++i) {
        const std::string& t = tokens[i];
        if (std::memchr(t.data(), '\0', t.size())) {
            throw GgufFormatError(where + "token " + std::to_string(i) + " ('" + shown(t) +
                                  "') of tokenizer.ggml.tokens contains a NUL byte");
        }
        const std::string key = t.empty() ? "[EMPTY_" + std::to_string(i) + "]" : t;
        auto [it, fresh] = seen.emplace(key, i);
        if (!fresh) {
            throw GgufFormatError(where + "token " + std::to_string(i) + " ('" + shown(key) +
                                  "') of tokenizer.ggml.tokens repeats token " + std::to_string(it->second));
        }
    }
    // libllama's SentencePiece tokenizer spells text its pieces do not cover in byte tokens,
    // and throws across its C API (aborting the process) for a byte that has none: neither
    // "<0xXX>" nor the byte itself. Byte-level BPE ("gpt2") maps every byte to a piece.
    if (model == "llama") {
        for (int b = 0; b < 256; ++b) {
            char hex[8];
            std::snprintf(hex, sizeof hex, "<0x%02X>", b);
            if (seen.count(hex) || seen.count(std::string(1, char(b)))) continue;
            throw GgufFormatError(where + "a SentencePiece vocabulary (tokenizer.ggml.model 'llama') with no token for byte " +
                                  hex + " (neither '" + hex + "' nor the byte itself), which its tokenizer falls back to");
        }
    }
}

Vocab::Vocab(const std::string& path) : path_(path) {
    check_vocabulary(path);
    static std::once_flag once;
    std::call_once(once, [] { llama_backend_init(); });
    llama_model_params params = llama_model_default_params();
    params.vocab_only = true;
    model_ = llama_model_load_from_file(path.c_str(), params);
    if (!model_) throw GgufFormatError("llama.cpp could not load the vocabulary of '" + path + "'");
    vocab_ = llama_model_get_vocab(model_);
    // Tokenizing asserts that the special tokens the vocabulary says it adds exist.
    auto require = [&](bool adds, int32_t id, const char* what, const char* key) {
        if (adds && id == LLAMA_TOKEN_NULL) {
            llama_model_free(model_);
            throw GgufFormatError("the vocabulary of '" + path + "' adds a " + what + " token but has none (" + key + ")");
        }
    };
    require(llama_vocab_get_add_bos(vocab_), llama_vocab_bos(vocab_), "BOS", "tokenizer.ggml.bos_token_id");
    require(llama_vocab_get_add_eos(vocab_), llama_vocab_eos(vocab_), "EOS", "tokenizer.ggml.eos_token_id");
    require(llama_vocab_get_add_sep(vocab_), llama_vocab_sep(vocab_), "separator", "tokenizer.ggml.seperator_token_id");
}

Vocab::~Vocab() {
    if (model_) llama_model_free(model_);
}

namespace {

// libllama throws from inside tokenization when the vocabulary lacks what its tokenizer
// needs (e.g. a SentencePiece vocabulary without byte tokens); that is a defect of the file.
template <class F>
auto guarded(const std::string& path, F&& f) {
    try {
        return f();
    } catch (const std::exception& e) {
        throw GgufFormatError("the vocabulary of '" + path + "' is broken: " + e.what());
    }
}

}  // namespace

std::vector<int32_t> Vocab::tokenize(const std::string& text, bool add_special, bool parse_special) const {
    return guarded(path_, [&] { return tokenize_unguarded(text, add_special, parse_special); });
}

std::vector<int32_t> Vocab::tokenize_unguarded(const std::string& text, bool add_special, bool parse_special) const {
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
    return guarded(path_, [&] {
        char buf[256];
        int32_t n = llama_token_to_piece(vocab_, token, buf, sizeof(buf), 0, special);
        if (n >= 0) return std::string(buf, n);
        std::string big(-n, '\0');
        n = llama_token_to_piece(vocab_, token, big.data(), static_cast<int32_t>(big.size()), 0, special);
        big.resize(std::max(n, 0));
        return big;
    });
}

std::string Vocab::detokenize(const std::vector<int32_t>& tokens, bool special) const {
    for (int32_t t : tokens)
        if (t < 0 || t >= n_tokens()) throw std::invalid_argument("token id " + std::to_string(t) + " out of range");
    return guarded(path_, [&] {
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
    });
}

int Vocab::n_tokens() const { return llama_vocab_n_tokens(vocab_); }
int32_t Vocab::bos() const { return llama_vocab_bos(vocab_); }
int32_t Vocab::eos() const { return llama_vocab_eos(vocab_); }
bool Vocab::is_eog(int32_t token) const { return llama_vocab_is_eog(vocab_, token); }

std::vector<int32_t> Vocab::eog_tokens() const {
    std::vector<int32_t> out;
    for (int32_t t = 0, n = n_tokens(); t < n; ++t) if (llama_vocab_is_eog(vocab_, t)) out.push_back(t);
    return out;
}
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
