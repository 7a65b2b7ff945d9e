"""Import the native engine only when the loaded ggml is the one it was compiled against.

The engine links ggml and libllama from the llama-cpp-python wheel. Their ABI changes
between releases, so a different wheel underneath would crash rather than fail cleanly.
"""
import llama_cpp  # loads site-packages/llama_cpp/lib first, the same files the engine links

#: How to get ggml's RPC backend (layers on other machines) when the installed wheel lacks it.
RPC_FIX = (
    "rebuild llama-cpp-python with RPC on and river_gguf against it: CMAKE_ARGS=-DGGML_RPC=ON pip install "
    "--force-reinstall --no-cache-dir llama-cpp-python==0.3.36 && pip install --no-build-isolation "
    "--force-reinstall river_gguf (scripts/setup.sh does both)"
)

try:
    from . import _native as native
except ImportError as e:  # pragma: no cover - depends on the install
    if "ggml-rpc" in str(e):  # built with RPC, then llama-cpp-python reinstalled without it
        raise ImportError(f"river_gguf's native engine was built with ggml's RPC backend, which the installed "
                          f"llama-cpp-python lacks ({e}); {RPC_FIX}") from e
    raise ImportError(
        f"river_gguf's native engine failed to load ({e}). It needs the ggml libraries of "
        f"llama-cpp-python; reinstall with: pip install llama-cpp-python==0.3.36 && "
        f"pip install --no-build-isolation --force-reinstall river_gguf"
    ) from e

_loaded = (llama_cpp.__version__, native.loaded_ggml_commit())
_built = (native.BUILT_LLAMA_CPP_PYTHON, native.BUILT_GGML_COMMIT)
if _loaded != _built:
    raise ImportError(
        f"river_gguf was built against llama-cpp-python {_built[0]} (ggml {_built[1]}), but "
        f"llama-cpp-python {_loaded[0]} (ggml {_loaded[1]}) is loaded. Reinstall the pinned "
        f"version (pip install llama-cpp-python=={_built[0]}) or rebuild river_gguf against "
        f"this one (pip install --no-build-isolation --force-reinstall river_gguf)."
    )

#: Whether ggml's RPC backend is usable: compiled into the engine and registered by the loaded ggml.
HAS_RPC = bool(native.HAS_RPC) and native.rpc_available()
if native.HAS_RPC and not HAS_RPC:  # pragma: no cover - depends on the install
    raise ImportError(f"river_gguf was built with ggml's RPC backend, but the loaded ggml has none; {RPC_FIX}")


def require_rpc(what: str) -> None:
    """Raise RuntimeError naming the fix when ggml's RPC backend is missing."""
    if not HAS_RPC:
        raise RuntimeError(f"{what} needs ggml's RPC backend, which this installation lacks: {RPC_FIX}")
