"""What the tests share besides fixtures: the repository's root, the thread count, the common
texts and tolerances, and the cache of files the tests build (conftest.py's `built` fixture).

Test modules import it as `support` (tests/ is on sys.path: pytest puts the root conftest's folder
there)."""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import pathlib
import sys
from typing import Callable, Iterable

import gguf
import llama_cpp

import river_gguf
from river_gguf.testing import LlamaCppOracle, oracle_pick  # noqa: F401 (re-exported)

REPO = pathlib.Path(__file__).resolve().parent.parent

#: Threads for one engine. Under pytest-xdist each of the 2 workers gets one core: ggml's threads
#: spin at their barriers, so two workers of 2 threads each on 2 cores would slow each other down
#: many times over. Tests whose point is the thread count say theirs.
THREADS = 1 if os.environ.get("PYTEST_XDIST_WORKER") else 2

#: Engine logits against llama.cpp's on the same file and graph: both run the same ggml kernels,
#: so they agree to the bit in practice; this leaves room only for reduction order.
LOGIT_TOL = 2e-3

PROSE = (
    "The river rose in the hills above the town. Every spring it carried snow water down past the mill, "
    "and the miller's children counted the days until the ice broke. One year the flood came early; "
    "the bridge held, but the road to the market was closed for a week."
)


class Oracle(LlamaCppOracle):
    """Stock llama.cpp on a file, with the tests' thread count."""

    def __init__(self, path, n_ctx: int = 512, **kw):
        kw.setdefault("n_threads", THREADS)
        super().__init__(path, n_ctx, **kw)


# --- the cache of built files -----------------------------------------------------------------------

def _digest_files(root: pathlib.Path, paths: Iterable[pathlib.Path]) -> str:
    h = hashlib.sha256()
    for p in sorted(paths):
        h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


@functools.lru_cache(maxsize=None)
def package_digest(root: str | None = None) -> str:
    """A digest of river_gguf as it converts and writes files: every Python source of the package
    (the installed one, or the package folder `root`) and its native module, with the versions of
    the libraries it writes and quantizes with (gguf-py, llama-cpp-python). A change to any of
    them changes every built file's name that includes it."""
    pkg = pathlib.Path(root or pathlib.Path(river_gguf.__file__).resolve().parent)
    files = [p for p in pkg.rglob("*") if p.is_file() and (p.suffix == ".py" or p.name.startswith("_native"))]
    versions = [getattr(gguf, "__version__", ""), llama_cpp.__version__, list(sys.version_info[:2])]
    return hashlib.sha256(json.dumps([_digest_files(pkg, files), versions]).encode()).hexdigest()


class BuildCache:
    """Files the tests build (random models, River GGUFs), kept between runs under a folder
    (pytest's cache: .pytest_cache/d/river_gguf/built) and named by what makes them.

    get(name, make, options, sources) is the path of the file make(path) writes for these options
    with these sources, built once: a second run, or the other xdist worker, reuses it. A file is
    named by its options and by a digest of the sources (package_digest(): the converter, the
    writers, the native module and the libraries' versions); when the sources change, the file is
    built again and the one of the older sources removed. A lock per file makes concurrent workers
    build it once; make writes a temp name renamed into place, so a reader never sees half a file."""

    def __init__(self, root: str | os.PathLike):
        self.root = pathlib.Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.built: list[str] = []  # files this process built (not reused), for the cache's own test

    @staticmethod
    def digest(value) -> str:
        return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]

    @contextlib.contextmanager
    def lock(self, name: str):
        """Held by one process at a time (an xdist worker waits for the other's build)."""
        with open(self.root / f"{name}.lock", "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            yield

    def get(self, name: str, make: Callable[[pathlib.Path], object], options, sources: str,
            suffix: str = ".gguf") -> str:
        if "." in name or "/" in name:
            raise ValueError(f"a built file's name has no dots or slashes: {name!r}")
        slot = f"{name}-{self.digest(options)}"
        dst = self.root / f"{slot}.{self.digest(sources)}{suffix}"
        if dst.is_file():
            return str(dst)
        with self.lock(slot):
            if dst.is_file():  # the other worker built it while this one waited
                return str(dst)
            for old in self.root.glob(f"{slot}.*"):  # older sources' file, or a killed build's
                if old.suffix != ".lock":
                    with contextlib.suppress(FileNotFoundError):
                        old.unlink()
            tmp = self.root / f"{slot}.{os.getpid()}.partial{suffix}"
            try:
                make(tmp)
                os.replace(tmp, dst)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    tmp.unlink()
        self.built.append(str(dst))
        return str(dst)
