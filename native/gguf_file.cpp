#include "gguf_file.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "errors.h"
#include "ggml-cpu.h"

namespace river {

namespace {

void check_magic(const std::string& path, size_t file_size) {
    FILE* f = ggml_fopen(path.c_str(), "rb");  // UTF-8 paths on Windows too
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

GgufFile::GgufFile(const std::string& path, bool use_mmap) : path_(path) {
    // Checked before anything opens the file for reading: a FIFO would block a reader.
    size_t file_size = 0;
    try {
        file_size = FileMap::regular_file_size(path);
    } catch (const FileMapError& e) {
        throw GgufFormatError(e.what());
    }
    check_magic(path, file_size);

    // Each resource is released by release() if anything below throws: no destructor runs
    // for an object whose constructor did not finish.
    try {
        gguf_init_params params{/*no_alloc=*/true, /*ctx=*/&tensors_};
        gguf_ = gguf_init_from_file(path.c_str(), params);
        if (!gguf_) {
            throw GgufFormatError("'" + path + "' is a corrupt or truncated GGUF (its header could not be read)");
        }
        // The header was parsed without the data, so the file's bytes come only now; a
        // mapping costs nothing until pages are touched, a read copy costs the whole file.
        try {
            map_ = std::make_unique<FileMap>(path, use_mmap && !FileMap::disabled_by_env());
        } catch (const FileMapError& e) {
            throw GgufFormatError(e.what());
        }
        const size_t size = map_->size();

        // The header parses without touching tensor data, so a cut-off file only shows here.
        const size_t data_offset = gguf_get_data_offset(gguf_);
        const int64_t n_tensors = gguf_get_n_tensors(gguf_);
        for (int64_t i = 0; i < n_tensors; ++i) {
            const size_t off = gguf_get_tensor_offset(gguf_, i), bytes = gguf_get_tensor_size(gguf_, i);
            // Compared without sums that could wrap around.
            if (data_offset > size || off > size - data_offset || bytes > size - data_offset - off) {
                throw GgufFormatError("'" + path + "' is truncated: tensor '" + gguf_get_tensor_name(gguf_, i) +
                                      "' ends at byte " + std::to_string(data_offset + off + bytes) +
                                      " but the file has " + std::to_string(size) + " bytes");
            }
        }

        // The CPU backend never writes to weights, so a read-only mapping is safe here.
        buffer_ = ggml_backend_cpu_buffer_from_ptr(map_->data(), size);
        if (!buffer_) throw std::runtime_error("cannot wrap '" + path + "' in a ggml CPU buffer");
        ggml_backend_buffer_set_usage(buffer_, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
        for (int64_t i = 0; i < n_tensors; ++i) {
            ggml_tensor* t = ggml_get_tensor(tensors_, gguf_get_tensor_name(gguf_, i));
            char* addr = static_cast<char*>(map_->data()) + data_offset + gguf_get_tensor_offset(gguf_, i);
            ggml_backend_tensor_alloc(buffer_, t, addr);
        }
        load_river_index();
    } catch (...) {
        release();
        throw;
    }
}

GgufFile::~GgufFile() { release(); }

void GgufFile::release() {
    // The buffer only wraps the bytes, so it goes before them.
    if (buffer_) ggml_backend_buffer_free(buffer_);
    map_.reset();
    if (tensors_) ggml_free(tensors_);
    if (river_tensors_) ggml_free(river_tensors_);
    if (gguf_) gguf_free(gguf_);
    buffer_ = nullptr;
    tensors_ = nullptr;
    river_tensors_ = nullptr;
    gguf_ = nullptr;
}

ggml_tensor* GgufFile::tensor(const std::string& name) const {
    ggml_tensor* t = ggml_get_tensor(tensors_, name.c_str());
    if (!t && river_tensors_) t = ggml_get_tensor(river_tensors_, name.c_str());
    return t;
}

std::vector<std::string> GgufFile::tensor_names() const {
    std::vector<std::string> names;
    for (int64_t i = 0; i < gguf_get_n_tensors(gguf_); ++i) names.emplace_back(gguf_get_tensor_name(gguf_, i));
    if (river_tensors_) {
        for (ggml_tensor* t = ggml_get_first_tensor(river_tensors_); t; t = ggml_get_next_tensor(river_tensors_, t)) {
            names.emplace_back(ggml_get_name(t));
        }
    }
    return names;
}

namespace {

constexpr int64_t kRiverFormat = 2;

// An array key of one integer type, element type checked before any element is read.
template <typename T>
const T* typed_array(gguf_context* g, const std::string& key, gguf_type want, size_t n, const std::string& path) {
    const int64_t id = gguf_find_key(g, key.c_str());
    if (id < 0) throw GgufFormatError("'" + path + "' is a River GGUF of format 2 without '" + key + "'");
    if (gguf_get_kv_type(g, id) != GGUF_TYPE_ARRAY || gguf_get_arr_type(g, id) != want) {
        throw GgufFormatError("GGUF key '" + key + "' is not an array of " + gguf_type_name(want));
    }
    if (gguf_get_arr_n(g, id) != n) throw GgufFormatError("GGUF key '" + key + "' has the wrong length for the river index");
    return static_cast<const T*>(gguf_get_arr_data(g, id));
}

}  // namespace

void GgufFile::load_river_index() {
    const int64_t names_id = gguf_find_key(gguf_, "river.tensor_names");
    const int64_t version = get_int("river.format_version", names_id >= 0 ? kRiverFormat : 1);
    if (version > kRiverFormat) {
        throw GgufFormatError("'" + path_ + "' is a River GGUF of format " + std::to_string(version) +
                              "; this river_gguf reads formats 1 and 2 (upgrade river_gguf)");
    }
    if (version < kRiverFormat) return;  // format 1 lists the river in the GGUF index
    if (names_id < 0) throw GgufFormatError("'" + path_ + "' is a River GGUF of format 2 without 'river.tensor_names'");
    if (gguf_get_kv_type(gguf_, names_id) != GGUF_TYPE_ARRAY || gguf_get_arr_type(gguf_, names_id) != GGUF_TYPE_STRING) {
        throw GgufFormatError("GGUF key 'river.tensor_names' is not an array of strings");
    }
    const size_t n = gguf_get_arr_n(gguf_, names_id);
    const auto* types = typed_array<uint32_t>(gguf_, "river.tensor_types", GGUF_TYPE_UINT32, n, path_);
    const auto* shapes = typed_array<uint64_t>(gguf_, "river.tensor_shapes", GGUF_TYPE_UINT64, 4 * n, path_);
    const auto* offsets = typed_array<uint64_t>(gguf_, "river.tensor_offsets", GGUF_TYPE_UINT64, n, path_);
    const int64_t data_size = get_int("river.data_size", -1);
    if (data_size < 0) throw GgufFormatError("'" + path_ + "' is a River GGUF of format 2 without 'river.data_size'");

    // The river's data starts at the first aligned offset after the backbone's last tensor.
    const size_t align = gguf_get_alignment(gguf_);
    size_t end = gguf_get_data_offset(gguf_);
    for (int64_t i = 0; i < gguf_get_n_tensors(gguf_); ++i) {
        end = std::max(end, gguf_get_data_offset(gguf_) + gguf_get_tensor_offset(gguf_, i) + gguf_get_tensor_size(gguf_, i));
    }
    const size_t start = (end + align - 1) / align * align;
    const size_t size = map_->size();
    if (start > size || uint64_t(data_size) > size - start) {
        throw GgufFormatError("'" + path_ + "' is truncated: its river data (" + std::to_string(data_size) +
                              " bytes at " + std::to_string(start) + ") runs past the end of the file (" +
                              std::to_string(size) + " bytes)");
    }

    ggml_init_params params{ggml_tensor_overhead() * (n + 1), nullptr, /*no_alloc=*/true};
    river_tensors_ = ggml_init(params);
    if (!river_tensors_) throw std::runtime_error("out of memory for the river index");
    for (size_t i = 0; i < n; ++i) {
        const std::string name = gguf_get_arr_str(gguf_, names_id, i);
        const std::string what = "river tensor '" + name + "' in '" + path_ + "'";
        if (name.empty() || name.size() >= GGML_MAX_NAME) throw GgufFormatError(what + ": bad name length");
        if (tensor(name)) throw GgufFormatError(what + " is listed twice");
        if (types[i] >= GGML_TYPE_COUNT || ggml_type_size(ggml_type(types[i])) == 0 || ggml_blck_size(ggml_type(types[i])) <= 0) {
            throw GgufFormatError(what + " has an unknown type " + std::to_string(types[i]));
        }
        const ggml_type type = ggml_type(types[i]);
        int64_t ne[4];
        for (int d = 0; d < 4; ++d) {
            const uint64_t v = shapes[4 * i + d];
            if (v < 1 || v > (uint64_t(1) << 40)) throw GgufFormatError(what + " has a bad shape");
            ne[d] = int64_t(v);
        }
        if (ne[0] % ggml_blck_size(type) != 0) throw GgufFormatError(what + " has a row length its type cannot hold");
        ggml_tensor* t = ggml_new_tensor(river_tensors_, type, 4, ne);
        ggml_set_name(t, name.c_str());
        const size_t bytes = ggml_nbytes(t);
        if (offsets[i] > uint64_t(data_size) || bytes > uint64_t(data_size) - offsets[i] || offsets[i] % align != 0) {
            throw GgufFormatError(what + " lies outside the river data or is misaligned");
        }
        ggml_backend_tensor_alloc(buffer_, t, static_cast<char*>(map_->data()) + start + offsets[i]);
    }
}

bool GgufFile::has_key(const std::string& key) const { return gguf_find_key(gguf_, key.c_str()) >= 0; }

std::string GgufFile::get_str(const std::string& key, const std::string& def) const {
    const int64_t id = gguf_find_key(gguf_, key.c_str());
    if (id < 0) return def;
    if (gguf_get_kv_type(gguf_, id) != GGUF_TYPE_STRING) throw GgufFormatError("GGUF key '" + key + "' is not a string");
    return gguf_get_val_str(gguf_, id);
}

// The key's type, for messages: "of type str", "an array of f32", ...
static std::string type_phrase(gguf_context* g, int64_t id) {
    auto name = [](gguf_type t) {
        const char* n = gguf_type_name(t);
        return std::string(n ? n : "?");
    };
    const gguf_type t = gguf_get_kv_type(g, id);
    if (t == GGUF_TYPE_ARRAY) return "an array of " + name(gguf_get_arr_type(g, id));
    return "of type " + name(t);
}

static int64_t int_value(gguf_context* g, int64_t id, const std::string& key) {
    switch (gguf_get_kv_type(g, id)) {
        case GGUF_TYPE_UINT8: return gguf_get_val_u8(g, id);
        case GGUF_TYPE_INT8: return gguf_get_val_i8(g, id);
        case GGUF_TYPE_UINT16: return gguf_get_val_u16(g, id);
        case GGUF_TYPE_INT16: return gguf_get_val_i16(g, id);
        case GGUF_TYPE_UINT32: return gguf_get_val_u32(g, id);
        case GGUF_TYPE_INT32: return gguf_get_val_i32(g, id);
        case GGUF_TYPE_UINT64: {
            const uint64_t v = gguf_get_val_u64(g, id);
            if (v > uint64_t(INT64_MAX)) throw GgufFormatError("GGUF key '" + key + "' = " + std::to_string(v) + " is out of range");
            return static_cast<int64_t>(v);
        }
        case GGUF_TYPE_INT64: return gguf_get_val_i64(g, id);
        case GGUF_TYPE_BOOL: return gguf_get_val_bool(g, id) ? 1 : 0;
        default: throw GgufFormatError("GGUF key '" + key + "' is " + type_phrase(g, id) + ", expected an integer");
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
        case GGUF_TYPE_STRING:
        case GGUF_TYPE_ARRAY:
        case GGUF_TYPE_BOOL:
            throw GgufFormatError("GGUF key '" + key + "' is " + type_phrase(gguf_, id) + ", expected a number");
        default: return static_cast<float>(int_value(gguf_, id, key));
    }
}

std::vector<int64_t> GgufFile::get_int_array(const std::string& key) const {
    const int64_t id = gguf_find_key(gguf_, key.c_str());
    if (id < 0) return {};
    if (gguf_get_kv_type(gguf_, id) != GGUF_TYPE_ARRAY) return {int_value(gguf_, id, key)};
    // The element type is checked before any element is read: gguf aborts when the data of
    // a string array is asked for.
    const gguf_type type = gguf_get_arr_type(gguf_, id);
    const size_t n = gguf_get_arr_n(gguf_, id);
    if (n == 0) throw GgufFormatError("GGUF key '" + key + "' is an empty array");
    auto read = [&](auto* typed) {
        std::vector<int64_t> out(n);
        for (size_t i = 0; i < n; ++i) out[i] = static_cast<int64_t>(typed[i]);
        return out;
    };
    const void* data = nullptr;
    switch (type) {
        case GGUF_TYPE_UINT8: case GGUF_TYPE_INT8: case GGUF_TYPE_UINT16: case GGUF_TYPE_INT16:
        case GGUF_TYPE_UINT32: case GGUF_TYPE_INT32: case GGUF_TYPE_UINT64: case GGUF_TYPE_INT64:
            data = gguf_get_arr_data(gguf_, id);
            break;
        default:
            throw GgufFormatError("GGUF key '" + key + "' is " + type_phrase(gguf_, id) + ", expected integers");
    }
    switch (type) {
        case GGUF_TYPE_UINT8: return read(static_cast<const uint8_t*>(data));
        case GGUF_TYPE_INT8: return read(static_cast<const int8_t*>(data));
        case GGUF_TYPE_UINT16: return read(static_cast<const uint16_t*>(data));
        case GGUF_TYPE_INT16: return read(static_cast<const int16_t*>(data));
        case GGUF_TYPE_UINT32: return read(static_cast<const uint32_t*>(data));
        case GGUF_TYPE_INT32: return read(static_cast<const int32_t*>(data));
        case GGUF_TYPE_INT64: return read(static_cast<const int64_t*>(data));
        default: {  // UINT64: values past INT64_MAX would turn negative
            const uint64_t* u = static_cast<const uint64_t*>(data);
            for (size_t i = 0; i < n; ++i) {
                if (u[i] > uint64_t(INT64_MAX)) throw GgufFormatError("GGUF key '" + key + "' holds an out-of-range value");
            }
            return read(u);
        }
    }
}

}  // namespace river
