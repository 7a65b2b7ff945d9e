// A model file's bytes in memory, read-only: mapped where the platform can (POSIX mmap,
// Windows CreateFileMapping + MapViewOfFile), else read into an owned buffer. Mapping lets the
// OS page weights in on demand and share them between processes; the read fallback serves
// file systems where mapping fails, and callers who turn mapping off.
// Standalone (no ggml), so that it compiles, and is checked, for Windows on its own.
#pragma once
#include <cstddef>
#include <stdexcept>
#include <string>

namespace river {

// The file cannot be opened, is not a regular file, or cannot be read.
struct FileMapError : std::runtime_error { using std::runtime_error::runtime_error; };

class FileMap {
public:
    // data() is aligned at least this much either way: ggml's CPU buffers need an aligned base,
    // and a GGUF aligns its tensors relative to the file's start.
    static constexpr size_t kAlignment = 4096;

    // The bytes of `path` (UTF-8): mapped when `try_map` and the platform allows it, else read.
    // Throws FileMapError, or std::bad_alloc when a read copy does not fit in memory.
    FileMap(const std::string& path, bool try_map);
    ~FileMap();
    FileMap(const FileMap&) = delete;
    FileMap& operator=(const FileMap&) = delete;

    // Writable only for ggml's sake (its CPU buffer takes a void*); a mapping is read-only,
    // and nothing writes weights.
    void* data() const { return data_; }
    size_t size() const { return size_; }
    bool mapped() const { return mapped_; }

    // The size of `path`, which must be a regular file; opens nothing for long and reads nothing.
    static size_t regular_file_size(const std::string& path);
    // RIVER_GGUF_NO_MMAP set to anything but "" or "0" turns mapping off for every load.
    static bool disabled_by_env();

private:
    void* data_ = nullptr;
    size_t size_ = 0;
    bool mapped_ = false;
};

}  // namespace river
