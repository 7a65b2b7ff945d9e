#!/usr/bin/env python3
"""Which of llama-cpp-python's shared libraries define the C++ runtime's own locale symbols.

A library that exports its own copy of `std::locale::classic()` or `std::ctype<char>::id` can be
bound in place of libstdc++'s by the dynamic linker, depending on which library entered the
lookup scope first. Facets made by one copy and looked up with the other's ids make a virtual call
land in a wrong facet: the CUDA load crash's signature (libllama's std::regex calling into
libggml-cuda, docs/gpu.md). This lists, for each library that loads, the symbols it defines itself
(dlsym over the library's own scope returns its copy first; dladdr names the file that holds it).

    python scripts/cxx_runtime_exports.py [LIBDIR]      (default: the installed llama_cpp/lib)

Prints one line per library and exits 1 when any library but libstdc++ defines one of them.
"""
import ctypes
import glob
import os
import sys

# std::locale::classic(), std::locale::id::_M_id(), std::ctype<char>::id, and the codecvt member
# the crash's backtrace named.
RUNTIME_SYMBOLS = (
    "_ZNSt6locale7classicEv",
    "_ZNKSt6locale2id5_M_idEv",
    "_ZNSt5ctypeIcE2idE",
    "_ZNKSt7codecvtIDsc11__mbstate_tE10do_unshiftERS0_PcS3_RS3_",
)


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def _libc():
    libc = ctypes.CDLL(None)
    libc.dlsym.restype = ctypes.c_void_p
    libc.dlsym.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    libc.dladdr.restype = ctypes.c_int
    libc.dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
    return libc


def defined_runtime_symbols(path: str) -> list:
    """The RUNTIME_SYMBOLS that the library at `path` defines itself (raises OSError if it does not load)."""
    lib = ctypes.CDLL(path, mode=os.RTLD_LOCAL)
    libc = _libc()
    own = os.path.realpath(path)
    found = []
    for sym in RUNTIME_SYMBOLS:
        addr = libc.dlsym(lib._handle, sym.encode())
        info = _DlInfo()
        if addr and libc.dladdr(addr, ctypes.byref(info)) and info.dli_fname:
            if os.path.realpath(info.dli_fname.decode()) == own:
                found.append(sym)
    return found


def main(argv) -> int:
    if len(argv) > 1:
        libdir = argv[1]
    else:
        import llama_cpp  # noqa: F401  (its lib/ folder; importing it loads libllama)

        libdir = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
    bad = 0
    for path in sorted(glob.glob(os.path.join(libdir, "*.so*"))):
        if os.path.islink(path):
            continue
        name = os.path.basename(path)
        try:
            syms = defined_runtime_symbols(path)
        except OSError as e:
            print(f"{name}: does not load here ({e})")
            continue
        print(f"{name}: {'defines ' + ', '.join(syms) if syms else 'none'}")
        bad += bool(syms) and not name.startswith("libstdc++")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
