"""Choose a River GGUF's presets again (`river-gguf tune FILE`, river_gguf.cli.tune_cmd) from decode speeds timed on this
machine, instead of the stored cost model.

The converter chooses the presets by a cost model fitted once on one machine (cost_model.TYPE_COST),
so the same input gives the same presets everywhere. On another CPU the relative speed of the
types differs (AVX2 against AVX-512, more cores, a GPU), and a tier may then hold a setting that is
slower than the llama.cpp quant it is anchored on. `tune` times every setting of the file's
measured grid (river.presets_grid: their KLD stays as measured) in river_gguf's engine, and the
three anchors, llama.cpp's Q4_0, Q4_K_M and Q8_0 of the file's backbone, in stock llama.cpp (made
in a temp folder with llama.cpp's quantizer from the backbone, which the River GGUF is to
llama.cpp), interleaved over `rounds` rounds. Each setting's cost is its median seconds per
decode step relative to river-only's, and each tier's bound the anchor's, as in the cost model;
cost_model.choose then picks per tier, and the file is rewritten atomically (metadata only).

It also prices lossless mode (calibrate.lossless): the backbone's step, the draft step and verify
batches are timed in the engine, and with the grid's river-only acceptance they predict lossless
speed against the backbone alone and the best draft_max. Where lossless beats the backbone, it
joins the rows as a setting at the backbone's KL divergence (zero) and its predicted cost per
token, so a tier (quality, usually) stores it only where it is cheaper than every setting as
close; where it does not pay, the result says so with the numbers.

The conversion measures only the settings that can win a tier by its cost model (the rest are in
the grid with why not, and no KLD); tune times those. ``measure=True`` (``--all``) first measures
the whole grid, unpruned, on the calibration split (measure_grid): against the file's own
backbone, or, given the F16 the file was converted from (``reference``, ``--reference``), against
that, as the conversion does; every row is labelled with its reference, and the presets are
chosen from rows of one reference only.
"""
from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
from typing import Dict, List, Optional

from tqdm import tqdm

from .. import presets as presets_mod
from .._loader import native
from ..measure import divergence
from ..measure.scoring import PRESET_CALIBRATION_TOKENS, PRESET_SCORE_TOKENS, calibration_prepared
from ..options import EXIT_RULES, never_exit
from . import open_model
from .cost_model import TIERS, choose
from .preset_grid import REFERENCE_KEY, calibrate_presets, preset_metadata, reference_label
from ..gguf.io import quantize
from ..gguf.meta import set_river_metadata
from ..gguf.reader import GGUFReader
from ..greedy import greedy
from ..measure.llama_decode import LlamaDecoder
from ..model import Model
from . import lossless

PROMPT = ("The river rose in the hills above the town and ran through three valleys before it reached "
          "the sea. In spring, when the snow melted,")
TUNED_KEY = "river.presets_tuned"


def _anchor_files(path: str, folder: str, n_threads: int, progress) -> Dict[str, str]:
    out = {}
    for _, kind in TIERS:
        dst = os.path.join(folder, f"anchor.{kind}.gguf")
        quantize(path, dst, kind, n_threads=n_threads, allow_requantize=True)
        out[kind] = dst
        progress(1)
    return out


#: The largest draft_max tune considers for lossless mode.
MAX_DRAFT = 8


def measure_grid(path: str, reference: Optional[str] = None, n_threads: int = 2, progress: bool = True,
                 min_tokens: int = PRESET_CALIBRATION_TOKENS) -> dict:
    """Every setting of the grid (cost_model.grid), unpruned, measured on the calibration split
    (preset_grid.calibrate_presets): against `reference`'s logits (a GGUF of the same model, e.g.
    the F16 the file was converted from, checked as the engine checks a separate river) or, when
    None, the file's own backbone. Returns calibrate_presets's result; each row names its
    reference."""
    if reference is not None:
        reference = os.fspath(reference)
        if not os.path.isfile(reference):
            raise FileNotFoundError(f"reference file not found: {reference}")
        diffs = list(native.model_differences(reference, path))
        if diffs:
            raise native.RiverMismatchError(f"the reference {reference} is not the model of {path}: {diffs[0]}")
    m = open_model(path, n_ctx=1024, n_threads=n_threads, threshold=max(never_exit(r) for r in EXIT_RULES))
    prepared = calibration_prepared(m, min_tokens, SCORE_TOKENS)
    with contextlib.ExitStack() as stack:
        rows = None
        if reference is not None:
            rows = stack.enter_context(divergence.ReferenceRows(reference_label(GGUFReader(reference).tensors)))
            # In place, as the converter's pass reads it: ggml repacks no F16 on x86 (the same
            # logits bit for bit), and no copies of it are held beside the file being measured.
            ref = open_model(reference, n_ctx=1024, n_threads=n_threads, mode="backbone", repack=False)
            try:
                with tqdm(total=len(prepared), desc="reference", unit="item", disable=not progress) as bar:
                    rows.add_logits_of(ref, prepared, bar)
            finally:
                del ref
        return calibrate_presets(m, score_tokens=SCORE_TOKENS, progress=progress, prepared=prepared, reference=rows)


#: Scored tokens per calibration item when tune measures the grid (the converter's default).
SCORE_TOKENS = PRESET_SCORE_TOKENS


def tune(path: str, n_threads: int = 2, tokens: int = 64, rounds: int = 5, write: bool = True,
         progress: bool = True, measure: bool = False, reference: Optional[str] = None,
         calibration_tokens: int = PRESET_CALIBRATION_TOKENS) -> dict:
    """Time the grid and the anchors on this machine and choose the presets again: the stored
    grid's measured settings, or with measure=True (or a reference) the whole grid measured
    first (measure_grid; `reference`: the F16 to measure against, default the file's backbone;
    calibration_tokens: its scored tokens per setting).
    Returns {"presets", "rows", "anchors", "seconds_per_step", "lossless", "reference"}; with
    write=True the presets, anchors and the timings are stored in the file (and a grid measured
    here replaces the stored one)."""
    if not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be an int >= 1, got {rounds!r}")
    if not isinstance(tokens, int) or tokens < 8:
        raise ValueError(f"tokens must be an int >= 8, got {tokens!r}")
    measured = (measure_grid(path, reference, n_threads, progress, calibration_tokens)
                if (measure or reference is not None) else None)
    m = Model(path, n_ctx=1024, n_threads=n_threads)
    raw = m.metadata.get(presets_mod.GRID_KEY)
    if not m.has_river or (raw is None and measured is None):
        raise ValueError(f"{path} has no measured preset grid ({presets_mod.GRID_KEY}); convert it with presets "
                         "(river-gguf convert without --no-presets) or tune it with --all")
    stored = presets_mod.parse_grid(raw) if measured is None else measured["rows"]
    label = measured["reference"] if measured is not None else m.metadata.get(REFERENCE_KEY, "backbone")
    # Settings left unmeasured have no KLD to choose by: not timed.
    grid: List[dict] = [dict(r, reference=r.get("reference", label)) for r in stored if r.get("kld") is not None]
    river_only = next((i for i, r in enumerate(grid) if r["options"].plain_river_only), None)
    if river_only is None:
        raise ValueError(f"{path}: the grid has no plain river-only setting to measure costs against")
    n_runs = len(TIERS) + rounds * (len(grid) + len(TIERS))
    times: Dict[str, List[float]] = {}
    with tempfile.TemporaryDirectory(prefix="river-tune-", dir=os.path.dirname(os.path.abspath(path))) as tmp, \
            tqdm(total=n_runs, desc="tune", unit="run", disable=not progress) as bar:
        anchors = {k: LlamaDecoder(p, 1024, n_threads) for k, p in _anchor_files(path, tmp, n_threads, bar.update).items()}
        try:
            prompt = m.tokenize(PROMPT)
            jobs = [(f"grid{i}", r["options"]) for i, r in enumerate(grid)] + [(k, None) for k in anchors]
            for rnd in range(rounds):
                for name, opts in (jobs if rnd % 2 == 0 else jobs[::-1]):  # drift hits every job alike
                    if opts is None:
                        _, steps, secs = anchors[name].greedy(prompt, tokens + 1, stop_at_eog=False)
                    else:
                        g = greedy(m, prompt, tokens + 1, **opts.call_options())
                        steps, secs = g.decode_steps, g.decode_seconds
                    times.setdefault(name, []).append(secs / max(steps, 1))
                    bar.update(1)
        finally:
            for a in anchors.values():
                a.close()
    step = {k: statistics.median(v) for k, v in times.items()}
    base = step[f"grid{river_only}"]
    rows = [dict(r, relative_cost=step[f"grid{i}"] / base, seconds_per_step=step[f"grid{i}"])
            for i, r in enumerate(grid)]
    lossless_res = _price_lossless(m, grid, rounds)
    if lossless_res["pays"]:
        per_token = lossless_res["costs"]["step"] / lossless_res["speedup"]
        rows.append({"options": presets_mod.Setting.of(mode="lossless", draft_max=lossless_res["draft_max"]), "kld": 0.0,
                     "same_top": 100.0, "relative_cost": per_token / base, "seconds_per_step": per_token,
                     "mean_exit_layer": float(m.n_layer - 1)})
    bounds = {name: step[kind] / base for name, kind in TIERS}
    chosen = choose(rows, bounds)
    anchors_meta = {"measure": "timed", "seconds_per_step": {k: step[k] for _, k in TIERS},
                    "river_only": base, "bounds": bounds}
    res = {"presets": chosen, "rows": rows, "anchors": anchors_meta, "seconds_per_step": step,
           "lossless": lossless_res, "reference": label}
    del m  # release the mapping before the file is rewritten
    if write:
        keys = {
            presets_mod.PRESET_KEY: presets_mod.dump(chosen),
            presets_mod.ANCHORS_KEY: presets_mod.dump(anchors_meta),
            TUNED_KEY: presets_mod.dump({"threads": n_threads, "tokens": tokens, "rounds": rounds,
                                         "seconds_per_step": step, "lossless": lossless_res,
                                         "measured": measured is not None, "reference": label}),
            presets_mod.DEFAULT_KEY: presets_mod.DEFAULT_PRESET,
        }
        if measured is not None:  # the grid measured here, whole, replaces the conversion's
            keys.update({presets_mod.GRID_KEY: preset_metadata(measured)[presets_mod.GRID_KEY],
                         REFERENCE_KEY: label})
        set_river_metadata(path, keys)
    return res


def _price_lossless(model, grid: List[dict], rounds: int) -> dict:
    """Lossless mode's predicted speed here: costs timed in the engine, acceptance from the grid."""
    acceptance = lossless.river_only_acceptance(grid)
    if acceptance is None:
        raise ValueError("the grid has no river-only row with its same-top rate")
    opts = model.options(mode="lossless", draft_max=MAX_DRAFT)
    costs = lossless.measure_costs(model, opts, MAX_DRAFT + 1, rounds=rounds)
    choice = lossless.best_draft_max(costs, acceptance)
    return dict(choice, costs=costs.as_dict(), line=lossless.describe(choice, costs),
                per_k={str(k): v for k, v in choice["per_k"].items()})
