"""What the tests share besides fixtures: the repository's root, the thread count, the common
texts and tolerances, the oracle (stock llama.cpp through llama-cpp-python, and oracle_pick),
files no engine should load (an unsupported architecture, a truncated copy), and the cache of
files the tests build (conftest.py's `built` fixture). Random-weight models come from
river_gguf.eval.random_model.

Test modules import it as `support` (tests/ is on sys.path: pytest puts the root conftest's folder
there); tests_gpu/ and tests_qwen/ put tests/ on sys.path themselves."""
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
import numpy as np

import river_gguf
from river_gguf.gguf.io import atomic_output

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


# --- llama.cpp, the oracle; files no engine should load ---------------------------------------

def write_unsupported_arch(path: str | os.PathLike, arch: str = "mamba") -> str:
    """A small but well-formed GGUF whose architecture the engine does not implement."""
    with atomic_output(path) as tmp, contextlib.closing(gguf.GGUFWriter(tmp, arch)) as w:
        w.add_name(f"unsupported-{arch}")
        w.add_uint32(f"{arch}.block_count", 1)
        w.add_uint32(f"{arch}.context_length", 512)
        w.add_uint32(f"{arch}.embedding_length", 16)
        w.add_tensor("token_embd.weight", np.zeros((32, 16), dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    return os.fspath(path)


def truncate_copy(src: str | os.PathLike, dst: str | os.PathLike, keep_fraction: float = 0.5) -> str:
    """Copy only the first ``keep_fraction`` of ``src``'s bytes (a corrupt-file fixture)."""
    if not 0.0 <= keep_fraction <= 1.0:
        raise ValueError("keep_fraction must be within [0, 1]")
    left = int(os.path.getsize(src) * keep_fraction)
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        while left > 0:
            chunk = fi.read(min(left, 1 << 20))
            if not chunk:
                break
            fo.write(chunk)
            left -= len(chunk)
    return os.fspath(dst)


class LlamaCppOracle:
    """Stock llama.cpp (llama-cpp-python) on a GGUF, set up like the engine: F16 KV cache (the
    default), flash attention, n_threads threads (2 unless told). The tests' reference for logits and greedy text.

    logits() asks llama.cpp for every row (logits_all); greedy() generates as llama.cpp does by
    default, with one output row per batch, so its last layer selects that row before the FFN (on a
    GPU a one-row product rounds otherwise than the same row of a batch).

    stop_at_any_eog: greedy() stops at any end-of-generation token (llama_vocab_is_eog), not only
    at the EOS token; models whose chat turns end on another token (Qwen) need it. n_gpu_layers:
    llama.cpp's own offload (-1: every layer and the head), the reference for the GPU tests."""

    def __init__(self, path, n_ctx: int = 512, stop_at_any_eog: bool = False, n_gpu_layers: int = 0,
                 n_threads: int = 2):
        self._args = dict(n_ctx=n_ctx, n_threads=n_threads, n_threads_batch=n_threads, flash_attn=True,
                          n_gpu_layers=n_gpu_layers, verbose=False)
        self._path = os.fspath(path)
        self.llm = llama_cpp.Llama(self._path, logits_all=True, **self._args)
        self._gen = None  # the one-output-row instance, made at the first greedy()
        self.stop_at_any_eog = stop_at_any_eog

    def logits(self, tokens):
        self.llm.reset()
        self.llm.eval(list(tokens))
        return np.array(self.llm.scores[: len(tokens)], dtype=np.float32)

    def _stops(self, tok) -> bool:
        if self.stop_at_any_eog:
            return bool(llama_cpp.llama_vocab_is_eog(self.llm._model.vocab, tok))
        return tok == self.llm.token_eos()

    def greedy(self, tokens, n):
        if self._gen is None:
            self._gen = llama_cpp.Llama(self._path, logits_all=False, **self._args)
        # reset: llama-cpp-python would otherwise reuse a cached prefix computed inside a longer
        # batch, which is not the computation the engine repeats step by step.
        self._gen.reset()
        out = []
        for tok in self._gen.generate(list(tokens), temp=0.0, top_k=1, reset=True):
            if self._stops(tok) or len(out) >= n:
                break
            out.append(tok)
        return out

    def close(self):
        self.llm.close()
        if self._gen is not None:
            self._gen.close()


@contextlib.contextmanager
def oracles(**kw):
    """A factory make(path, n_ctx=512) of LlamaCppOracle, closing every oracle it made on exit."""
    made = []

    def make(path, n_ctx=512):
        made.append(LlamaCppOracle(path, n_ctx, **kw))
        return made[-1]

    try:
        yield make
    finally:
        for o in made:
            o.close()


def oracle_pick(candidates, run, has, what, oracle="the oracle (llama.cpp)"):
    """The first candidate input for which the oracle's output has a property, and that output.

    Tests assert agreement with llama.cpp or invariants, never what a model happens to generate:
    where a property of the output is the point (JSON mode parses, a grammar yields a whole tree,
    a reply runs to the length limit), the test first finds an input for which the ORACLE's output
    has it (float rounding differs between CPUs, so one fixed prompt may not do), then asserts
    ours equals the oracle's, so a failure says which side moved.

    run(candidate) -> the oracle's output; has(output) -> bool. Raises AssertionError, saying the
    oracle lacks `what` on this CPU, when no candidate gives it (`oracle` names the reference)."""
    seen = []
    for c in candidates:
        out = run(c)
        if has(out):
            return c, out
        seen.append(f"{c!r} -> {out!r}"[:400])
    raise AssertionError(f"{oracle} lacks {what} on this CPU for every candidate input:\n" + "\n".join(seen))


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


def generated_tokens(llm, prompt: str, n: int, **kw):
    """(the prompt's tokens, the first n tokens a Llama's generate() samples after them): every
    token, an end-of-generation one included, which ends it."""
    toks = llm.tokenize(prompt.encode(), add_bos=True, special=True)
    out = []
    for t in llm.generate(toks, **kw):
        out.append(t)
        if llm._is_eog(t) or len(out) >= n:
            break
    return toks, out


def search_replayed_on_full_sweep(m):
    """The full, unpruned sweep of the preset grid on m's calibration items (ten of 8 scored
    tokens after 8 of their prompt: the choice depends on the rows, not on how long the prompts
    are, and short ones keep it cheap), with the cost model's plan and the tail search replayed on
    the sweep's own rows (the search's decisions are a function of the rows it asks for). Asserts
    that the search asks exactly what the plan leaves to measure, that it chooses the sweep's
    presets, and that it left settings out (so the equality checks the pruning). Returns
    (prepared items, profile, the sweep, its settings, the indices the search asked for)."""
    from river_gguf.calibrate import cost_model, preset_grid
    from river_gguf.measure.profile import similarity_profile
    from river_gguf.measure.scoring import calibration_prepared

    prepared = [(toks[prefix - 8:], 8) for toks, prefix in calibration_prepared(m, 80, 8)]
    profile = similarity_profile(m, own_engine=False)
    full = preset_grid.calibrate_presets(m, prepared=prepared, score_tokens=8, progress=False, profile=profile)
    settings = [r["options"] for r in full["rows"]]
    asked = set()
    measure = preset_grid.replayed_measure(full["rows"], asked)
    skip, _ = preset_grid.plan_and_search(m, settings, measure, profile)
    rows = measure([])
    measured = {i for i in asked if not rows[i].get("screened")}
    assert sorted(measured) == [i for i, why in enumerate(skip) if not why]
    searched = cost_model.choose([full["rows"][i] for i in sorted(measured)], full["anchors"]["bounds"])
    assert {n: p.setting for n, p in searched.items()} == {n: p.setting for n, p in full["presets"].items()}
    assert len(measured) < len(settings)
    return prepared, profile, full, settings, measured
