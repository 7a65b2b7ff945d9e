#!/usr/bin/env bash
# Compiles the file-mapping layer (native/file_map.cpp: CreateFileMapping + MapViewOfFile, and
# the read fallback) for 64-bit Windows with a MinGW-w64 cross compiler, when one is installed
# (Debian: apt-get install g++-mingw-w64-x86-64). It needs no ggml, so it compiles on its own;
# a small driver is linked with it, so that every Windows symbol resolves. When wine is installed
# too (Debian: wine64), the driver also runs: mapped and read, on a file with a non-ASCII name,
# and must see the same bytes as the same driver built for this machine.
# Prints "skipped: no cross compiler" and exits 0 when there is none; non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."

CXX="${MINGW_CXX:-}"
if [ -z "$CXX" ]; then
  for c in x86_64-w64-mingw32-g++-posix x86_64-w64-mingw32-g++-win32 x86_64-w64-mingw32-g++; do
    if command -v "$c" >/dev/null 2>&1; then CXX="$c"; break; fi
  done
fi
if [ -z "$CXX" ]; then
  echo "skipped: no cross compiler (x86_64-w64-mingw32-g++)"
  exit 0
fi

out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
# Prints size, an FNV-1a hash of the bytes, and whether they were mapped or read.
cat > "$out/driver.cpp" <<'CPP'
#include <cstdint>
#include <cstdio>
#include <string>
#include "file_map.h"
#ifdef _WIN32
#include <windows.h>
#endif
int run(const std::string& path) {
    try {
        river::FileMap m(path, !river::FileMap::disabled_by_env());
        uint64_t h = 14695981039346656037ull;
        const unsigned char* p = static_cast<const unsigned char*>(m.data());
        for (size_t i = 0; i < m.size(); ++i) h = (h ^ p[i]) * 1099511628211ull;
        std::printf("%zu %016llx %s\n", m.size(), static_cast<unsigned long long>(h), m.mapped() ? "mapped" : "read");
    } catch (const river::FileMapError& e) {
        std::printf("error: %s\n", e.what());
        return 1;
    }
    return 0;
}
#ifdef _WIN32
// The loader gets UTF-8 paths (from Python str); Windows hands a program UTF-16 arguments.
int wmain(int argc, wchar_t** argv) {
    if (argc < 2) return 2;
    const int n = WideCharToMultiByte(CP_UTF8, 0, argv[1], -1, nullptr, 0, nullptr, nullptr);
    std::string path(size_t(n > 0 ? n - 1 : 0), '\0');
    WideCharToMultiByte(CP_UTF8, 0, argv[1], -1, &path[0], n, nullptr, nullptr);
    return run(path);
}
#else
int main(int argc, char** argv) { return argc < 2 ? 2 : run(argv[1]); }
#endif
CPP
flags=(-std=c++17 -O2 -Wall -Wextra -Werror -iquote native)
"$CXX" "${flags[@]}" -municode native/file_map.cpp "$out/driver.cpp" -static -o "$out/check.exe"
echo "ok: native/file_map.cpp compiles and links for Windows with $CXX ($("$CXX" -dumpversion))"

WINE=""
for w in wine64 wine /usr/lib/wine/wine64; do
  if command -v "$w" >/dev/null 2>&1; then WINE="$w"; break; fi
done
if [ -z "$WINE" ]; then
  echo "not run: no wine"
  exit 0
fi
export WINEDEBUG=-all
export WINEPREFIX="${WINEPREFIX:-$HOME/.cache/river_gguf_wine}"
host_cxx="${CXX_HOST:-g++}"
"$host_cxx" "${flags[@]}" native/file_map.cpp "$out/driver.cpp" -o "$out/check_host"

sample="$out/modèle ü.gguf"  # a name outside the ANSI code page would fail with the A functions
head -c 300000 /dev/urandom > "$sample"
want="$("$out/check_host" "$sample" | cut -d' ' -f1,2)"
mapped="$("$WINE" "$out/check.exe" "$sample" | tr -d '\r')"
read_="$(RIVER_GGUF_NO_MMAP=1 "$WINE" "$out/check.exe" "$sample" | tr -d '\r')"
[ "$mapped" = "$want mapped" ] || { echo "FAIL: mapped under wine: '$mapped', want '$want mapped'"; exit 1; }
[ "$read_" = "$want read" ] || { echo "FAIL: read under wine: '$read_', want '$want read'"; exit 1; }
mkdir "$out/dir"
if dir_out="$("$WINE" "$out/check.exe" "$out/dir" | tr -d '\r')"; then
  echo "FAIL: a directory loaded under wine: $dir_out"; exit 1
fi
echo "ok: under wine the Windows build maps and reads the same bytes ($want); a directory is refused ($dir_out)"
