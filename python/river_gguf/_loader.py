"""Import the native engine only when the loaded ggml is the one it was compiled against.

The engine links ggml and libllama from the llama-cpp-python wheel. Their ABI changes
between releases, so a different wheel underneath would crash rather than fail cleanly.
"""
import llama_cpp  # loads site-packages/llama_cpp/lib first, the same files the engine links

try:
    from . import _native as native
except ImportError as e:  # pragma: no cover - depends on the install
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
