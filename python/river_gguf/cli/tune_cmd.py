"""`river-gguf tune FILE` (river_gguf.calibrate.tune): the presets again from speeds timed here."""
import sys

from .. import presets as presets_mod
from ..calibrate.cost_model import TIERS
from .._loader import native
from ..calibrate.tune import tune


def register(subparsers, common=None) -> None:
    """``river-gguf tune``."""
    p = subparsers.add_parser("tune", help="choose a River GGUF's presets again from speeds timed here",
                              description="Choose a River GGUF's presets again from decode speeds timed on this "
                                          "machine (the grid's settings in river_gguf, llama.cpp's Q4_0, Q4_K_M "
                                          "and Q8_0 of its backbone in stock llama.cpp), instead of the stored "
                                          "cost model.")
    p.add_argument("model", metavar="MODEL.river.gguf")
    p.add_argument("-t", "--threads", type=int, default=2, help="threads, as you will run it (default 2)")
    p.add_argument("--tokens", type=int, default=64, help="decode steps per timed run (default 64)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds; the median is kept (default 5)")
    p.add_argument("--all", action="store_true", dest="measure_all",
                   help="first measure every setting of the grid on the calibration split (the conversion "
                        "measures only those its cost model leaves in play), against the file's backbone")
    p.add_argument("--reference", metavar="F16.gguf",
                   help="measure every setting against this file's logits instead (the F16 the file was "
                        "converted from, as the conversion does); implies --all")
    p.add_argument("--dry-run", action="store_true", help="print the choice, do not write the file")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_run)


def _run(args) -> int:
    try:
        res = tune(args.model, n_threads=args.threads, tokens=args.tokens, rounds=args.rounds,
                   write=not args.dry_run, progress=not args.quiet, measure=args.measure_all, reference=args.reference)
    except (ValueError, OSError, RuntimeError, native.GGUFFormatError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    st = res["seconds_per_step"]
    for _, kind in TIERS:
        print(f"llama.cpp {kind.upper()}: {1 / st[kind]:.1f} tok/s")
    for r in res["rows"]:
        o = r["options"].named()
        what = o.get("mode") + (f" tau={o['threshold']}" if "threshold" in o else "") + f" tail={o.get('tail', 0)}" \
            + (" backbone attention" if o.get("river_attention") == "backbone" else "")
        ref = f"KLD {r['kld']:.4f} against the {r['reference']}" if "reference" in r else f"KLD {r['kld']:.4f}"
        print(f"setting {what}: {ref}, {r['relative_cost']:.2f}x river-only's time per step")
    print(res["lossless"]["line"])
    for line in presets_mod.describe(res["presets"], presets_mod.DEFAULT_PRESET):
        print(f"preset {line}")
    print("(not written: --dry-run)" if args.dry_run else f"wrote the presets into {args.model}")
    return 0
