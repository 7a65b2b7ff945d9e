#include "gguf_file.h"

#include <cstdio>
#include <cstring>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "errors.h"
#include "ggml-cpu.h"

namespace river {

namespace {

void check_magic(const std::string& path, size_t file_size) {
    FILE* f = std::fopen(path.c_str(), "rb");
    if (!f) throw GgufFormatError("cannot open '" + path + "': " + std::strerror(errno));
    char magic[4] = {0, 0, 0, 0};
    size_t got = std::fread(magic, 1, 4, f);
    std::fclose(f);
    if (got != 4 || std::memcmp(magic, "GGUF", 4) != 0) {
        throw GgufFormatError("'" + path + "' is not a GGUF file (" + std::to_string(file_size) +
                              " bytes, no GGUF magic)");
    }
}

}  // namespace

GgufFile::GgufFile(const std::string& path) : path_(path) {
    struct stat st{};
    if (::stat(path.c_str(), &st) != 0) throw GgufFormatError("cannot open '" + path + "': " + std::strerror(errno));
    if (!S_ISREG(st.st_mode)) throw GgufFormatError("'" + path + "' is not a regular file");
    const size_t file_size = static_cast<size_t>(st.st_size);
    check_magic(path, file_size);

    gguf_init_params params{/*no_alloc=*/true, /*ctx=*/&tensors_};
    gguf_ = gguf_init_from_file(path.c_str(), params);
    if (!gguf_) throw GgufFormatError("'" + path + "' is a corrupt or truncated GGUF (its header could not be read)");

    // The header parses without touching tensor data, so a cut-off file only shows here.
    const size_t data_offset = gguf_get_data_offset(gguf_);
    const int64_t n_tensors = gguf_get_n_tensors(gguf_);
    for (int64_t i = 0; i < n_tensors; ++i) {
        const char* name = gguf_get_tensor_name(gguf_, i);
        const size_t end = data_offset + gguf_get_tensor_offset(gguf_, i) + gguf_get_tensor_size(gguf_, i);
        if (end > file_size) {
            // Build the message before freeing: `name` points into the gguf context.
            std::string msg = "'" + path + "' is truncated: tensor '" + name + "' ends at byte " +
                              std::to_string(end) + " but the file has " + std::to_string(file_size) + " bytes";
            release();
            throw GgufFormatError(msg);
        }
    }

    int fd = ::open(path.c_str(), O_RDONLY);
    if (fd < 0) {
        std::string msg = "cannot open '" + path + "': " + std::strerror(errno);
        release();
        throw GgufFormatError(msg);
    }
    map_size_ = file_size;
    map_ = ::mmap(nullptr, map_size_, PROT_READ, MAP_SHARED, fd, 0);
    ::close(fd);
    if (map_ == MAP_FAILED) {
        map_ = nullptr;
        release();
        throw GgufFormatError("cannot mmap '" + path + "'");
    }
    // The CPU backend never writes to weights, so a read-only mapping is safe here.
    buffer_ = ggml_backend_cpu_buffer_from_ptr(map_, map_size_);
    ggml_backend_buffer_set_usage(buffer_, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    for (int64_t i = 0; i < n_tensors; ++i) {
        ggml_tensor* t = ggml_get_tensor(tensors_, gguf_get_tensor_name(gguf_, i));
        char* addr = static_cast<char*>(map_) + data_offset + gguf_get_tensor_offset(gguf_, i);
        ggml_backend_tensor_alloc(buffer_, t, addr);
    }
}

GgufFile::~GgufFile() { release(); }

void GgufFile::release() {
    if (buffer_) ggml_backend_buffer_free(buffer_);
    if (map_) ::munmap(map_, map_size_);
    if (tensors_) ggml_free(tensors_);
    if (gguf_) gguf_free(gguf_);
    buffer_ = nullptr;
    map_ = nullptr;
    tensors_ = nullptr;
    gguf_ = nullptr;
}

ggml_tensor* GgufFile::tensor(const std::string& name) const {
    return ggml_get_tensor(tensors_, name.c_str());
}

std::vector<std::string> GgufFile::tensor_names() const {
    std::vector<std::string> names;
    for (int64_t i = 0; i < gguf_get_n_tensors(gguf_); ++i) names.emplace_back(gguf_get_tensor_name(gguf_, i));
    return names;
}

bool GgufFile::has_key(const std::string& key) const { return gguf_find_key(gguf_, key.c_str()) >= 0; }

std::string GgufFile::get_str(const std::string& key, const std::string& def) const {
    const int64_t id = gguf_find_key(gguf_, key.c_str());
    if (id < 0) return def;
    if (gguf_get_kv_type(gguf_, id) != GGUF_TYPE_STRING) throw GgufFormatError("GGUF key '" + key + "' is not a string");
    return gguf_get_val_str(gguf_, id);
}

static int64_t int_value(gguf_context* g, int64_t id, const std::string& key) {
    switch (gguf_get_kv_type(g, id)) {
        case GGUF_TYPE_UINT8: return gguf_get_val_u8(g, id);
        case GGUF_TYPE_INT8: return gguf_get_val_i8(g, id);
        case GGUF_TYPE_UINT16: return gguf_get_val_u16(g, id);
        case GGUF_TYPE_INT16: return gguf_get_val_i16(g, id);
        case GGUF_TYPE_UINT32: return gguf_get_val_u32(g, id);
        case GGUF_TYPE_INT32: return gguf_get_val_i32(g, id);
        case GGUF_TYPE_UINT64: return static_cast<int64_t>(gguf_get_val_u64(g, id));
        case GGUF_TYPE_INT64: return gguf_get_val_i64(g, id);
        case GGUF_TYPE_BOOL: return gguf_get_val_bool(g, id) ? 1 : 0;
        default: throw GgufFormatError("GGUF key '" + key + "' is not an integer");
    }
}

int64_t GgufFile::get_int(const std::string& key, int64_t def) const {
    const int64_t id = gguf_find_key(gguf_, key.c_str());
    return id < 0 ? def : int_value(gguf_, id, key);
}

float GgufFile::get_float(const std::string& key, float def) const {
    const int64_t id = gguf_find_key(gguf_, key.c_str());
    if (id < 0) return def;
    switch (gguf_get_kv_type(gguf_, id)) {
        case GGUF_TYPE_FLOAT32: return gguf_get_val_f32(gguf_, id);
        case GGUF_TYPE_FLOAT64: return static_cast<float>(gguf_get_val_f64(gguf_, id));
        default: return static_cast<float>(int_value(gguf_, id, key));
    }
}

std::vector<int64_t> GgufFile::get_int_array(const std::string& key) const {
    const int64_t id = gguf_find_key(gguf_, key.c_str());
    if (id < 0) return {};
    if (gguf_get_kv_type(gguf_, id) != GGUF_TYPE_ARRAY) return {int_value(gguf_, id, key)};
    const size_t n = gguf_get_arr_n(gguf_, id);
    const void* data = gguf_get_arr_data(gguf_, id);
    std::vector<int64_t> out(n);
    switch (gguf_get_arr_type(gguf_, id)) {
        case GGUF_TYPE_INT32: for (size_t i = 0; i < n; ++i) out[i] = static_cast<const int32_t*>(data)[i]; break;
        case GGUF_TYPE_UINT32: for (size_t i = 0; i < n; ++i) out[i] = static_cast<const uint32_t*>(data)[i]; break;
        default: throw GgufFormatError("GGUF key '" + key + "' is an array of an unsupported type");
    }
    return out;
}

}  // namespace river
