#include "file_map.h"

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>

#ifdef _WIN32
#ifndef WIN32_LEAN_AND_MEAN
#define WIN32_LEAN_AND_MEAN
#endif
#ifndef NOMINMAX
#define NOMINMAX
#endif
#include <windows.h>
#else
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#endif

namespace river {

namespace {

std::string quoted(const std::string& path) { return "'" + path + "'"; }

#ifdef _WIN32

// Paths arrive as UTF-8 (from Python str); the W functions take UTF-16, so names outside the
// ANSI code page still open.
std::wstring widen(const std::string& s) {
    if (s.empty()) return {};
    const int n = MultiByteToWideChar(CP_UTF8, MB_ERR_INVALID_CHARS, s.data(), int(s.size()), nullptr, 0);
    if (n <= 0) throw FileMapError("path " + quoted(s) + " is not valid UTF-8");
    std::wstring w(size_t(n), L'\0');
    MultiByteToWideChar(CP_UTF8, MB_ERR_INVALID_CHARS, s.data(), int(s.size()), &w[0], n);
    return w;
}

std::string last_error() {
    const DWORD code = GetLastError();
    char* text = nullptr;
    const DWORD n = FormatMessageA(FORMAT_MESSAGE_ALLOCATE_BUFFER | FORMAT_MESSAGE_FROM_SYSTEM |
                                       FORMAT_MESSAGE_IGNORE_INSERTS,
                                   nullptr, code, 0, reinterpret_cast<LPSTR>(&text), 0, nullptr);
    std::string msg = n && text ? std::string(text, n) : "error " + std::to_string(code);
    if (text) LocalFree(text);
    while (!msg.empty() && (msg.back() == '\n' || msg.back() == '\r' || msg.back() == '.')) msg.pop_back();
    return msg;
}

// An open file, closed on every exit path.
class OpenFile {
public:
    explicit OpenFile(const std::string& path) : path_(path) {
        // Sharing read and delete: others may read the model meanwhile, as with POSIX files.
        h_ = CreateFileW(widen(path).c_str(), GENERIC_READ, FILE_SHARE_READ | FILE_SHARE_DELETE, nullptr,
                         OPEN_EXISTING, FILE_ATTRIBUTE_NORMAL, nullptr);
        if (h_ == INVALID_HANDLE_VALUE) throw FileMapError("cannot open " + quoted(path) + ": " + last_error());
    }
    ~OpenFile() { CloseHandle(h_); }
    OpenFile(const OpenFile&) = delete;
    OpenFile& operator=(const OpenFile&) = delete;

    size_t regular_size() const {
        // A directory does not open without FILE_FLAG_BACKUP_SEMANTICS; pipes and devices do.
        if (GetFileType(h_) != FILE_TYPE_DISK) throw FileMapError(quoted(path_) + " is not a regular file");
        LARGE_INTEGER size;
        if (!GetFileSizeEx(h_, &size)) throw FileMapError("cannot size " + quoted(path_) + ": " + last_error());
#if SIZE_MAX < UINT64_MAX
        if (uint64_t(size.QuadPart) > uint64_t(SIZE_MAX)) throw FileMapError(quoted(path_) + " is too large to load");
#endif
        return size_t(size.QuadPart);
    }

    // nullptr when the system refuses; the view keeps the mapping object alive by itself.
    void* map(size_t) const {
        HANDLE mapping = CreateFileMappingW(h_, nullptr, PAGE_READONLY, 0, 0, nullptr);
        if (!mapping) return nullptr;
        void* addr = MapViewOfFile(mapping, FILE_MAP_READ, 0, 0, 0);
        CloseHandle(mapping);
        return addr;
    }

    void read(void* dst, size_t n) const {
        char* p = static_cast<char*>(dst);
        while (n > 0) {
            const DWORD want = DWORD(n < (size_t(1) << 30) ? n : (size_t(1) << 30));  // ReadFile counts in DWORDs
            DWORD got = 0;
            if (!ReadFile(h_, p, want, &got, nullptr)) {
                throw FileMapError("cannot read " + quoted(path_) + ": " + last_error());
            }
            if (got == 0) throw FileMapError("cannot read " + quoted(path_) + ": it shrank while being read");
            p += got;
            n -= got;
        }
    }

private:
    std::string path_;
    HANDLE h_ = INVALID_HANDLE_VALUE;
};

void unmap(void* addr, size_t) { UnmapViewOfFile(addr); }

#else

class OpenFile {
public:
    explicit OpenFile(const std::string& path) : path_(path) {
        // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer; it does
        // not change how a regular file reads.
        fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
        if (fd_ < 0) throw FileMapError("cannot open " + quoted(path) + ": " + std::strerror(errno));
    }
    ~OpenFile() { ::close(fd_); }
    OpenFile(const OpenFile&) = delete;
    OpenFile& operator=(const OpenFile&) = delete;

    size_t regular_size() const {
        struct stat st {};
        if (::fstat(fd_, &st) != 0) throw FileMapError("cannot stat " + quoted(path_) + ": " + std::strerror(errno));
        if (!S_ISREG(st.st_mode)) throw FileMapError(quoted(path_) + " is not a regular file");
        return size_t(st.st_size);
    }

    void* map(size_t size) const {
        // Shared and read-only: pages come from the page cache, shared with other processes
        // that load the same model.
        void* addr = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd_, 0);
        return addr == MAP_FAILED ? nullptr : addr;
    }

    void read(void* dst, size_t n) const {
        char* p = static_cast<char*>(dst);
        off_t offset = 0;
        while (n > 0) {
            const size_t want = n < (size_t(1) << 30) ? n : (size_t(1) << 30);
            const ssize_t got = ::pread(fd_, p, want, offset);
            if (got < 0 && errno == EINTR) continue;
            if (got < 0) throw FileMapError("cannot read " + quoted(path_) + ": " + std::strerror(errno));
            if (got == 0) throw FileMapError("cannot read " + quoted(path_) + ": it shrank while being read");
            p += got;
            offset += got;
            n -= size_t(got);
        }
    }

private:
    std::string path_;
    int fd_ = -1;
};

void unmap(void* addr, size_t size) { ::munmap(addr, size); }

#endif

}  // namespace

FileMap::FileMap(const std::string& path, bool try_map) {
    OpenFile file(path);
    size_ = file.regular_size();
    if (size_ == 0) return;  // nothing to map (mmap refuses length 0), nothing to read
    if (try_map) {
        data_ = file.map(size_);
        mapped_ = data_ != nullptr;
        if (mapped_) return;
    }
    // The fallback: an aligned copy. Freed here if the read fails, since no destructor runs.
    data_ = ::operator new(size_, std::align_val_t(kAlignment));
    try {
        file.read(data_, size_);
    } catch (...) {
        ::operator delete(data_, std::align_val_t(kAlignment));
        data_ = nullptr;
        throw;
    }
}

FileMap::~FileMap() {
    if (!data_) return;
    if (mapped_) unmap(data_, size_);
    else ::operator delete(data_, std::align_val_t(kAlignment));
}

size_t FileMap::regular_file_size(const std::string& path) { return OpenFile(path).regular_size(); }

bool FileMap::disabled_by_env() {
    const char* v = std::getenv("RIVER_GGUF_NO_MMAP");
    return v && *v && std::strcmp(v, "0") != 0;
}

}  // namespace river
