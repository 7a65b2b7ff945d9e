"""`river-gguf eval` and `river-gguf calibrate`.

Heavy imports stay inside the handlers: this module is imported whenever the parser is built.
"""
import argparse
import json
import sys

from ..calibrate import tau as tau_calibration
from ..calibrate.tau import parse_budget
from ..eval import model_zoo  # light: no numpy, no native module
from ..eval import render
from ..eval import report as evaluate
from ..gguf.meta import set_river_metadata
from ..results import json_safe
from .common import UsageError, load_model


def _floats(s: str):
    try:
        return tuple(float(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {s!r}")


# ----- eval ----------------------------------------------------------------------------
def _cmd_eval(args) -> int:
    s = evaluate.quick_settings(args.model) if args.quick else evaluate.full_settings(args.model)
    domains = [d for d in args.domains.split(",") if d.strip()] + list(args.text or [])
    if not domains:
        raise ValueError("no domains: pass --domains and/or --text")
    s.domains = domains
    if args.threads is not None:
        s.n_threads = args.threads
    if args.items is not None:
        s.score_items = args.items
    if args.tokens is not None:
        s.score_tokens = args.tokens
    if args.no_ladder:
        s.ladder, s.controls = (), ()
    s.progress = not args.no_progress
    rep = evaluate.run_eval(s)
    print(render.markdown(rep))
    if args.out:
        paths = render.write_outputs(rep, args.out)
        print("wrote " + ", ".join(paths.values()), file=sys.stderr)
    speed = rep["analysis"].get("speed")
    if speed:
        print(f"river-gguf eval: speed rounds (informational): river {speed['river_tok_s']:.1f} tok/s, "
              f"backbone {speed['backbone_tok_s']:.1f} tok/s", file=sys.stderr)
    fails = evaluate.sanity_failures(rep)
    for f in fails:
        print(f"river-gguf eval: sanity check failed: {f}", file=sys.stderr)
    print(f"[eval took {rep['seconds']:.0f} s]", file=sys.stderr)
    return 1 if fails else 0


def register_eval(subparsers, common=None) -> None:
    p = subparsers.add_parser(
        "eval", help="KLD from F16 / same top token / ppl / speed of River vs. the static quant ladder",
        description="Evaluate River early exit (the default River GGUF's presets, its static river-only + tail "
                    "settings and a dynamic-exit sweep with a backbone tail) against the model's static quant "
                    "ladder (imatrix quants included) and the "
                    "static river (+ backbone tail) controls, timed in stock llama.cpp; writes report.md, "
                    "report.json and pareto.png with --out. --quick runs only the plain F16+Q4_0 river.")
    p.add_argument("--quick", action="store_true",
                   help="a small subset (< 2 min) that checks the backbone is closer to F16 than the river; exit 1 if not "
                        "(its speed rounds are printed, not checked)")
    p.add_argument("--model", default="smollm2", choices=model_zoo.names(),
                   help="model_zoo name (default smollm2)")
    p.add_argument("--out", default=None, metavar="DIR", help="write report.md, report.json, pareto.png here")
    p.add_argument("--domains", default="gsm8k,humaneval", help="comma-separated built-in domains")
    p.add_argument("--text", action="append", default=None, metavar="FILE",
                   help="extra domain from a .txt or .jsonl file (repeatable)")
    p.add_argument("--items", type=int, default=None, metavar="N", help="evaluation items per domain to score")
    p.add_argument("--tokens", type=int, default=None, metavar="N", help="completion tokens scored per item")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default 2)")
    p.add_argument("--no-ladder", action="store_true", help="skip the static quant ladder and the imatrix controls")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=_cmd_eval)


# ----- calibrate -----------------------------------------------------------------------
def _cmd_calibrate(args) -> int:


    if args.model is None:
        raise UsageError("calibrate needs a River GGUF (or a backbone with --river)")
    if args.write and args.river:
        raise UsageError("--write needs a River GGUF: with --river there is no single file to write tau into")
    m = load_model(args)
    if not m.has_river:
        raise UsageError(f"{args.model} has no river: convert it with tools/add_river_gguf.py or pass --river")
    items = tau_calibration.calibration_items([d for d in args.domains.split(",") if d.strip()], args.items)
    res = tau_calibration.calibrate(m, budget=args.budget, taus=args.taus,
                                    items=items, score_tokens=args.tokens, progress=not args.no_progress,
                                    **({"river_head": args.river_head} if args.river_head is not None else {}))
    for r in res["rows"]:
        mark = "*" if res["feasible"] and r["tau"] == res["threshold"] else " "
        print(f"{mark} tau={r['tau']:<7g} ppl={r['ppl']:.4f} ({100 * (r['ppl'] / res['backbone_ppl'] - 1):+.2f}%) "
              f"mean_exit={r['mean_exit_layer']:.1f}")
    if res["feasible"]:
        print(f"chosen tau={res['threshold']:g}: ppl {res['calibration_ppl']:.4f} vs backbone "
              f"{res['backbone_ppl']:.4f} (budget {100 * res['budget']:g}%), mean exit layer "
              f"{res['mean_exit_layer']:.1f}/{m.n_layer - 1}")
    else:
        print(f"no tau within {100 * res['budget']:g}% of the backbone's ppl {res['backbone_ppl']:.4f}; "
              f"tau={res['threshold']:g} (never exit)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(json_safe(res), f, indent=1)
    if args.write:
        path = m.model_path
        del m
        written = set_river_metadata(path, tau_calibration.calibration_metadata(res))
        print(f"wrote river.threshold={written['river.threshold']:g} into {path}")
    return 0


def register_calibrate(subparsers, common) -> None:
    p = subparsers.add_parser(
        "calibrate", parents=[common.model],
        help="pick the fastest tau within a perplexity budget of the backbone (optionally write it)",
        description="Pick tau: the fastest one (lowest mean exit layer) whose perplexity on the calibration "
                    "split (GSM8K and HumanEval items with index %% 5 == 0, never used by eval) is within "
                    "the budget of the backbone's.")
    p.add_argument("--budget", type=parse_budget, default=0.02, metavar="B",
                   help="allowed perplexity increase over the backbone: 2%% or 0.02 (default 2%%)")
    p.add_argument("--write", action="store_true", help="store the chosen tau and numbers in the River GGUF")
    p.add_argument("--taus", type=_floats, default=None, metavar="T1,T2,...",
                   help="tau grid (default: the rule's: cosine dense over 0.96..0.995, another rule quantiles of its profile)")
    p.add_argument("--domains", default="gsm8k,humaneval", help="calibration domains (their calibration split)")
    p.add_argument("--items", type=int, default=8, metavar="N", help="calibration items per domain (default 8)")
    p.add_argument("--tokens", type=int, default=96, metavar="N", help="completion tokens scored per item")
    p.add_argument("--river-head", action=argparse.BooleanOptionalAction, default=None,
                   help="calibrate with the river's own head for exited tokens")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the full result as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_calibrate)

