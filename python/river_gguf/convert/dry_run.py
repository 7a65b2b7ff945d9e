"""What a conversion will do, how long it will take and how much memory it will hold, before it
does anything (``river-gguf convert --dry-run``).

The plan comes from the input's header and llama.cpp's own dry run of its quantizer (each
tensor's type for the river and the stored backbone, nothing written), the calibration text
tokenized with the model's vocabulary, and the cost model (cost_model.plan: the preset settings
left in play). Time is predicted from a short probe on this machine: one batched pass of the F16
over PROBE_TOKENS tokens (the per-token time every forward stage scales by; its first, cold run
also times reading the weights from disk) and ggml quantizing a slab of random rows to each
target type (per element). Each stage's time is that work times a constant fitted once on the
2-core VM of BENCHMARKS.md ("Conversion cost") by benchmarks/convert_cost.py. Peak memory is the
largest of the stages' resident sets, as the converter holds them: the F16 mapped whole during
its pass with the logits buffers, one slab of llama.cpp's quantizer, the two parts mapped while
the presets are measured and while the output is written.
"""
from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT
from llama_cpp._utils import suppress_stdout_stderr

from .._loader import native
from ..calibrate import open_model
from ..calibrate.cost_model import (SCREEN, SEARCHED, TensorInfo, grid, plan, setting_cost, step_bytes,
                                    tail_families, tensor_costs, tier_bounds_of)
from ..calibrate.preset_grid import screen_items
from ..gguf.copy import check_loadable, is_river_gguf, open_reader, plain_tensors, type_name
from ..gguf.io import QUANT_BUFFER_BYTES, LlamaLog, captured_llama_log, deferred_interrupts, planned_types
from ..measure.scoring import calibration_selection
from ..measure.profile import predicted_mean_exit, similarity_profile
from . import build
from .imatrix import calibration_texts, text_chunks

GIB = 1 << 30
PROBE_TOKENS = 128
PROFILE_TOKENS = 256
# Seconds per unit of work, in units of the probe's times, fitted on the 2-core VM (see the module
# docstring): the F16 pass per token (imatrix and reference rows, their logits included), the
# presets per token-pass of a setting, quantization per element of the probe's rate, and the fixed
# costs (engine loads, the vocabulary, hashing and writing per GiB).
PASS_FACTOR = 0.89
DECODE_FACTOR = 3.0       # a decode step against a batched token, for dynamic settings
QUANT_FACTOR = 0.79
FIXED_SECONDS = 0.0
IO_SECONDS_PER_GIB = 2.21
BASE_BYTES = 0.35 * GIB   # Python, numpy, the vocabulary and the engines' own buffers


#: What the dry run cannot measure on this machine: every constant above, fitted on one machine.
UNMEASURED = ("PASS_FACTOR (the F16 pass's token against the probe's), DECODE_FACTOR (a decode step against a "
              "batched token), QUANT_FACTOR, FIXED_SECONDS, IO_SECONDS_PER_GIB (this disk's speed) and presets_factor "
              "(a quantized setting's token against the F16's, interpolated between two sizes) are fitted on the "
              "2-core VM of BENCHMARKS.md (benchmarks/convert_cost.py --fit), not measured here; where the search of "
              "the tails stops is not known before their KLDs are")


def _priced(units: Dict[str, float], f16_bytes: int = 0) -> float:
    """Seconds of a stage's units at the fitted constants."""
    value = {"PASS_FACTOR": PASS_FACTOR, "QUANT_FACTOR": QUANT_FACTOR, "FIXED_SECONDS": FIXED_SECONDS,
             "IO_SECONDS_PER_GIB": IO_SECONDS_PER_GIB, "presets_factor": presets_factor(f16_bytes)}
    return sum(value[k] * u for k, u in units.items())


def presets_factor(f16_bytes: int) -> float:
    """A quantized setting's batched token over the F16's (the probe's), the plan's pass of the
    presets priced as the rows of BENCHMARKS.md ran (benchmarks/convert_cost.py --fit): 1.41 at
    Qwen2.5-Coder-0.5B; at the 1.5B shape 0.98 with the default river and 1.22 with a Q4_0 river
    (whose search ran a round past the plan's pass), stored as 1.10 between them; interpolated in
    the F16's size (log scale), held flat outside."""
    x = np.log([1.18 * GIB, 3.31 * GIB])
    return float(np.interp(np.log(max(f16_bytes, 1)), x, [1.41, 1.10]))


@dataclass
class Stage:
    name: str
    what: str
    seconds: float
    peak_bytes: float
    # The work each fitted constant multiplies in `seconds` (its name -> units: the probe's
    # seconds of work, GiB read, 1 for a fixed cost), and the seconds measured outright (the
    # probe's cold read): what benchmarks/convert_cost.py --fit refits the constants from.
    units: Dict[str, float] = field(default_factory=dict)
    measured_seconds: float = 0.0


@dataclass
class ConversionPlan:
    backbone: str
    out: str
    stages: List[Stage] = field(default_factory=list)
    settings: List[dict] = field(default_factory=list)   # {"options", "relative_cost", "why"}
    available_bytes: Optional[int] = None
    notes: List[str] = field(default_factory=list)
    # The output's folder: the most bytes the conversion keeps there at once (build.disk_needed),
    # the presets' reference rows' share of it, and the free space there.
    disk_parts: Dict[str, int] = field(default_factory=dict)  # river, backbone, output, reference (bytes)
    disk_bytes: int = 0
    free_disk_bytes: Optional[int] = None

    @property
    def reference_bytes(self) -> int:
        return self.disk_parts.get("reference", 0)

    @property
    def seconds(self) -> float:
        return sum(s.seconds for s in self.stages)

    @property
    def peak_bytes(self) -> float:
        return max((s.peak_bytes for s in self.stages), default=0.0)

    @property
    def fits(self) -> bool:
        return self.available_bytes is None or self.peak_bytes <= self.available_bytes

    @property
    def fits_disk(self) -> bool:
        return self.free_disk_bytes is None or self.disk_bytes <= self.free_disk_bytes

    def lines(self) -> List[str]:
        out = [f"dry run: {os.path.basename(self.backbone)} -> {self.out} (nothing is written)"]
        for i, s in enumerate(self.stages, 1):
            out.append(f"  {i}. {s.name}: {s.what}  [~{s.seconds:.0f} s, {s.peak_bytes / GIB:.2f} GiB]")
        if self.settings:
            play = [r for r in self.settings if r["why"] in ("", SEARCHED, SCREEN)]
            how = {"": ")", SEARCHED: ", searched: measured only if the search reaches it)",
                   SCREEN: ", screened first: measured on every item only if the screen keeps it)"}
            out.append(f"  presets: {len(play)} of {len(self.settings)} settings in play:")
            out += [f"     {_describe(r['options'].named())} ({r['relative_cost']:.3f}x river-only's cost{how[r['why']]}"
                    for r in play]
        out += [f"  note: {n}" for n in self.notes]
        ref = f", the presets' reference rows {self.reference_bytes / GIB:.2f} GiB of it" if self.reference_bytes else ""
        free_disk = (f" (free: {self.free_disk_bytes / GIB:.1f} GiB)" if self.free_disk_bytes is not None else "")
        out.append(f"disk: at most {self.disk_bytes / GIB:.2f} GiB at once beside the output{ref}{free_disk}")
        free = (f" (available: {self.available_bytes / GIB:.1f} GiB)" if self.available_bytes is not None else "")
        out.append(f"predicted: {self.seconds:.0f} s, peak memory {self.peak_bytes / GIB:.2f} GiB{free}")
        if not self.fits:
            out.append("warning: the conversion is predicted to need more memory than this machine has available")
        if not self.fits_disk:
            out.append("warning: the conversion needs more disk beside the output than is free there; it will refuse")
        return out


def _describe(o: dict) -> str:
    what = o["mode"] if o["mode"] != "river" else f"tau {o['threshold']}"
    extra = f" tail {o.get('tail', 0)}" if o["mode"] != "backbone" else ""
    return what + extra + (" (backbone attention)" if o.get("river_attention") == "backbone" else "")


def available_memory() -> Optional[int]:
    """MemAvailable of /proc/meminfo, in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class _Tokenizer:
    """The model's vocabulary with Model.tokenize's signature, for counting the calibration text."""

    def __init__(self, path: str):
        with captured_llama_log(LlamaLog()), suppress_stdout_stderr(), deferred_interrupts():
            self._vocab = native.Vocab(path)

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> List[int]:
        return list(self._vocab.tokenize(text, add_special, parse_special))


def _infos(types: Dict[str, str], shapes: Dict[str, tuple]) -> List[tuple]:
    out = []
    for name, t in types.items():
        if name not in shapes:
            continue
        block, size = GGML_QUANT_SIZES[QT[t]]
        n = int(np.prod(shapes[name]))
        out.append((name, TensorInfo(shapes[name], QT[t], n // block * size)))
    return out


def _probe(path: str, tokens: List[int], n_threads: int) -> tuple:
    """(seconds to read the weights, seconds per token of a batched F16 pass, tau's profile): the
    profile is the conversion's own (similarity_profile, batched), taken first, cold; then one
    warm batched pass over `tokens` times a token."""
    model = open_model(path, n_ctx=max(PROFILE_TOKENS, len(tokens)) + 1, n_batch=max(PROFILE_TOKENS, len(tokens)),
                       n_threads=n_threads, mode="backbone", repack=False)
    try:
        t0 = time.perf_counter()
        sims = similarity_profile(model, own_engine=False)
        t1 = time.perf_counter()
        model.logits(tokens)
        per_token = (time.perf_counter() - t1) / len(tokens)
        return max(t1 - t0 - (len(sims) + 1) * per_token, 0.0), per_token, sims
    finally:
        del model


def _head_share(shapes: Dict[str, tuple]) -> float:
    """The head's share of a token's pass: its weights over all the weights. The probe's token
    runs the head; an imatrix token does not (the head's statistics are the final norm's rows)."""
    n_embd, n_vocab = shapes["token_embd.weight"][:2]
    return n_embd * n_vocab / sum(int(np.prod(v)) for v in shapes.values())


def _probe_quantize(type_names: List[str], n_threads: int, n_elements: int = 1 << 22) -> Dict[str, float]:
    """Seconds per element ggml takes to quantize rows of 4,096 to each type, with importance."""
    cols = 4096
    x = np.random.default_rng(0).standard_normal((n_elements // cols, cols)).astype(np.float32)
    imp = np.ones(cols, dtype=np.float32)
    out = {}
    for t in sorted(set(type_names)):
        qt = QT[t]
        if qt in (QT.F32, QT.F16, QT.BF16) or cols % GGML_QUANT_SIZES[qt][0]:
            continue
        t0 = time.perf_counter()
        native.quantize_rows(int(qt), x, imp, n_threads)
        out[t] = (time.perf_counter() - t0) / x.size
    return out


def plan_conversion(backbone_path, out_path, *, river_type: str = build.DEFAULT_RIVER_TYPE, river_path=None,
                    imatrix=build.IMATRIX_AUTO, backbone_type: Optional[str] = build.DEFAULT_BACKBONE_TYPE,
                    presets: bool = True, threshold: Optional[float] = None, river_head_type: Optional[str] = None,
                    calibration_tokens: Optional[int] = None, n_threads: int = 2, probe: bool = True) -> ConversionPlan:
    """The plan of build_river_gguf with these options (the same checks of the input first)."""
    backbone_path, out_path = os.fspath(backbone_path), os.fspath(out_path)
    if not os.path.exists(backbone_path):
        raise FileNotFoundError(f"model file not found: {backbone_path}")
    n_layer = int(check_loadable(backbone_path)["n_layer"])
    reader = open_reader(backbone_path)
    if is_river_gguf(reader):
        raise ValueError(f"{backbone_path} already is a River GGUF: the dry run plans conversions of plain files")
    tensors = list(plain_tensors(reader))
    shapes = {t.name: tuple(int(x) for x in t.shape) for t in tensors}
    in_types = {t.name: type_name(t) for t in tensors}
    quantized = build.is_quantized(reader)
    F = os.path.getsize(backbone_path)
    calibration_tokens = calibration_tokens or build.calibration_token_budget(F)
    backbone_type = build.stored_backbone_type(backbone_type, reader)
    river_type = str(river_type).lower()
    collect = build.collects_imatrix(imatrix, river_path)
    res = ConversionPlan(backbone_path, out_path, available_bytes=available_memory(), notes=[UNMEASURED])

    # Types: llama.cpp's dry runs, so nothing is guessed about its mix.
    rv_types = (planned_types(backbone_path, river_type, n_threads, quantized, river_head_type,
                              importance=imatrix is not None) if river_path is None
                else {t.name: type_name(t) for t in open_reader(river_path).tensors})
    bb_types = planned_types(backbone_path, backbone_type, n_threads, quantized) if backbone_type else in_types
    bb_infos, rv_infos = _infos(bb_types, shapes), _infos(rv_types, shapes)
    bb_bytes = sum(i.n_bytes for _, i in bb_infos)
    rv_bytes = sum(i.n_bytes for n, i in rv_infos if n.startswith("blk.") or n in ("token_embd.weight", "output.weight"))
    largest = max(int(np.prod(s)) for s in shapes.values())

    # The calibration text, counted with the model's vocabulary.
    tok = _Tokenizer(backbone_path)
    prepared, held = (calibration_selection(tok, calibration_tokens, build.preset_score_tokens(calibration_tokens))
                      if presets else ([], []))
    imx_tokens = (sum(len(c) for c in text_chunks(tok.tokenize, build.imatrix_texts(calibration_tokens, held),
                                                  build.PASS_N_CTX)) if collect else 0)
    ref_tokens = sum(len(t) for t, _ in prepared)
    profile = PROFILE_TOKENS if build.needs_profile(threshold is None, presets) else 0

    sims = None
    if probe:
        text = tok.tokenize(" ".join(calibration_texts()[:4]), True)[:PROBE_TOKENS]
        load, per_token, sims = _probe(backbone_path, text, n_threads)
        q_rate = _probe_quantize(list(rv_types.values()) + list(bb_types.values()), n_threads)
    else:
        per_token, load, q_rate = float("nan"), float("nan"), {}
    n_vocab = shapes["token_embd.weight"][1]
    # The logits held at once: the longest held-out item's, in the engine and as the array it returns.
    logits_bytes = 2 * max((len(t) - p for t, p in prepared), default=1) * n_vocab * 4
    kv_width = max((s[1] for n, s in shapes.items() if n.endswith("attn_k.weight")), default=0)
    kv = 2 * n_layer * build.PASS_N_CTX * 2 * kv_width  # K and V, F16, of the pass's context

    if collect or presets or profile:
        parts = []
        if collect:
            parts.append(f"imatrix on {imx_tokens} tokens")
        if presets:
            parts.append(f"the presets' reference on {len(prepared)} held-out items ({ref_tokens} tokens)")
        if profile:
            parts.append(f"tau's profile ({profile} tokens)")
        units = {"PASS_FACTOR": per_token * (imx_tokens * (1.0 - _head_share(shapes)) + ref_tokens + profile),
                 "FIXED_SECONDS": 1.0}  # an imatrix token runs no head (_head_share), the probe's does
        res.stages.append(Stage("one pass over the input", "; ".join(parts), load + _priced(units),
                                F + kv + logits_bytes + BASE_BYTES, units, load))

    def quant_units(types: Dict[str, str]) -> Dict[str, float]:
        total = 0.0
        for name, t in types.items():
            if name in shapes and t in q_rate and in_types.get(name) != t:
                total += q_rate[t] * int(np.prod(shapes[name]))
        return {"QUANT_FACTOR": total, "IO_SECONDS_PER_GIB": F / GIB}

    slab = min(QUANT_BUFFER_BYTES, 4 * largest) * 2 + 2 * largest  # f32 rows, their quants, the source pages
    if river_path is None:
        res.stages.append(Stage("river", f"{river_type}{'+imatrix' if imatrix is not None else ''} by llama.cpp's "
                                f"quantizer, {rv_bytes / GIB:.2f} GiB", _priced(quant_units(rv_types)), slab + BASE_BYTES,
                                quant_units(rv_types)))
    if backbone_type:
        res.stages.append(Stage("backbone", f"{backbone_type} by llama.cpp's quantizer, {bb_bytes / GIB:.2f} GiB",
                                _priced(quant_units(bb_types)), slab + BASE_BYTES, quant_units(bb_types)))
    if presets:
        stage, res.settings = _presets_stage(shapes, n_layer, bb_infos, rv_infos, sims, prepared, per_token, F)
        stage.peak_bytes = (bb_bytes + rv_bytes + _river_copies(rv_types, shapes, bb_bytes, rv_bytes, F)
                            + _item_rows_bytes(res.settings, prepared, n_vocab) + kv + logits_bytes + BASE_BYTES)
        res.stages.append(stage)
    # Disk beside the output: the converter's own accounting (build.disk_needed), with the
    # reference rows as the held-out items give them.
    header = F - sum(int(t.n_bytes) for t in tensors)
    river_file = sum(i.n_bytes for _, i in rv_infos) if river_path is None else 0
    res.disk_parts = {
        "river": river_file, "backbone": bb_bytes if backbone_type else 0,
        "output": header + bb_bytes + (river_file if river_path is None else os.path.getsize(river_path)),
        "reference": build.reference_rows_bytes(sum(len(t) - p for t, p in prepared), n_vocab) if presets else 0}
    res.disk_bytes = build.disk_needed(**res.disk_parts)
    try:
        res.free_disk_bytes = shutil.disk_usage(os.path.dirname(os.path.abspath(out_path))).free
    except OSError:
        res.free_disk_bytes = None
    units = {"IO_SECONDS_PER_GIB": (bb_bytes + rv_bytes + F) / GIB, "FIXED_SECONDS": 1.0}
    res.stages.append(Stage("write", f"{(bb_bytes + rv_bytes) / GIB:.2f} GiB, once", _priced(units),
                            bb_bytes + rv_bytes + BASE_BYTES, units))
    return res


def _river_copies(rv_types: Dict[str, str], shapes: Dict[str, tuple], bb_bytes: int, rv_bytes: int, F: int) -> int:
    """The bytes of the river's repacked copies the presets hold where the converter makes them
    (build.presets_repack): at most the river again."""
    layer_types = [t.upper() for n, t in rv_types.items() if n.startswith("blk.") and len(shapes.get(n, ())) >= 2]
    return rv_bytes if build.presets_repack(bb_bytes, rv_bytes, F, layer_types) else 0


def _item_rows_bytes(settings: List[dict], prepared, n_vocab: int) -> int:
    """The logits the presets hold at once: every setting of the plan's pass on the longest item
    (preset_grid compares them with the item's reference rows together)."""
    in_pass = sum(1 for r in settings if r["why"] in ("", SCREEN))
    return in_pass * max((len(t) - p for t, p in prepared), default=0) * n_vocab * 4


def _presets_stage(shapes: Dict[str, tuple], n_layer: int, bb_infos, rv_infos, sims, prepared, per_token: float,
                   F: int) -> tuple:
    """(the presets' stage, its memory left to the caller (0); the grid's rows: {"options",
    "relative_cost", "why"}): the settings cost_model.plan leaves in play, each a token-pass of
    the held-out items (river-only tails of a family sharing their river pass, dynamic ones by
    decode on a quarter of the items, screened tails on the screen items): the plan's pass. The
    search's later rounds are not counted: where it stops depends on the KLDs, which a dry run
    does not know, and it most often stops in the plan's pass (the walks' first two asks are in
    it; at the 1.5B shape with a Q4_0 river one round more, 22% of the stage, in
    BENCHMARKS.md)."""
    ref_tokens = sum(len(t) for t, _ in prepared)
    layers, head = tensor_costs(bb_infos, rv_infos, n_layer, "cost")
    bounds = tier_bounds_of(shapes, n_layer, layers, head)["bounds"]
    settings = grid(n_layer)
    guess = None if sims is None else (lambda s: predicted_mean_exit(
        sims, s.options.threshold, s.options.min_exit_layer, s.options.tail))
    why = plan(settings, layers, head, n_layer, bounds, guess, screen=True)
    river_only = step_bytes(layers, head, n_layer, -1, 0, True)
    rows = [{"options": o, "relative_cost": setting_cost(o, layers, head, n_layer) / river_only, "why": w}
            for o, w in zip(settings, why)]
    work = 0.0
    in_play = [not w or w in (SEARCHED, SCREEN) for w in why]
    # The river-only tails, grouped as the presets' scoring groups them (cost_model.tail_families):
    # those the plan's pass measures, a screened one on the screen items.
    in_families = {i for f in tail_families(settings) for i in f}
    for i, s in enumerate(settings):
        if not in_play[i] or i in in_families:
            continue
        if s.options.mode == "backbone":
            work += ref_tokens  # measured on every item, batched
        else:
            work += DECODE_FACTOR * ref_tokens / 4  # decode, a quarter of the items
    # A family's tails share one river pass; each tail then runs its backbone layers over the
    # item and the head over its scored rows (the head's share of a token-pass: its weights
    # over all the weights).
    head_share = _head_share(shapes)
    scored = sum(len(t) - p for t, p in prepared)
    share = (sum(len(prepared[k][0]) for k in screen_items(len(prepared))) / ref_tokens) if prepared else 0.0
    for family in tail_families(settings):
        full = [settings[i].options.tail for i in family if not why[i]]
        screened = [settings[i].options.tail for i in family if why[i] == SCREEN]
        if full:
            work += ref_tokens * (1 + sum(full) / n_layer) + scored * head_share * (len(full) - 1)
            work += share * (ref_tokens * sum(screened) / n_layer + scored * head_share * len(screened))
        elif screened:
            work += share * (ref_tokens * (1 + sum(screened) / n_layer) + scored * head_share * (len(screened) - 1))
    n_searched = sum(1 for w in why if w == SEARCHED)
    units = {"presets_factor": per_token * work, "FIXED_SECONDS": 1.0}
    n_screened = sum(1 for w in why if w == SCREEN)
    return Stage("presets", f"{sum(1 for w in why if not w)} of {len(settings)} settings measured, {n_screened} "
                 f"screened on {len(screen_items(len(prepared)))} of {len(prepared)} items, and of "
                 f"{n_searched} river-only tails searched those the search reaches (timed here as if it stopped "
                 "in the plan's pass)", _priced(units, F), 0.0, units), rows
