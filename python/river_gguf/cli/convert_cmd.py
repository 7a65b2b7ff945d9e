"""`river-gguf convert` (also `tools/add_river_gguf.py`) and `river-gguf upgrade`: the command
line of river_gguf.convert.build (whose module-level imports are light)."""
import argparse
import contextlib
import os
import signal
import sys
import threading
from typing import Any, Dict, Optional, Sequence

from .. import presets as presets_mod
from .._loader import native
from ..calibrate.tau import calibrate_file, calibration_metadata, parse_budget
from ..convert.build import (BACKBONE_TYPES, DEFAULT_BACKBONE_TYPE, DEFAULT_RIVER_TYPE, DEFAULT_TAIL, IMATRIX_AUTO,
                             DEFAULT_CALIBRATION_TOKENS, PREFILL_CHOICES, build_river_gguf, upgrade_river_gguf)
from ..convert.dry_run import plan_conversion
from ..default_model import default_river_path, derived_model
from ..gguf.io import FTYPES, check_output_path
from ..options import EXIT_RULES


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``tools/add_river_gguf.py`` and ``river-gguf convert``."""

    p.add_argument("backbone", metavar="BACKBONE.gguf", nargs="?", default=None,
                   help="backbone GGUF (F16/BF16/Q8_0 recommended; default: an F16 of the default "
                        "SmolLM2-135M-Instruct, written once into the cache)")
    p.add_argument("-o", "--output", default=None, metavar="MODEL.river.gguf",
                   help="River GGUF to write (required with BACKBONE; without it, the default River GGUF "
                        "in the cache, which `river-gguf generate` then uses by default)")
    p.add_argument("--river-type", default=DEFAULT_RIVER_TYPE, type=str.lower, choices=sorted(FTYPES),
                   metavar="TYPE",
                   help="quantization of the river made from the backbone, with llama.cpp's per-tensor recipe "
                        "(default q4_k_m: with a Q8_0 backbone its presets beat llama.cpp's imatrix Q4_K_M by KL "
                        "divergence at its speed; q4_0 is the fastest river; avoid q4_1 for SmolLM2, whose F16 "
                        f"is a dequantized Q4_1). One of: {', '.join(sorted(FTYPES))}")
    p.add_argument("--river", default=None, metavar="EXISTING.gguf",
                   help="use this GGUF of the same model as the river instead of quantizing the backbone")
    p.add_argument("--exit-rule", choices=EXIT_RULES, default=EXIT_RULES[0],
                   help=f"the file's default exit rule (river.exit_rule); its threshold is profiled on this rule's "
                        f"scores, and the dynamic presets exit by it (default {EXIT_RULES[0]})")
    p.add_argument("--threshold", "--tau", dest="threshold", type=float, default=None, metavar="TAU",
                   help="default exit threshold (default: profiled on the backbone, on the exit rule's scores)")
    p.add_argument("--min-exit-layer", type=int, default=0, metavar="N",
                   help="backbone layers every token runs before it may exit (default 0)")
    p.add_argument("--river-head", action=argparse.BooleanOptionalAction, default=True,
                   help="exited tokens use the river's own output head (default: yes)")
    p.add_argument("--prefill", choices=PREFILL_CHOICES, default="backbone",
                   help="default prefill: full backbone, or the sequence-level river exit (default backbone)")
    p.add_argument("--tail", type=int, default=DEFAULT_TAIL, metavar="N",
                   help="default backbone tail: exited tokens rejoin the backbone for the last N layers "
                        f"(default {DEFAULT_TAIL}; the presets choose their own)")
    p.add_argument("--imatrix", default=IMATRIX_AUTO, metavar="auto|none|FILE",
                   help="importance matrix for the river's quantization: 'auto' (default) collects it from the "
                        "backbone's activations on the calibration split; FILE is llama.cpp's imatrix GGUF; "
                        "'none' rounds plainly as llama.cpp does without one")
    p.add_argument("--imatrix-out", metavar="FILE",
                   help="also write the importance matrix the conversion collects (llama.cpp's imatrix GGUF: "
                        "llama-quantize --imatrix FILE of the input makes the river's bytes)")
    p.add_argument("--backbone-type", default=DEFAULT_BACKBONE_TYPE, type=str.lower, choices=BACKBONE_TYPES,
                   help="store the backbone as given (f16) or quantized to Q8_0 (the river is still made from the "
                        "precise input); auto (default): Q8_0 when the input's weights are floats, which is "
                        "half F16's bytes at a KL divergence of ~0.003 from it")
    p.add_argument("--river-head-type", default=None, type=str.lower, metavar="TYPE",
                   help="type of the river's head (its token_embd/output), e.g. q4_0 (default: llama.cpp's "
                        "choice for --river-type)")
    p.add_argument("--calibration-tokens", type=int, default=None, metavar="N",
                   help="tokens each static preset setting is scored on, at prefill speed (the dynamic ones: "
                        f"a quarter as many, by decode; the imatrix reads about 10x N); default {DEFAULT_CALIBRATION_TOKENS}")
    p.add_argument("--presets", action=argparse.BooleanOptionalAction, default=True,
                   help="measure and store the fast/balanced/quality presets (default: yes, a few minutes)")
    p.add_argument("--replace-river", action="store_true",
                   help="BACKBONE may be a River GGUF: its river is replaced")
    p.add_argument("--calibrate", action="store_true",
                   help="after writing, pick tau on the calibration split (never the eval texts): the fastest "
                        "whose perplexity is within --budget of the backbone's, and store it in the file")
    p.add_argument("--budget", type=_parse_budget, default=0.02, metavar="B",
                   help="perplexity budget for --calibrate: 2%% or 0.02 (default 2%%)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan (stages, the preset settings in play), the predicted time and peak memory, "
                        "from the header, llama.cpp's dry run of its quantizer and a short probe; write nothing")
    p.add_argument("-t", "--threads", type=int, default=2, help="threads for quantizing/profiling (default 2)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar and no step lines")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="also print llama.cpp's own log (its quantizer's line per tensor) as it comes")


def _parse_budget(text: str) -> float:
    return parse_budget(text)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def run(args: argparse.Namespace) -> int:
    """Handler for parsed ``add_arguments`` options; errors go to stderr with exit status 2.

    Ctrl-C (or SIGTERM) stops the conversion with exit status 130 (143) and leaves nothing
    behind: no output, no temp files."""
    with _sigterm_as_exit():
        try:
            return _run(args)
        except KeyboardInterrupt:
            out = f"; {args.output} was not written" if getattr(args, "output", None) else ""
            print(f"convert: interrupted{out}", file=sys.stderr)
            return 130


@contextlib.contextmanager
def _sigterm_as_exit():
    """While the command runs, SIGTERM raises SystemExit(143) instead of killing the process at once,
    so the temp files are removed as on Ctrl-C (a desktop app's "cancel" sends SIGTERM)."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield  # someone else handles SIGTERM (or cannot here): leave it alone
        return

    def on_term(signum, _frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _run(args: argparse.Namespace) -> int:
    if args.backbone is None:
        try:
            if args.output is not None:
                check_output_path(args.output)  # before the default F16 is made (once, into the cache)
            args.backbone = derived_model("f16")
        except (ValueError, OSError, RuntimeError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if args.output is None:
            args.output = default_river_path(args.river_type, args.backbone_type)
    elif args.output is None:
        print("error: -o/--output is required when BACKBONE is given", file=sys.stderr)
        return 2
    if args.dry_run:
        try:
            check_output_path(args.output, inputs=[args.backbone, args.river])
            plan = plan_conversion(
                args.backbone, args.output, river_type=args.river_type, river_path=args.river,
                imatrix=None if str(args.imatrix).lower() == "none" else args.imatrix,
                backbone_type=args.backbone_type, presets=args.presets, threshold=args.threshold,
                river_head_type=args.river_head_type, calibration_tokens=args.calibration_tokens,
                n_threads=args.threads)
        except (ValueError, OSError, RuntimeError, native.GGUFFormatError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print("\n".join(plan.lines()))
        return 0
    calibration: Dict[str, Any] = {}
    stage = {"calibrating": False}

    def finalize(staged: str) -> dict:
        # --calibrate runs on the staged file too: the output appears calibrated, or not at all.

        stage["calibrating"] = True
        calibration.update(calibrate_file(staged, args.budget, args.threads, progress=not args.quiet))
        stage["calibrating"] = False
        return calibration_metadata(calibration)

    try:
        meta = build_river_gguf(
            args.backbone, args.output, river_type=args.river_type, river_path=args.river,
            threshold=args.threshold, exit_rule=args.exit_rule, min_exit_layer=args.min_exit_layer,
            river_head=args.river_head, prefill=args.prefill, replace_river=args.replace_river, progress=not args.quiet,
            n_threads=args.threads, tail=args.tail,
            imatrix=None if str(args.imatrix).lower() == "none" else args.imatrix,
            backbone_type=args.backbone_type, presets=args.presets, river_head_type=args.river_head_type,
            finalize=finalize if args.calibrate else None, calibration_tokens=args.calibration_tokens,
            report=None if args.quiet else (lambda line: print(f"convert: {line}", file=sys.stderr, flush=True)),
            verbose=args.verbose, imatrix_out=args.imatrix_out,
        )
    except (ValueError, OSError, RuntimeError, native.GGUFFormatError) as e:
        print(f"error: {'calibration failed: ' if stage['calibrating'] else ''}{e}", file=sys.stderr)
        return 2
    out_size = os.path.getsize(args.output)
    src = meta["river.threshold_source"]
    extra = ""
    if src.startswith("profile") and "river.profile_predicted_mean_exit_layer" in meta:
        extra = f", predicted mean exit after layer {meta['river.profile_predicted_mean_exit_layer']:.1f}"
    print(f"wrote {args.output}")
    print(f"  river:     {meta['river.type']}" + (f" ({args.river})" if args.river else ""))
    print(f"  threshold: {meta['river.threshold']:.4f} ({meta['river.exit_rule']}, {src}{extra})")
    print(f"  defaults:  min_exit_layer={meta['river.min_exit_layer']} river_head={meta['river.head']} "
          f"prefill={meta['river.prefill']}")
    print(f"  size:      {_mib(out_size)}")
    if "river.imatrix" in meta:
        print(f"  imatrix:   {meta['river.imatrix']} ({meta['river.imatrix_tokens']} tokens)")
    if "river.presets" in meta:
        for line in presets_mod.describe(presets_mod.parse(meta), meta.get("river.default_preset")):
            print(f"  preset     {line}")
    if calibration:
        res = calibration
        verdict = "within" if res["feasible"] else "no tau within"
        print(f"  calibrated: tau={res['threshold']:g} ({verdict} {100 * res['budget']:g}% of the backbone's "
              f"calibration ppl {res['backbone_ppl']:.4f}: {res['calibration_ppl']:.4f}, "
              f"mean exit layer {res['mean_exit_layer']:.1f})")
    return 0


def register(subparsers, common=None) -> None:
    """``river-gguf convert``."""
    p = subparsers.add_parser("convert", help="add a river to a GGUF (write a River GGUF)",
                              description="Write a River GGUF: BACKBONE plus a low-precision river of the same layers.")
    add_arguments(p)
    p.set_defaults(func=run)


def register_upgrade(subparsers, common=None) -> None:
    """``river-gguf upgrade OLD NEW``: rewrite a format-1 River GGUF as format 2."""
    p = subparsers.add_parser("upgrade", help="rewrite an old (format 1) River GGUF so llama.cpp opens it too",
                              description="Rewrite a format-1 River GGUF (river tensors in the GGUF index, which "
                                          "llama.cpp refuses) as format 2.")
    p.add_argument("old", metavar="OLD.river.gguf")
    p.add_argument("new", metavar="NEW.river.gguf")
    p.add_argument("-q", "--quiet", action="store_true")

    def run_upgrade(args) -> int:
        try:
            r = upgrade_river_gguf(args.old, args.new, progress=not args.quiet)
        except KeyboardInterrupt:
            print(f"upgrade: interrupted; {args.new} was not written", file=sys.stderr)
            return 130
        except (OSError, ValueError, native.GGUFFormatError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"wrote {args.new}: River GGUF format {r['from']} -> {r['to']}")
        return 0

    p.set_defaults(func=run_upgrade)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="add_river_gguf.py",
        description="Write a River GGUF: BACKBONE plus a low-precision river of the same layers.",
    )
    add_arguments(p)
    return run(p.parse_args(argv))
