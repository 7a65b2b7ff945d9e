"""Build a River GGUF: a backbone GGUF plus a low-precision copy of its layers (the exit river).

    from river_gguf.convert.build import build_river_gguf
    build_river_gguf("model.f16.gguf", "model.river.gguf")   # Q8_0 backbone, imatrix Q4_K_M river
    build_river_gguf("model.f16.gguf", "out.gguf", river_path="model.q4_k_m.gguf")

The output is the backbone GGUF, every tensor and metadata key unchanged (same order, same
types, same bytes), plus ``river.*`` metadata: the exit defaults (threshold, min exit layer,
head, prefill, tail, presets), where the river came from, and the river's index. The river's
tensors (per-layer ``river.blk.N.<name>``, the embedding table ``river.token_embd.weight`` and,
for untied models, the head ``river.output.weight``) follow the backbone's data, outside the GGUF
tensor index (gguf/river_index.py, format version 2; docs/format.md). Stock llama.cpp therefore opens a
River GGUF as its plain backbone, bit-identical to the backbone file; river_gguf finds the river.
Files of format 1 (river tensors in the GGUF index, which llama.cpp refuses) are still read, and
``upgrade_river_gguf`` (``river-gguf upgrade``) rewrites them as format 2.

Why the defaults are a Q8_0 backbone and an imatrix Q4_K_M river (``backbone_type="auto"``:
Q8_0 when the input's weights are floats): measured by KL divergence from F16, the field's
measure, the base quant decides most of a file's closeness, and the presets can only mix what the
file holds. On SmolLM2-135M (BENCHMARKS.md) an F16 backbone with a Q4_0 river was dominated by
llama.cpp's imatrix Q4_K_M at every preset, while this pair gives, at Q4_K_M's speed, the
river-only step with the backbone's Q8_0 attention (KLD 0.015 against Q4_K_M imatrix's 0.026),
and at Q8_0's speed the Q8_0 backbone itself (llama.cpp's Q8_0, with joined weights). Q8_0 is
half F16's bytes at KLD ~0.003. Pass ``--backbone-type f16`` to keep the input's precision,
``--river-type q4_0`` for the fastest river. q4_1 (and q5_1) is a bad river for the default
model: the F16 SmolLM2 is itself a dequantized Q4_1, so such a river reproduces the backbone
nearly exactly; likewise a Q4_K_M river of a model dequantized from Q4_K_M (model_zoo picks
q4_0 for those).

The command line (``river-gguf convert``, ``tools/add_river_gguf.py``) is river_gguf.cli.convert_cmd.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import functools
import hashlib
import json
import math
import os
import shutil
import sys
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import gguf
import numpy as np
from llama_cpp._utils import suppress_stdout_stderr
from tqdm import tqdm

from .. import presets as presets_mod
from ..presets import GRID_KEY
from .._loader import native
from ..calibrate import open_model as _open_model
from ..calibrate import preset_grid
from ..gguf import io as gguf_io
from ..gguf import river_index
from ..gguf.copy import (arch, check_loadable, is_river_gguf, np_shape, open_reader, plain_tensors, reader_path,
                         temp_path, type_name, write_plain_copy, write_river_file)
from ..gguf.io import (FTYPES, LlamaLog, atomic_output, captured_llama_log, check_output_path, deferred_interrupts,
                       remove_own_temp_files, remove_stale_temp_files)
from ..gguf.meta import value_type
from ..gguf.river_index import FORMAT_VERSION, RIVER_PREFIX  # (2: the river after the backbone's data)
from ..measure import divergence
from ..measure.scoring import PRESET_CALIBRATION_TOKENS, PRESET_SCORE_TOKENS, calibration_selection
from ..options import EXIT_RULES, never_exit
from ..measure.profile import default_threshold, similarity_profile
from . import imatrix as imx

DEFAULT_TAIL = 0          # the default setting's tail; presets choose their own
IMATRIX_AUTO = "auto"     # collect the importance matrix on the calibration split
PREFILL_CHOICES = ("backbone", "river")
DEFAULT_RIVER_TYPE = "q4_k_m"
BACKBONE_TYPES = ("auto", "f16", "q8_0")
DEFAULT_BACKBONE_TYPE = "auto"  # Q8_0 when the input's weights are floats, else as given

# Tensor types that are not quantized: llama.cpp quantizes from these without "requantizing".
FLOAT_TYPE_NAMES = {"F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64"}

_MAX_LISTED = 6  # mismatches listed in one error message



def _mismatch(msg: str) -> Exception:
    return native.RiverMismatchError(msg)


# ----- reading --------------------------------------------------------------------------
def sha256_file(path: str, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


# ----- validation -----------------------------------------------------------------------
def compare_models(bb_reader, rv_reader, rv_tensors: Optional[Dict[str, Any]] = None,
                   bb_name: str = "backbone", rv_name: str = "river") -> None:
    """Raise RiverMismatchError listing how the river's model differs from the backbone's.

    ``rv_tensors`` (plain name -> reader tensor) defaults to the river file's own tensors.
    Checked: what the engine checks of a separate river (architecture, hyperparameters,
    vocabulary), then every per-layer tensor (same names, same shapes), plus the token embedding /
    output head shapes, which the files' tensors are copied by.
    """
    # The model: the engine's own check of a separate river (native/model_check.cpp).
    diffs: List[str] = list(native.model_differences(reader_path(bb_reader), reader_path(rv_reader)))
    if diffs and arch(bb_reader) != arch(rv_reader):  # then that is the one difference: no tensor compares
        raise _mismatch(f"the river is not the same model as the backbone: {diffs[0]}")

    bb = {t.name: t for t in plain_tensors(bb_reader)}
    rv = rv_tensors if rv_tensors is not None else {t.name: t for t in rv_reader.tensors}
    names = [n for n in bb if n.startswith("blk.")] + [n for n in rv if n.startswith("blk.") and n not in bb]
    for n in ("token_embd.weight", "output.weight"):
        if n in bb and n in rv:
            names.append(n)
    if "token_embd.weight" not in rv:
        diffs.append("token_embd.weight: in the backbone but not in the river")
    for n in names:
        if n not in rv:
            diffs.append(f"{n}: in the backbone but not in the river")
        elif n not in bb:
            diffs.append(f"{n}: in the river but not in the backbone")
        elif np_shape(bb[n]) != np_shape(rv[n]):
            diffs.append(f"{n}: shape {np_shape(rv[n])} in the river but {np_shape(bb[n])} in the backbone")
    if diffs:
        more = f" (and {len(diffs) - _MAX_LISTED} more)" if len(diffs) > _MAX_LISTED else ""
        raise _mismatch("the river is not the same model as the backbone: " + "; ".join(diffs[:_MAX_LISTED]) + more)


# ----- writing --------------------------------------------------------------------------
def upgrade_river_gguf(src: str, dst: str, progress: bool = True) -> dict:
    """Rewrite a River GGUF of format 1 (river tensors in the GGUF index) as format 2, which stock
    llama.cpp opens as its plain backbone. Same tensors, same bytes, same river.* settings.
    Returns {"from": old version, "to": FORMAT_VERSION}."""

    src, dst = os.fspath(src), os.fspath(dst)
    if not os.path.isfile(src):
        raise FileNotFoundError(f"model file not found: {src}")
    check_output_path(dst, inputs=[src])
    reader = open_reader(src)
    version = river_index.format_version(reader)
    if version == 0:
        raise ValueError(f"{src} is not a River GGUF (no river tensors or river.* keys)")
    if version >= FORMAT_VERSION:
        raise ValueError(f"{src} already is a River GGUF of format {version}")

    entries = [(k, f.contents(), f.types[0]) for k, f in reader.fields.items()
               if k.startswith(RIVER_PREFIX) and f.types and f.types[0] != gguf.GGUFValueType.ARRAY]
    entries = [(k, v, t) for k, v, t in entries if k != river_index.VERSION_KEY]
    plan = [(t.name, t) for t in plain_tensors(reader)]
    river_plan = [(t.name, t) for t in reader.tensors if t.name.startswith(RIVER_PREFIX)]
    with atomic_output(dst) as tmp:
        write_river_file(tmp, reader, entries, plan, river_plan, progress, f"upgrade {os.path.basename(dst)}")
    return {"from": version, "to": FORMAT_VERSION}


def _quantize(src: str, dst: str, river_type: str, n_threads: int, requantize: bool,
              head_type: Optional[str] = None) -> None:
    # A quantized backbone (e.g. Q8_0): llama.cpp refuses to requantize unless told to.
    gguf_io.quantize(src, dst, river_type, n_threads=n_threads, allow_requantize=requantize, head_type=head_type)


def _validate_options(threshold, min_exit_layer, prefill, river_head, n_layer) -> None:
    if threshold is not None:
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not math.isfinite(threshold):
            raise ValueError(f"threshold must be a finite number, got {threshold!r}")
    if isinstance(min_exit_layer, bool) or not isinstance(min_exit_layer, int) or not 0 <= min_exit_layer < n_layer:
        raise ValueError(f"min_exit_layer must be an int in [0, {n_layer - 1}], got {min_exit_layer!r}")
    if prefill not in PREFILL_CHOICES:
        raise ValueError(f"prefill must be one of {', '.join(PREFILL_CHOICES)}, got {prefill!r}")
    if not isinstance(river_head, bool):
        raise ValueError(f"river_head must be a bool, got {river_head!r}")


def build_river_gguf(
    backbone_path,
    out_path,
    *,
    river_type: str = DEFAULT_RIVER_TYPE,
    river_path=None,
    threshold: Optional[float] = None,
    exit_rule: str = EXIT_RULES[0],
    min_exit_layer: int = 0,
    river_head: bool = True,
    prefill: str = "backbone",
    replace_river: bool = False,
    progress: bool = True,
    n_threads: int = 2,
    tail: int = DEFAULT_TAIL,
    imatrix: Optional[str] = IMATRIX_AUTO,
    backbone_type: Optional[str] = DEFAULT_BACKBONE_TYPE,
    presets: bool = True,
    river_head_type: Optional[str] = None,
    finalize: Optional[Callable[[str], Optional[dict]]] = None,
    calibration_tokens: Optional[int] = None,
    report: Optional[Callable[[str], None]] = None,
    verbose: bool = False,
    imatrix_out=None,
) -> dict:
    """Write ``out_path``: the backbone GGUF plus a river; return the river.* metadata written.

    river_type: llama.cpp quantization type for a river made from the backbone (default q4_k_m,
        see the module docstring). Ignored when ``river_path`` is given.
    river_path: an existing GGUF of the same model (plain, not a River GGUF) to use as river.
    threshold: exit threshold tau; None profiles the backbone (measure.profile.default_threshold).
    exit_rule: the file's default exit rule (river.exit_rule): the threshold's profile, and the
        dynamic preset settings, are this rule's scores.
    replace_river: allow a River GGUF as backbone; its river is dropped and replaced.
    tail: the default backbone tail (river.tail): exited tokens rejoin the backbone for the last
        `tail` layers.
    imatrix: "auto" (default) collects an importance matrix from the backbone's activations on the
        calibration split and quantizes the river with ggml's importance-weighted rounding; a
        path reads one (llama.cpp's imatrix GGUF); None quantizes plainly, as llama.cpp does.
        Ignored when ``river_path`` is given.
    backbone_type: "auto" (default) stores the backbone as Q8_0 when the input's weight
        matrices are floats (F32/F16/BF16) and as given otherwise; None or "f16" keeps the
        backbone's tensors as they are; "q8_0" stores the backbone quantized to Q8_0. The river is
        always made from the input.
    presets: measure the preset settings that can win a tier (calibrate/cost_model.plan) on
        held-out calibration items, against the input's logits, and store fast/balanced/quality
        presets (river.presets) in the file.
    river_head_type: the river head's type (e.g. "q4_0"); None keeps llama.cpp's choice for
        river_type (Q8_0 for q4_0 on SmolLM2: a third of the river's bytes).
    calibration_tokens: scored tokens of the held-out items each static preset setting runs on
        (batched, prompt included; dynamic settings: by decode on a quarter of the items), and a
        tenth of the token budget of the imatrix collection; None (default) is
        measure.scoring.PRESET_CALIBRATION_TOKENS (768) at every size.
    report: called with one line per step (the river's quantization and its fallback types, the
        importance matrix, the threshold), for a caller to print; llama.cpp's own log is kept
        (gguf.io.captured_llama_log) and printed to stderr only with verbose=True.
    imatrix_out: a path to write the importance matrix the conversion collects to (llama.cpp's
        imatrix GGUF: ``llama-quantize --imatrix`` of the input with it makes the river's bytes);
        nothing is written when no matrix is collected.
    finalize: called with the path of the complete staged file (presets stored) before it is
        renamed to ``out_path``, e.g. to calibrate it; it may rewrite that file atomically
        (gguf.meta.set_river_metadata) and return metadata to add to the result. Such a rewrite
        writes the whole file again, by necessity: a GGUF's tensor data start right after its
        metadata, at the next multiple of general.alignment (32 bytes), so keys that add more
        than that padding move every tensor's bytes (the river's, after the backbone's, too);
        ``--calibrate``'s keys (six new ones) always do.

    Raises GGUFFormatError (not GGUF / truncated), UnsupportedModelError (architecture),
    RiverMismatchError (river is another model), ValueError (bad options, River GGUF input, an
    output path that is a folder or an input), FileNotFoundError (missing input or output folder)
    or PermissionError (output folder not writable) before anything is written. The inputs are
    never modified. The output path only ever holds a complete file: everything, presets
    included, is written to a hidden temp file in its folder, which is renamed into place at the
    end; intermediate and temp files are removed on every exit Python sees (KeyboardInterrupt
    included), and ones a killed conversion left behind are removed by the next one.
    """

    backbone_path, out_path, river_path, river_type, imatrix_file, calibration_tokens, backbone_type = _checked_options(
        backbone_path, out_path, river_path, river_type, imatrix, n_threads, calibration_tokens, backbone_type)
    if imatrix_out is not None:  # written mid-way: a path that cannot be written fails now
        imatrix_out = os.fspath(imatrix_out)
        check_output_path(imatrix_out, inputs=[backbone_path, river_path, imatrix_file, out_path])
    # Engine checks first: a truncated or foreign file is refused before the gguf package reads it.
    n_layer = int(check_loadable(backbone_path)["n_layer"])
    _validate_options(threshold, min_exit_layer, prefill, river_head, n_layer)
    if not isinstance(exit_rule, str) or exit_rule not in EXIT_RULES:
        raise ValueError(f"exit_rule must be one of {EXIT_RULES}, got {exit_rule!r}")
    if isinstance(tail, bool) or not isinstance(tail, int) or not 0 <= tail < n_layer:
        raise ValueError(f"tail must be an int in [0, {n_layer - 1}], got {tail!r}")
    if river_path is not None:
        check_loadable(river_path)
    bb = open_reader(backbone_path)
    if report is not None:
        report(f"read {os.path.basename(backbone_path)}: {len(bb.tensors)} tensors, "
               f"{os.path.getsize(backbone_path) / 2**20:.0f} MiB")
    backbone_type = stored_backbone_type(backbone_type, bb)
    if is_river_gguf(bb) and not replace_river:
        raise ValueError(
            f"{backbone_path} already is a River GGUF; pass replace_river=True (--replace-river) "
            "to replace its river, or start from the plain backbone"
        )
    # A given river is checked against the input before the pass over the input (minutes on a
    # large model): a River GGUF or another model is refused now.
    given_river = _river_from_file(river_path, bb) if river_path is not None else None
    # So is a given importance matrix: one of another model would stop llama.cpp's quantizer only
    # after that pass.
    given_imatrix = _imatrix_from_file(imatrix_file, bb) if imatrix_file is not None and river_path is None else None
    # Room on the output's file system for what the conversion keeps there at its peak (the
    # presets' reference rows included), checked before the work as the output path is.
    need = disk_plan(backbone_path, bb, river_type if river_path is None else None, backbone_type, river_head_type,
                     imatrix is not None, presets, calibration_tokens, n_threads, river_path=river_path)
    check_free_space(os.path.dirname(os.path.abspath(out_path)), need)

    log = LlamaLog(echo=(lambda line: print(line, file=sys.stderr)) if verbose else None)
    say = report if report is not None else (lambda line: None)
    folder, name = os.path.split(os.path.abspath(out_path))
    try:
        with captured_llama_log(log), temp_path(out_path, ".tmp") as staged:  # the output, complete before it gets its name
            # Intermediate files (river and backbone quantizations, a stripped copy) live until the
            # output is written, then go: only the staged output is on disk when finalize runs.
            with contextlib.ExitStack() as stack:
                plain = _plain_source(bb, backbone_path, out_path, stack)
                calib = stack.enter_context(_CalibrationPass(
                    plain(), folder, n_threads, progress, say,
                    imatrix=collects_imatrix(imatrix, river_path), threshold=threshold is None,
                    presets=presets, calibration_tokens=calibration_tokens, reference=preset_grid.reference_label(plain_tensors(bb)),
                    exit_rule=exit_rule))
                if imatrix_out is not None and calib.imatrix is not None:
                    imx.write_imatrix_gguf(calib.imatrix, imatrix_out)
                    say(f"imatrix: written to {imatrix_out}")
                if given_river is not None:
                    river_src, type_label, imatrix_meta = given_river
                else:
                    river_src, type_label, imatrix_meta = _make_river(
                        plain(), out_path, stack, bb, river_type, river_head_type, imatrix, calib.imatrix,
                        given_imatrix, n_threads, log, say)
                rv = open_reader(river_src)
                compare_models(bb, rv)
                # The inputs' hashes are read on one thread while the backbone is quantized, which
                # leaves part of the machine idle (llama.cpp's quantizer reads and writes between
                # its threads' blocks); the stack waits for it on every exit.
                hashes = stack.enter_context(concurrent.futures.ThreadPoolExecutor(1)).submit(
                    lambda: (sha256_file(backbone_path), sha256_file(river_src)))
                stored_path = _stored_backbone(plain, bb, backbone_type, out_path, stack, n_threads, log, say)
                entries, meta = _file_entries(backbone_path, river_path, river_src, type_label, threshold, calib,
                                              dict(exit_rule=exit_rule, min_exit_layer=min_exit_layer, prefill=prefill,
                                                   river_head=river_head, tail=tail), backbone_type, imatrix_meta,
                                              hashes.result(), say)
                if presets:
                    # Measured on the two parts before they are joined: the output is written once.
                    found = _measure_presets(stored_path, river_src, calib, n_threads, progress, calibration_tokens,
                                             os.path.getsize(backbone_path), layer_types(rv))
                    entries += [(k, v, value_type(v)) for k, v in found.items()]
                    meta.update(found)
                    _say_presets(found, say)
                calib.close()  # the reference rows' temp file goes now, before the output is written
                stored = open_reader(stored_path) if backbone_type is not None else bb
                _write_staged(staged, stored, rv, entries, progress, out_path, say)
                # The readers map files the stack is about to delete: drop them first, so no deleted
                # file's pages stay mapped (and its disk space held) while finalize runs.
                del bb, rv, stored
            if finalize is not None:
                meta.update(finalize(staged) or {})
            os.replace(staged, out_path)
    finally:
        # Each temp file is removed where it is made, but a Ctrl-C that lands inside one of those
        # removals (between its check and its unlink, or in a probe) cuts it short: sweep what this
        # process left of the output's temp files while the interrupt unwinds (a no-op otherwise).
        remove_own_temp_files(folder, name)
    return meta


def _checked_options(backbone_path, out_path, river_path, river_type, imatrix, n_threads, calibration_tokens,
                     backbone_type) -> tuple:
    """build_river_gguf's paths and options checked before anything is read (the output path
    first: a folder, an input, or a folder we cannot write to fails here, before minutes of work;
    llama.cpp's quantizer would only say "failed with code 1"), and stale temp files of the output
    removed. Returns (backbone_path, out_path, river_path, river_type, imatrix_file,
    calibration_tokens, backbone_type), normalized: backbone_type None means as given."""
    backbone_path = os.fspath(backbone_path)
    out_path = os.fspath(out_path)
    river_path = os.fspath(river_path) if river_path is not None else None
    if not os.path.exists(backbone_path):
        raise FileNotFoundError(f"model file not found: {backbone_path}")
    imatrix_file = None if imatrix in (None, IMATRIX_AUTO) else os.fspath(imatrix)
    check_output_path(out_path, inputs=[backbone_path, river_path, imatrix_file])
    remove_stale_temp_files(os.path.dirname(os.path.abspath(out_path)), os.path.basename(out_path))
    if river_path is None:
        river_type = str(river_type).lower()
        if river_type not in FTYPES:
            raise ValueError(f"unknown river type {river_type!r}; valid: {', '.join(sorted(FTYPES))}")
        if river_type in ("q4_1", "q5_1"):
            # Q5_1's grid holds Q4_1's (same min, half the step), so with an importance-weighted
            # search it too rebuilds a dequantized Q4_1 nearly exactly (measured: SmolLM2 river-only
            # ppl 3.969 vs the F16's 3.962).
            warnings.warn(
                f"river type {river_type}: if the backbone is a dequantized Q4_1 model (like the default SmolLM2 "
                f"F16), a {river_type.upper()} river reproduces it almost exactly; use q4_0 or q5_0",
                stacklevel=3,
            )
    if not isinstance(n_threads, int) or n_threads < 1:
        raise ValueError(f"n_threads must be an int >= 1, got {n_threads!r}")
    if calibration_tokens is not None and (isinstance(calibration_tokens, bool) or not isinstance(
            calibration_tokens, int) or calibration_tokens < MIN_CALIBRATION_TOKENS):
        raise ValueError(f"calibration_tokens must be an int >= {MIN_CALIBRATION_TOKENS}, got {calibration_tokens!r}")
    if calibration_tokens is None:
        calibration_tokens = calibration_token_budget(os.path.getsize(backbone_path))
    backbone_type = backbone_type_option(backbone_type)
    if imatrix_file is not None and not os.path.isfile(imatrix_file):
        raise FileNotFoundError(f"imatrix file not found: {imatrix}")
    return backbone_path, out_path, river_path, river_type, imatrix_file, calibration_tokens, backbone_type


def _stored_backbone(plain, bb, backbone_type: Optional[str], out_path: str, stack, n_threads: int, log: LlamaLog,
                     say) -> str:
    """The file the output's backbone is copied from: the plain input, or (backbone_type) its
    quantization, a temp file that lives as long as `stack`. The river came from the input."""
    if backbone_type is None:
        return plain()
    stored_path = stack.enter_context(temp_path(out_path, ".backbone-q.tmp"))
    mark = log.mark()
    _quantize(plain(), stored_path, backbone_type, n_threads, is_quantized(bb))
    say(f"backbone: {backbone_type}: {log.quantize_summary(mark)}")
    return stored_path


def _file_entries(backbone_path, river_path, river_src, type_label, threshold, calib, exit_setting: dict,
                  backbone_type, imatrix_meta, sha256: Tuple[str, str], say) -> tuple:
    """(the river.* entries of the output but its presets, the metadata they hold as read back):
    the exit defaults (the threshold given, or the calibration pass's profile), where the river
    came from (sha256: the backbone input's and the river file's), and the draft vocabulary's
    ranking."""
    if threshold is None:
        meta_threshold, source, prof = float(calib.profile["threshold"]), \
            f"profile-q{calib.profile['quantile']:.2f}", calib.profile
    else:
        meta_threshold, source, prof = float(threshold), "user", None
    entries = _river_entries(backbone_path, river_path, river_src, type_label, meta_threshold, source,
                             exit_setting["exit_rule"], exit_setting["min_exit_layer"], exit_setting["prefill"],
                             exit_setting["river_head"], exit_setting["tail"], backbone_type, imatrix_meta, prof,
                             sha256)
    ranking = calib.ranking if calib.ranking is not None else draft_token_ranking(backbone_path)
    say(f"draft vocabulary: {len(ranking)} tokens of the calibration text ranked")
    entries.append((native.DRAFT_TOKENS_KEY, ranking, gguf.GGUFValueType.ARRAY))
    meta: Dict[str, Any] = {k: v for k, v, _ in entries}
    # float32 as stored, so callers compare against what Model(out).metadata reads
    meta["river.threshold"] = float(np.float32(meta_threshold))
    if prof is not None:
        meta["river.profile_predicted_mean_exit_layer"] = float(np.float32(prof["predicted_mean_exit_layer"]))
    return entries, meta


def _say_presets(found: dict, say) -> None:
    grid = json.loads(found[GRID_KEY])
    measured = [r for r in grid if "kld" in r]
    tokens = found["river.presets_calibration_tokens"]
    say(f"presets: {', '.join(presets_mod.parse(found))} chosen; {len(measured)} of {len(grid)} settings "
        f"measured (the cost model and the search of the tails rule out the rest), at least {tokens} "
        f"tokens each, against the {found[preset_grid.REFERENCE_KEY]}")


def _write_staged(staged: str, bb, rv, entries: list, progress: bool, out_path: str, say) -> None:
    """The output: the stored backbone's tensors, then the river's (its layers, embedding and
    head), with `entries` as river.* metadata."""
    rv_by_name = {t.name: t for t in rv.tensors}
    tensor_plan = [(t.name, t) for t in plain_tensors(bb)]
    river_plan = [(RIVER_PREFIX + t.name, t) for t in rv.tensors if t.name.startswith("blk.")]
    river_plan.append((RIVER_PREFIX + "token_embd.weight", rv_by_name["token_embd.weight"]))
    if "output.weight" in rv_by_name:
        river_plan.append((RIVER_PREFIX + "output.weight", rv_by_name["output.weight"]))
    write_river_file(staged, bb, entries, tensor_plan, river_plan, progress, f"river {os.path.basename(out_path)}")
    say(f"wrote {len(tensor_plan) + len(river_plan)} tensors, {os.path.getsize(staged) / 2**20:.0f} MiB")


def disk_needed(river: int, backbone: int, output: int, reference: int) -> int:
    """The most bytes a conversion keeps in its output's folder at once: the river and the
    quantized backbone (temp files, until the output is written) with, first, the presets'
    reference rows (an unlinked temp file: held-out scored rows x vocabulary x 4 bytes, closed
    before the write) and then the output itself."""
    return river + backbone + max(reference, output)


def reference_rows_bytes(scored_rows: int, n_vocab: int) -> int:
    """The presets' reference rows on disk: one float32 logit per vocabulary entry per scored row."""
    return int(scored_rows) * int(n_vocab) * 4


def planned_bytes(types: Dict[str, str], shapes: Dict[str, tuple]) -> int:
    """Bytes of the tensors ``shapes`` (ggml order) at the ggml types ``types`` (names, as
    gguf.io.planned_types gives them)."""
    total = 0
    for name, t in types.items():
        if name in shapes:
            block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[t]]
            total += int(np.prod(shapes[name])) // block * size
    return total


def disk_plan(backbone_path: str, bb, river_type: Optional[str], backbone_type: Optional[str],
              river_head_type: Optional[str], importance: bool, presets: bool, calibration_tokens: int, n_threads: int,
              river_path: Optional[str] = None) -> dict:
    """What a conversion keeps in its output's folder (disk_needed), from llama.cpp's dry runs of
    its quantizer (nothing written): {"river", "backbone", "output", "reference", "need"} in bytes.
    river_type: None when the river is the given file ``river_path`` (read in place, copied into
    the output); backbone_type: None when the
    backbone is stored as given. The reference rows are counted at their most: the held-out items
    stop at the first past calibration_tokens scored rows, each at most preset_score_tokens."""
    tensors = list(plain_tensors(bb))
    shapes = {t.name: tuple(int(x) for x in t.shape) for t in tensors}
    requant = is_quantized(bb)
    river = (planned_bytes(gguf_io.planned_types(backbone_path, river_type, n_threads, requant, river_head_type,
                                                 importance=importance), shapes) if river_type else 0)
    stored = (planned_bytes(gguf_io.planned_types(backbone_path, backbone_type, n_threads, requant), shapes)
              if backbone_type else sum(int(t.n_bytes) for t in tensors))
    quantized_backbone = stored if backbone_type else 0
    header = os.path.getsize(backbone_path) - sum(int(t.n_bytes) for t in tensors)  # metadata, vocabulary
    output = header + stored + (river if river_type else os.path.getsize(river_path) if river_path else 0)
    n_vocab = shapes["token_embd.weight"][1] if "token_embd.weight" in shapes else 0
    reference = (reference_rows_bytes(calibration_tokens + preset_score_tokens(calibration_tokens), n_vocab)
                 if presets else 0)
    return {"river": river, "backbone": quantized_backbone, "output": output, "reference": reference,
            "need": disk_needed(river, quantized_backbone, output, reference)}


def check_free_space(folder: str, plan: dict) -> None:
    """OSError (ENOSPC) when ``folder``'s file system has less free space than ``plan["need"]``."""
    free = shutil.disk_usage(folder).free
    if plan["need"] > free:
        gib = 1 << 30
        raise OSError(errno.ENOSPC,
                      f"not enough free space in {folder}: the conversion needs about {plan['need'] / gib:.2f} GiB "
                      f"there at once (river {plan['river'] / gib:.2f}, quantized backbone "
                      f"{plan['backbone'] / gib:.2f}, then the presets' reference rows {plan['reference'] / gib:.2f} "
                      f"or the output {plan['output'] / gib:.2f}), and {free / gib:.2f} GiB are free")


class _CalibrationPass:
    """The one pass over the input (the precise model) a conversion makes, in one engine that
    reads the weights in place (no repacked copies; ggml repacks no F16 on x86, and the F16's
    logits measured the same bit for bit either way): the held-out items the presets are scored
    on, prepared; the importance matrix, collected on the rest of the calibration text; the input's
    logits on the held-out items (the presets' reference, kept on disk); and the exit-rule profile
    that sets tau. Each part only when asked for."""

    def __init__(self, path: str, folder: str, n_threads: int, progress: bool, say, *, imatrix: bool, threshold: bool,
                 presets: bool, calibration_tokens: int, reference: str, exit_rule: str = EXIT_RULES[0]):
        self.exit_rule = exit_rule
        self.imatrix = None
        self.profile = None
        self.sims = None
        self.ranking = None
        self.prepared = None
        self.reference = None
        if not (imatrix or threshold or presets):
            return
        # The pass owns its reference rows' file from the moment it opens it: a failure (or Ctrl-C)
        # before __init__ returns closes it here, since no caller holds the pass yet to close it.
        try:
            self._run(path, folder, n_threads, progress, say, imatrix, threshold, presets, calibration_tokens,
                      reference)
        except BaseException:
            self.close()
            raise

    def _run(self, path, folder, n_threads, progress, say, imatrix, threshold, presets, calibration_tokens,
             reference) -> None:
        model = _open_model(path, n_ctx=PASS_N_CTX, n_threads=n_threads, mode="backbone", repack=False)
        try:
            held: list = []
            if presets:
                self.reference = divergence.ReferenceRows(reference, folder)
                self.prepared, held = calibration_selection(model, calibration_tokens,
                                                            preset_score_tokens(calibration_tokens))
            if imatrix:
                texts = imatrix_texts(calibration_tokens, held)
                self.imatrix = imx.collect_on(model, texts, progress=progress, dataset=IMATRIX_DATASET)
                say(f"imatrix: {int(self.imatrix.n_tokens)} tokens of {len(texts)} texts "
                    f"({len(held)} items held out for the presets)")
            if presets:
                with tqdm(total=len(self.prepared), desc="reference", unit="item", disable=not progress) as bar:
                    n = self.reference.add_logits_of(model, self.prepared, bar)
                say(f"reference: the {reference}'s logits on {len(self.prepared)} held-out items ({n} scored tokens)")
            if needs_profile(threshold, presets):
                self.sims = similarity_profile(model, own_engine=False, exit_rule=self.exit_rule)
            if threshold:
                self.profile = default_threshold(model, sims=self.sims, exit_rule=self.exit_rule)
                say(f"threshold: {self.profile['threshold']:.4f} ({self.exit_rule}, "
                    f"profile-q{self.profile['quantile']:.2f})")
            self.ranking = draft_token_ranking(None, tokenize=functools.partial(model.tokenize, add_special=False))
        finally:
            del model  # not kept alive by a traceback's frame either

    def close(self) -> None:
        if self.reference is not None:
            self.reference.close()
            self.reference = None

    def __enter__(self) -> "_CalibrationPass":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


#: What the presets' stage may hold besides its two parts' weights and the river's repacked
#: copies, so that the conversion stays within its input's size + 2 GiB (BENCHMARKS.md's line):
#: the pass's KV cache, a batch's logits, Python and the engine's buffers.
PRESETS_ALLOWANCE = 1 << 30
#: The most past its input's size a conversion may hold.
PEAK_OVER_INPUT = 2 << 30


#: River layer types whose repacked CPU kernels pay in the presets' batches: ggml's repacked Q4_0
#: ran a Q4_0 river's batched passes 1.2-1.6x faster on AVX2, its repacked Q4_K no faster, for
#: 0.6 GiB more at the 1.5B shape (BENCHMARKS.md), so a K-quant river is read in place.
REPACK_PAYS = ("Q4_0",)


def presets_repack(backbone_bytes: int, river_bytes: int, input_bytes: int, river_types: Sequence[str]) -> bool:
    """Whether the presets run the river on ggml's repacked copies of its weights, as a loaded
    file runs it: where its layers' most common type is one whose repacked kernels pay
    (REPACK_PAYS) and the backbone, the river and the copies (at most the river again) fit under
    the input's size + PEAK_OVER_INPUT with PRESETS_ALLOWANCE to spare (not an 8B's). The
    repacked kernels round differently from the plain ones, so the river's settings are then
    measured as they run in use. river_types: the type name of each river layer weight."""
    types = list(river_types)
    main = max(set(types), key=types.count) if types else ""
    return (main in REPACK_PAYS
            and backbone_bytes + 2 * river_bytes + PRESETS_ALLOWANCE <= input_bytes + PEAK_OVER_INPUT)


def _measure_presets(backbone: str, river: str, calib: _CalibrationPass, n_threads: int, progress: bool,
                     calibration_tokens: int, input_bytes: int, river_types: Sequence[str]) -> dict:
    """The preset keys of the output, measured on its backbone and river files."""
    # The backbone is read in place, though a loaded file repacks it: the copies (and the joined
    # Q/K/V, gate/up that come with them) would hold it a second time while the presets are
    # measured; ggml repacks no Q8_0 or F16 on x86, so its numbers are the same bit for bit. A
    # Q4_0 river runs on its repacked copies where they fit (presets_repack), others in place:
    # then ggml's repacked Q4_0/Q4_K kernels (x86) round differently from what was measured (on
    # SmolLM2's default file the river settings' KLDs came out 0.0002-0.0005 lower repacked,
    # 1-2%, every paired interval holding 0, and the same three presets chosen). docs/usage.md.
    repack = ("river" if presets_repack(os.path.getsize(backbone), os.path.getsize(river), input_bytes, river_types)
              else False)
    model = _open_model(backbone, river=river, n_ctx=PASS_N_CTX, n_threads=n_threads,
                        threshold=never_exit(calib.exit_rule), exit_rule=calib.exit_rule, repack=repack)
    try:
        res = preset_grid.calibrate_presets(model, score_tokens=preset_score_tokens(calibration_tokens),
                                            progress=progress, prepared=calib.prepared, reference=calib.reference,
                                            prune=True, profile=calib.sims, exit_rule=calib.exit_rule)
    finally:
        del model
    return preset_grid.preset_metadata(res)


def draft_token_ranking(vocab_path: Optional[str], texts: Optional[List[str]] = None,
                        tokenize: Optional[Callable[[str], List[int]]] = None) -> List[int]:
    """The calibration text's tokens, most frequent first (ties: lower id first), as stored under
    river.draft_tokens: the ranking lossless decoding's draft vocabulary takes its tokens from
    (native/draft_vocab.h). texts: default imatrix.calibration_texts(). tokenize: the text's
    tokens without BOS (e.g. an open Model's), instead of loading vocab_path's vocabulary."""
    if tokenize is None:
        # libllama's vocabulary warnings: the converter is quiet; Ctrl-C is held while it loads (its
        # log callback would drop the KeyboardInterrupt)
        with suppress_stdout_stderr(), deferred_interrupts():
            vocab = native.Vocab(vocab_path)
        tokenize = lambda text: vocab.tokenize(text, False, False)  # noqa: E731
    counts: Dict[int, int] = {}
    for text in imx.calibration_texts() if texts is None else texts:
        for t in tokenize(text):
            counts[t] = counts.get(t, 0) + 1
    return [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]


def layer_types(reader) -> List[str]:
    """The type name of each layer weight matrix (blk.*) of a GGUF reader's model."""
    return [type_name(t) for t in plain_tensors(reader) if len(t.shape) >= 2 and t.name.startswith("blk.")]


def is_quantized(reader) -> bool:
    """Whether any weight matrix of the GGUF ``reader`` is quantized (not a float type)."""
    return any(type_name(t) not in FLOAT_TYPE_NAMES for t in plain_tensors(reader) if len(t.shape) >= 2)


def _plain_source(bb, backbone_path: str, out_path: str, stack):
    """A function giving the backbone as a plain GGUF to quantize from: the input itself, or (a
    River GGUF whose river is replaced) a copy without its river, written once when first asked."""
    made: List[str] = []

    def plain() -> str:
        if not is_river_gguf(bb):
            return backbone_path
        if not made:
            made.append(stack.enter_context(temp_path(out_path, ".backbone.tmp")))
            write_plain_copy(bb, made[0])
        return made[0]

    return plain


def _river_from_file(river_path: str, bb):
    rv = open_reader(river_path)
    if is_river_gguf(rv):
        raise ValueError(f"river {river_path} is itself a River GGUF; pass a plain GGUF (or build from the backbone)")
    compare_models(bb, rv)
    return river_path, "from-file", []


def _imatrix_from_file(path: str, bb) -> imx.Imatrix:
    """The importance matrix file `path`, checked against the input's weights (imatrix.check_fits)."""
    imat = imx.read_imatrix_gguf(path)
    imx.check_fits(imat, plain_tensors(bb), path)
    return imat


def _make_river(src: str, out_path: str, stack, bb, river_type: str, river_head_type, imatrix, collected, given,
                n_threads: int, log: LlamaLog, say) -> Tuple[str, str, list]:
    """Quantize the river from `src` with llama.cpp's quantizer, given the importance matrix
    (the option imatrix: "auto", the one `collected` by the pass; a path, the one read from it,
    `given`) unless imatrix is None: (its file, its type label, the river.imatrix* entries)."""
    requant = is_quantized(bb)
    if requant:
        warnings.warn(f"{src} is already quantized; the river is requantized from it", stacklevel=3)
    imat, entries = None, []
    if imatrix is not None:
        if imatrix == IMATRIX_AUTO:
            imat, label = collected, f"collected: {collected.datasets[0] if collected.datasets else 'calibration split'}"
        else:
            imat, label = given, f"file: {os.path.basename(os.fspath(imatrix))}"
            say(f"imatrix: {int(imat.n_tokens)} tokens ({label})")
        entries = [("river.imatrix", label, "s"), ("river.imatrix_tokens", int(imat.n_tokens), "u")]
    river_src = stack.enter_context(temp_path(out_path, ".river.tmp"))
    mark = log.mark()
    imx.llama_quantize(src, river_src, river_type, imat, n_threads=n_threads, allow_requantize=requant,
                       head_type=river_head_type)
    type_label = river_type + ("+imatrix" if imat is not None else "")
    if river_head_type is not None:
        type_label += f" (head {river_head_type})"
    say(f"river: {type_label}, llama.cpp's types: {log.quantize_summary(mark)}")
    return river_src, type_label, entries


def _river_entries(backbone_path, river_path, river_src, type_label, threshold, source, exit_rule, min_exit_layer,
                   prefill, river_head, tail, backbone_type, imatrix_meta, prof, sha256: Tuple[str, str]) -> list:
    """The river.* keys of the file (docs/format.md)."""
    VT = gguf.GGUFValueType
    entries = [
        ("river.format_version", FORMAT_VERSION, VT.UINT32),
        ("river.type", type_label, VT.STRING),
        ("river.threshold", threshold, VT.FLOAT32),
        ("river.threshold_source", source, VT.STRING),
        ("river.exit_rule", exit_rule, VT.STRING),
        ("river.min_exit_layer", int(min_exit_layer), VT.UINT32),
        ("river.prefill", prefill, VT.STRING),
        ("river.head", bool(river_head), VT.BOOL),
        ("river.backbone_file", os.path.basename(backbone_path), VT.STRING),
        ("river.backbone_sha256", sha256[0], VT.STRING),
        ("river.river_file", os.path.basename(river_path) if river_path else f"(quantized {type_label})", VT.STRING),
        ("river.river_sha256", sha256[1], VT.STRING),
        ("river.tail", int(tail), VT.UINT32),
        ("river.backbone_type", backbone_type or "as input", VT.STRING),
    ]
    entries += [(k, v, VT.STRING if t == "s" else VT.UINT32) for k, v, t in imatrix_meta]
    if prof is not None:
        entries.append(("river.profile_predicted_mean_exit_layer", float(prof["predicted_mean_exit_layer"]),
                        VT.FLOAT32))
    return entries


# ----- how much calibration -------------------------------------------------------------
# The presets score the static settings in play batched (each item whole, in one pass per setting;
# river-only tails share their river layers), and the dynamic ones by decode on a quarter of the
# items; the imatrix is a batched prefill over about 9x the tokens. So the default is the same at
# every size.
DEFAULT_CALIBRATION_TOKENS = PRESET_CALIBRATION_TOKENS
MIN_CALIBRATION_TOKENS = 32


def calibration_token_budget(backbone_bytes: int) -> int:
    """The default calibration tokens per preset setting (the same for a backbone of any size)."""
    return DEFAULT_CALIBRATION_TOKENS


def preset_score_tokens(calibration_tokens: int) -> int:
    """Scored tokens per calibration item: PRESET_SCORE_TOKENS, fewer when the whole budget is small."""
    return (PRESET_SCORE_TOKENS if calibration_tokens >= 2 * PRESET_SCORE_TOKENS
            else max(16, min(64, calibration_tokens // 2)))


IMATRIX_DATASET = "calibration split (gsm8k, humaneval; item % 5 == 0), the presets' items held out"


def imatrix_texts(calibration_tokens: int, held_out=()) -> List[str]:
    """The calibration texts for the imatrix, less the held-out items (the presets'), cut to
    about 10x calibration_tokens tokens (at ~4 characters a token; the default 768 keeps all of
    them, ~7,000 tokens once the presets' ~10 items are held out)."""

    texts, chars = [], 0
    for t in imx.calibration_texts(held_out=held_out):
        if texts and chars + len(t) > 40 * calibration_tokens:
            break
        texts.append(t)
        chars += len(t)
    return texts


# ----- the conversion's decisions (convert/dry_run.py plans with the same functions) ---------
#: The context of the pass over the input and of the presets' engine: the importance matrix's
#: texts are each cut to it (imatrix.collect_on, imatrix.text_chunks).
PASS_N_CTX = 1024


def backbone_type_option(backbone_type: Optional[str]) -> Optional[str]:
    """The backbone_type option checked and normalized: "auto", "q8_0", or None for the input's
    own tensors (None or "f16"). ValueError for anything else."""
    if backbone_type is None:
        return None
    backbone_type = str(backbone_type).lower()
    if backbone_type not in BACKBONE_TYPES:
        raise ValueError(f"backbone_type must be one of {', '.join(BACKBONE_TYPES)}, got {backbone_type!r}")
    return None if backbone_type == "f16" else backbone_type


def stored_backbone_type(backbone_type: Optional[str], reader) -> Optional[str]:
    """The type the output stores the backbone in, for the input ``reader``: "auto" is Q8_0 when
    the input's weight matrices are floats and the input's own types (None) when it is already
    quantized; otherwise the option as backbone_type_option gives it."""
    backbone_type = backbone_type_option(backbone_type)
    if backbone_type == "auto":
        return None if is_quantized(reader) else "q8_0"
    return backbone_type


def collects_imatrix(imatrix, river_path) -> bool:
    """Whether the pass over the input collects an importance matrix: asked for ("auto"), and
    the river is made here (a given river file is used as it is)."""
    return imatrix == IMATRIX_AUTO and river_path is None


def needs_profile(find_threshold: bool, presets: bool) -> bool:
    """Whether the pass over the input profiles the exit rule's scores: tau is taken from them
    (find_threshold), and the presets' cost model predicts from them where a dynamic setting's
    tokens exit."""
    return bool(find_threshold) or bool(presets)
