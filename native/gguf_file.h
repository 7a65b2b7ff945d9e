// One GGUF file: its metadata (gguf.h), its tensor descriptions, and its bytes, memory-mapped
// so that CPU weights are read in place and shared between processes (or read into memory
// where mapping fails or is turned off; see file_map.h).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "ggml.h"
#include "ggml-backend.h"
#include "file_map.h"
#include "gguf.h"

namespace river {

class GgufFile {
public:
    // use_mmap=false (or RIVER_GGUF_NO_MMAP=1) reads the file into memory instead of mapping it.
    explicit GgufFile(const std::string& path, bool use_mmap = true);  // throws GgufFormatError
    ~GgufFile();
    GgufFile(const GgufFile&) = delete;
    GgufFile& operator=(const GgufFile&) = delete;

    const std::string& path() const { return path_; }
    bool mapped() const { return map_ && map_->mapped(); }
    gguf_context* meta() const { return gguf_; }

    // Tensor by name, with its data pointing into the mapped file; nullptr if absent. A River
    // GGUF of format 2 keeps its river's tensors outside the GGUF index (so that llama.cpp
    // opens the file as the plain backbone); they are found here all the same.
    ggml_tensor* tensor(const std::string& name) const;
    std::vector<std::string> tensor_names() const;

    bool has_key(const std::string& key) const;
    std::string get_str(const std::string& key, const std::string& def = "") const;
    // Integer-valued key of any integer type; def when missing.
    int64_t get_int(const std::string& key, int64_t def) const;
    float get_float(const std::string& key, float def) const;
    // Array-or-scalar integer key, as llama.cpp allows per-layer values.
    std::vector<int64_t> get_int_array(const std::string& key) const;

private:
    void release();  // frees everything; used by the destructor and by a failing constructor
    // Format 2: the river's tensors, after the backbone's data, from the river.tensor_* index.
    void load_river_index();

    std::string path_;
    gguf_context* gguf_ = nullptr;
    ggml_context* tensors_ = nullptr;       // descriptions only; data lives in the mapping
    ggml_context* river_tensors_ = nullptr; // format 2: the river's, from the river index
    std::unique_ptr<FileMap> map_;          // the file's bytes, mapped or read
    ggml_backend_buffer_t buffer_ = nullptr; // CPU buffer over the mapping
};

}  // namespace river
