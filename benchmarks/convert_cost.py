"""What a default conversion costs, stage by stage, against llama.cpp's own path for the same user
(llama-imatrix, then llama-quantize to Q4_K_M, or --river-type's type, with that importance matrix) on the same F16 and the
same calibration text, in one run; and the peak memory of each.

    ./scripts/build_llama_tools.sh             # once: llama-imatrix and llama-quantize
    .venv/bin/python benchmarks/convert_cost.py [--models smollm2,qwen2.5-coder-0.5b,qwen2.5-1.5b,llama-3.1-8b]
        [--threads 2] [--json out.json]

A model is a model_zoo name (its F16) or a name in river_gguf.eval.random_model.RANDOM_SHAPES (a
random-weight F16 of that shape, benchmarks/random_models.py: a conversion's cost does not depend on the weights). river_gguf
runs `river-gguf convert F16 -o OUT` with its defaults as a process of its own; each stage's time
is the time between the converter's step lines (read; the one pass over the F16: the importance
matrix, the presets' reference rows, tau's profile; the river's quantization with the matrix; the
backbone's Q8_0; the draft vocabulary; the presets; writing). llama.cpp's side runs llama-imatrix on the converter's calibration texts
joined into one file (chunks of 512, the output head's statistics too) and llama-quantize. Every
process runs under /usr/bin/time for its peak resident memory (RSS), which the conversion must
keep at or under the F16's size plus 2 GiB. Run it alone on the machine.

    .venv/bin/python benchmarks/convert_cost.py --margin MODEL.river.gguf [--profile-of F16.gguf] [--json OUT.json]

Each model's run also writes a row (the dry run's plan of it on this machine, with the work each
of its constants multiplies, and the converter's stage times) to reports/convert_cost/; `--fit`
refits convert/dry_run.py's constants from those rows and prints them beside the stored ones.
`--search-check MODEL.river.gguf [--profile-of F16.gguf]` compares the presets the converter's
pruned search chooses with the full sweep's on that file (the grid measured whole, the search
replayed on its rows). `--margin MODEL.river.gguf`
measures instead what cost_model.PREDICTION_MARGIN rests on: each dynamic setting's decode cost as
the converter's plan predicts it from the backbone's profile, against its cost measured (its mean
exit layer through decode on the calibration split); the margin has to cover the largest ratio.
`--prompt-check MODEL.river.gguf --profile-of F16.gguf [--prompt-tokens 64,16]` measures the presets
chosen (full sweep and pruned search, against the F16) with the calibration items' prompts cut to
each length.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

try:  # an installed river_gguf (the checkout's python/ has no native module)
    import river_gguf  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/random_models.py
from river_gguf.convert.build import DEFAULT_CALIBRATION_TOKENS  # noqa: E402
from river_gguf.convert.imatrix import calibration_texts  # noqa: E402
from river_gguf.default_model import cache_dir  # noqa: E402
from river_gguf.eval import model_zoo  # noqa: E402
from river_gguf.eval.random_model import RANDOM_SHAPES  # noqa: E402

TOOLS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".cache", "llama-tools", "build", "bin")
GIB = 1 << 30
STAGES = ("read", "imatrix", "reference", "threshold", "river", "backbone", "draft vocabulary", "presets", "write")


def f16_of(name: str, threads: int) -> str:
    if os.path.isfile(name):  # an F16 file given by its path (a tiny one checks the script)
        return os.path.abspath(name)
    if name in RANDOM_SHAPES:
        from random_models import make

        return make(name, [], "", str(cache_dir()), threads)["f16"]
    return model_zoo.derived(name, "f16")


def timed(cmd, on_line=None):
    """Run cmd under /usr/bin/time: (seconds, peak RSS bytes, output). on_line(t, line) sees each
    line of its stderr as it comes."""
    marker = "@@peak_kb="
    t0 = time.perf_counter()
    p = subprocess.Popen(["/usr/bin/time", "-f", marker + "%M"] + cmd, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, bufsize=1)
    out, peak = [], 0
    for line in p.stdout:
        if line.startswith(marker):
            peak = int(line[len(marker):]) * 1024
            continue
        out.append(line)
        if on_line is not None:
            on_line(time.perf_counter() - t0, line.rstrip("\n"))
    rc = p.wait()
    secs = time.perf_counter() - t0
    if rc != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({rc}):\n{''.join(out)[-3000:]}")
    return secs, peak, "".join(out)


def stage_of(line: str):
    """The stage a converter step line ends ("convert: river: q4_k_m, llama.cpp's types: ...")."""
    m = re.match(r"convert: (\w[\w ]*?):", line) or re.match(r"convert: (wrote|read) ", line)
    if not m:
        return None
    word = m.group(1)
    return {"wrote": "write", "read": "read"}.get(word, word)


def river_side(f16: str, out_dir: str, threads: int, river_type: str) -> dict:
    out = os.path.join(out_dir, "model.river.gguf")
    marks = []
    cmd = [sys.executable, "-m", "river_gguf.cli", "convert", f16, "-o", out, "-t", str(threads)]
    if river_type != "q4_k_m":
        cmd += ["--river-type", river_type]
    secs, peak, log = timed(cmd, lambda t, line: marks.append((t, stage_of(line))) if stage_of(line) else None)
    stages, last = {}, 0.0
    for t, name in marks:
        stages[name] = stages.get(name, 0.0) + t - last
        last = t
    stages["finish"] = secs - last  # process exit, after the last step line
    os.remove(out)
    return {"seconds": secs, "peak_rss": peak, "stages": stages, "command": " ".join(cmd[1:])}


def llama_side(f16: str, out_dir: str, threads: int, river_type: str) -> dict:
    text = os.path.join(out_dir, "calibration.txt")
    with open(text, "w") as f:
        f.write("\n\n".join(calibration_texts()))
    imatrix = os.path.join(out_dir, "llama.imatrix.gguf")
    out = os.path.join(out_dir, f"llama.{river_type}.gguf")
    c1 = [os.path.join(TOOLS, "llama-imatrix"), "-m", f16, "-f", text, "-o", imatrix, "-t", str(threads),
          "-c", "512", "--process-output", "-ngl", "0"]
    c2 = [os.path.join(TOOLS, "llama-quantize"), "--imatrix", imatrix, f16, out, river_type.upper(), str(threads)]
    s1, p1, _ = timed(c1)
    s2, p2, _ = timed(c2)
    for p in (imatrix, out):
        os.remove(p)
    return {"seconds": s1 + s2, "stages": {"llama-imatrix": s1, "llama-quantize": s2}, "peak_rss": max(p1, p2),
            "commands": [" ".join(c1), " ".join(c2)]}


ROWS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "reports", "convert_cost")
#: The converter's step lines (STAGES) that make up each stage of the dry run's plan.
PLAN_STAGES = {"one pass over the input": ("read", "imatrix", "reference", "threshold"), "river": ("river",),
               "backbone": ("backbone",), "presets": ("presets",), "write": ("draft vocabulary", "write", "finish")}
#: The dry run's constants --fit refits: linear ones solved together by least squares over every
#: row's stages but the presets'; presets_factor per row (the dry run interpolates it in the F16's size).
LINEAR = ("PASS_FACTOR", "QUANT_FACTOR", "IO_SECONDS_PER_GIB", "FIXED_SECONDS")


def plan_side(f16: str, out_dir: str, threads: int, river_type: str) -> dict:
    """The dry run's plan of the same conversion on this machine (its probe included): per stage
    its predicted seconds, the work each constant multiplies (Stage.units) and what it measured
    outright, for --fit."""
    from river_gguf.convert.dry_run import plan_conversion

    plan = plan_conversion(f16, os.path.join(out_dir, "model.river.gguf"), river_type=river_type, n_threads=threads)
    return {s.name: {"predicted": s.seconds, "units": s.units, "measured_seconds": s.measured_seconds,
                     "peak_bytes": s.peak_bytes} for s in plan.stages}


def plan_totals(plan: dict) -> tuple:
    """(the plan's predicted seconds, its predicted peak bytes; None where the row predates it)."""
    peaks = [s.get("peak_bytes") for s in plan.values()]
    return sum(s["predicted"] for s in plan.values()), (None if None in peaks else max(peaks))


def nonnegative_least_squares(a, b) -> list:
    """Least squares with every constant >= 0 (a negative seconds-per-unit is no machine's): the
    most negative one is set to 0 and the rest solved again, until none is negative."""
    import numpy as np

    free = list(range(a.shape[1]))
    x = np.zeros(a.shape[1])
    while free:
        solved, *_ = np.linalg.lstsq(a[:, free], b, rcond=None)
        if solved.min() >= 0:
            x[free] = solved
            break
        free.pop(int(np.argmin(solved)))
    return [float(v) for v in x]


def fit(rows_dir: str) -> dict:
    """The dry run's constants refitted from the rows in rows_dir (each one a model's run: its
    plan's units and the converter's stage times)."""
    import numpy as np

    from river_gguf.convert import dry_run

    rows = []
    for name in sorted(os.listdir(rows_dir)):
        if name.endswith(".json"):
            with open(os.path.join(rows_dir, name)) as f:
                rows.append(json.load(f))
    if not rows:
        raise SystemExit(f"no rows in {rows_dir}: run the benchmark first (it writes one per model)")
    a, b, what = [], [], []
    for r in rows:
        for stage, plan in r["plan"].items():
            if stage == "presets":
                continue
            measured = sum(r["river"]["stages"].get(k, 0.0) for k in PLAN_STAGES[stage]) - plan["measured_seconds"]
            a.append([plan["units"].get(k, 0.0) for k in LINEAR])
            b.append(measured)
            what.append((r["model"], stage))
    fitted = dict(zip(LINEAR, nonnegative_least_squares(np.array(a), np.array(b))))
    presets = []
    for r in rows:
        plan = r["plan"].get("presets")
        if plan:
            measured = r["river"]["stages"].get("presets", 0.0) - fitted["FIXED_SECONDS"]
            presets.append({"model": r["model"], "river_type": r["river_type"], "f16_bytes": r["f16_bytes"],
                            "presets_factor": measured / plan["units"]["presets_factor"],
                            "stored": dry_run.presets_factor(r["f16_bytes"])})
    checks = []
    for r in rows:
        seconds, peak = plan_totals(r["plan"])
        checks.append({"model": r["model"], "river_type": r["river_type"], "predicted_s": seconds,
                       "measured_s": r["river"]["seconds"], "predicted_peak": peak, "measured_peak": r["river"]["peak_rss"]})
    return {"rows": len(rows), "equations": len(b), "fitted": fitted, "checks": checks,
            "stored": {k: getattr(dry_run, k) for k in LINEAR}, "presets_factor": presets,
            "underdetermined": len(rows) < 3 or len(b) < len(LINEAR),
            "not_fitted": "DECODE_FACTOR (inside presets_factor: the rows do not separate decode from batched work)"}


def print_fit(res: dict) -> None:
    print(f"the dry run's constants from {res['rows']} rows ({res['equations']} stage times)"
          + (": too few to determine the constants (at least three models' rows)" if res["underdetermined"] else ""))
    for k, v in res["fitted"].items():
        print(f"  {k}: fitted {v:.3f}, stored {res['stored'][k]}")
    for p in res["presets_factor"]:
        print(f"  presets_factor at {p['f16_bytes'] / GIB:.2f} GiB ({p['model']}, {p['river_type']}): fitted "
              f"{p['presets_factor']:.2f}, stored {p['stored']:.2f}")
    print(f"  not fitted: {res['not_fitted']}")
    print("each row's plan (made with the constants of its run) against its run:")
    for c in res["checks"]:
        peak = ("no predicted peak in this row" if c["predicted_peak"] is None else
                f"peak {c['predicted_peak'] / GIB:.2f} vs {c['measured_peak'] / GIB:.2f} GiB "
                f"({c['predicted_peak'] / c['measured_peak'] - 1:+.0%})")
        print(f"  {c['model']} ({c['river_type']}): {c['predicted_s']:.0f} vs {c['measured_s']:.0f} s "
              f"({c['predicted_s'] / c['measured_s'] - 1:+.0%}), {peak}")


def prediction_margin(path: str, threads: int, min_tokens: int, profile_path=None) -> dict:
    """The dynamic settings of a River GGUF's grid, each one's decode cost as cost_model.plan
    predicts it (its mean exit layer from the backbone's similarity profile: the profile of
    profile_path, the F16 the converter profiles, or of the file's own backbone) and as measured
    (its mean exit layer through decode on the calibration split). plan measures a setting when
    predicted / PREDICTION_MARGIN is within a tier's bound, so the margin has to cover the
    largest predicted / measured ratio."""
    from river_gguf.calibrate import open_model
    from river_gguf.calibrate.cost_model import PREDICTION_MARGIN, grid, setting_cost, step_bytes, weight_bytes
    from river_gguf.calibrate.preset_grid import calibrate_presets
    from river_gguf.options import never_exit
    from river_gguf.measure.profile import predicted_mean_exit, similarity_profile

    m = open_model(path, n_ctx=1024, n_threads=threads, threshold=never_exit("cosine"))
    if profile_path is None:
        profile = similarity_profile(m, own_engine=False)
    else:
        f16 = open_model(profile_path, n_ctx=1024, n_threads=threads, mode="backbone", repack=False)
        profile = similarity_profile(f16, own_engine=False)
        del f16
    settings = [s for s in grid(m.n_layer) if s.is_dynamic]
    res = calibrate_presets(m, settings=settings, profile=profile, min_tokens=min_tokens)
    layers, head = weight_bytes(m, "cost")
    river_only = step_bytes(layers, head, m.n_layer, -1, 0, True)
    rows = []
    for r in res["rows"]:
        s = r["options"]
        guess = predicted_mean_exit(profile, s.options.threshold, s.options.min_exit_layer, s.options.tail)
        predicted = setting_cost(s, layers, head, m.n_layer, guess) / river_only
        rows.append({"options": s.named(), "predicted_mean_exit": guess, "mean_exit": r["mean_exit_layer"],
                     "predicted_cost": predicted, "cost": r["relative_cost"], "ratio": predicted / r["relative_cost"],
                     "items": len(r["items"])})
    return {"file": os.path.basename(path), "profile": os.path.basename(profile_path or path), "rows": rows,
            "largest_ratio": max(x["ratio"] for x in rows), "PREDICTION_MARGIN": PREDICTION_MARGIN}


def search_check(path: str, threads: int, min_tokens: int, profile_path=None) -> dict:
    """The presets the converter's pruned search chooses against the full, unpruned sweep's, on
    one River GGUF: the grid measured whole against its backbone (preset_grid.calibrate_presets),
    then the plan and the search replayed on those rows (what they ask for is a function of the
    rows), as tests/calibrate/test_presets.py does on SmolLM2 at a small size."""
    from river_gguf.calibrate import open_model, preset_grid
    from river_gguf.calibrate.cost_model import choose
    from river_gguf.options import never_exit
    from river_gguf.measure.profile import similarity_profile

    m = open_model(path, n_ctx=1024, n_threads=threads, threshold=never_exit("cosine"))
    src = m if profile_path is None else open_model(profile_path, n_ctx=1024, n_threads=threads, mode="backbone",
                                                    repack=False)
    profile = similarity_profile(src, own_engine=False)
    del src
    full = preset_grid.calibrate_presets(m, profile=profile, min_tokens=min_tokens)
    asked = set()
    measure = preset_grid.replayed_measure(full["rows"], asked)
    skip, search = preset_grid.plan_and_search(m, [r["options"] for r in full["rows"]], measure, profile)
    rows = measure([])
    screened = sorted(i for i in asked if rows[i].get("screened"))
    asked = {i for i in asked if i not in screened}
    searched = choose([full["rows"][i] for i in sorted(asked)], full["anchors"]["bounds"])
    pick = lambda chosen: {n: p.setting.named() for n, p in chosen.items()}  # noqa: E731
    return {"file": os.path.basename(path), "full": pick(full["presets"]), "searched": pick(searched),
            "same": pick(full["presets"]) == pick(searched), "measured": len(asked), "screened": len(screened), "grid": len(full["rows"]),
            "rounds": search["rounds"], "fallback": search["fallback"], "not_measured": [
                {"options": full["rows"][i]["options"].named(), "why": w} for i, w in enumerate(skip) if w]}


def prompt_check(path: str, f16_path: str, threads: int, min_tokens: int, lengths) -> dict:
    """The presets chosen on one River GGUF with the calibration items' prompts cut to each length
    of `lengths` (measure.scoring.PRESET_PROMPT_TOKENS is the converter's): per length, the F16's
    reference rows, then the full sweep and the converter's pruned search against them, with
    each row's KLD and interval."""
    return choice_check(path, f16_path, threads, [(f"prompt {n}", min_tokens, n) for n in lengths])


def budget_check(path: str, f16_path: str, threads: int, budgets) -> dict:
    """prompt_check's study over the presets' evidence budget (the scored tokens a setting is
    measured on, the converter's --calibration-tokens) at the converter's prompt length."""
    from river_gguf.measure.scoring import PRESET_PROMPT_TOKENS

    return choice_check(path, f16_path, threads, [(f"budget {n}", n, PRESET_PROMPT_TOKENS) for n in budgets])


def choice_check(path: str, f16_path: str, threads: int, variants) -> dict:
    """The presets chosen on one River GGUF for each (label, scored-token budget, prompt length) of
    `variants`: per variant, the F16's reference rows, then the full sweep and the converter's
    pruned search against them, with each row's KLD and interval."""
    from river_gguf.calibrate import open_model, preset_grid
    from river_gguf.measure import divergence
    from river_gguf.measure.profile import similarity_profile
    from river_gguf.measure.scoring import calibration_prepared
    from river_gguf.options import never_exit

    f16 = open_model(f16_path, n_ctx=1024, n_threads=threads, mode="backbone", repack=False)
    profile = similarity_profile(f16, own_engine=False)
    m = open_model(path, n_ctx=1024, n_threads=threads, threshold=never_exit("cosine"))
    out = {"file": os.path.basename(path), "reference": os.path.basename(f16_path), "variants": {}}
    for label, min_tokens, prompt_tokens in variants:
        prepared = calibration_prepared(f16, min_tokens, prompt_tokens=prompt_tokens)
        with divergence.ReferenceRows("F16", tempfile.gettempdir()) as ref:
            ref.add_logits_of(f16, prepared)
            row = {"items": len(prepared), "tokens": sum(len(t) for t, _ in prepared),
                   "scored": sum(len(t) - p for t, p in prepared)}
            for name, prune in (("searched", True), ("full", False)):
                t0 = time.perf_counter()
                res = preset_grid.calibrate_presets(m, prepared=prepared, reference=ref, profile=profile,
                                                    progress=False, prune=prune, min_tokens=min_tokens)
                row[name] = {"seconds": time.perf_counter() - t0,
                             "presets": {k: p.setting.named() for k, p in res["presets"].items()},
                             "rows": [{"options": r["options"].named(), "kld": r.get("kld"), "kld_ci": r.get("kld_ci")}
                                      for r in res["rows"]]}
        out["variants"][label] = row
        print(f"{label}: {row['items']} items, {row['tokens']} tokens a setting, {row['scored']} scored; "
              f"search {row['searched']['seconds']:.0f} s, full sweep {row['full']['seconds']:.0f} s; "
              f"presets {row['full']['presets']}", flush=True)
    picks = [(r["full"]["presets"], r["searched"]["presets"]) for r in out["variants"].values()]
    out["same"] = all(f == picks[0][0] and s == picks[0][0] for f, s in picks)
    return out


def print_margin(res: dict) -> None:
    print(f"{res['file']}, profile of {res['profile']}: predicted / measured decode cost of each dynamic setting")
    print("| setting | predicted mean exit | measured | predicted cost | measured cost | ratio | items |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in res["rows"]:
        o = r["options"]
        what = f"tau {o['threshold']} tail {o.get('tail', 0)}" + (" bb-att" if o.get("river_attention") == "backbone" else "")
        print(f"| {what} | {r['predicted_mean_exit']:.1f} | {r['mean_exit']:.1f} | {r['predicted_cost']:.3f} | "
              f"{r['cost']:.3f} | {r['ratio']:.3f} | {r['items']} |")
    print(f"largest ratio {res['largest_ratio']:.3f}: PREDICTION_MARGIN ({res['PREDICTION_MARGIN']}) "
          + ("covers it" if res["largest_ratio"] <= res["PREDICTION_MARGIN"] else "does NOT cover it"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2,qwen2.5-coder-0.5b,qwen2.5-1.5b,llama-3.1-8b")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--river-type", default="q4_k_m", help="the converter's --river-type, and llama-quantize's type")
    ap.add_argument("--no-llama", action="store_true", help="leave out llama.cpp's tools")
    ap.add_argument("--json", default=None)
    ap.add_argument("--margin", metavar="MODEL.river.gguf",
                    help="instead: how far cost_model.plan's predicted cost of each dynamic setting lies from its "
                         "measured cost on this file (what PREDICTION_MARGIN has to cover)")
    ap.add_argument("--profile-of", metavar="F16.gguf",
                    help="--margin, --search-check: profile this file, as the converter does")
    ap.add_argument("--tokens", type=int, default=DEFAULT_CALIBRATION_TOKENS,
                    help=f"--margin, --search-check: calibration tokens (default {DEFAULT_CALIBRATION_TOKENS}, the converter's)")
    ap.add_argument("--rows", default=ROWS, help="where each model's row is written, and --fit reads them "
                                                 "(default reports/convert_cost)")
    ap.add_argument("--fit", action="store_true", help="instead: refit the dry run's constants from the rows")
    ap.add_argument("--search-check", metavar="MODEL.river.gguf",
                    help="instead: the presets of the converter's pruned search against the full sweep's on this file")
    ap.add_argument("--prompt-check", metavar="MODEL.river.gguf",
                    help="instead: the presets chosen with the items' prompts cut to each of --prompt-tokens "
                         "(needs --profile-of, the F16: the reference)")
    ap.add_argument("--prompt-tokens", default="64,16", help="--prompt-check: the prompt lengths (default 64,16)")
    ap.add_argument("--budget-check", metavar="MODEL.river.gguf",
                    help="instead: the presets chosen at each of --budgets scored tokens (needs --profile-of, the F16)")
    ap.add_argument("--budgets", default="1024,768", help="--budget-check: the scored-token budgets (default 1024,768)")
    a = ap.parse_args(argv)
    if a.prompt_check or a.budget_check:
        if not a.profile_of:
            ap.error("--prompt-check and --budget-check need --profile-of F16.gguf (the reference)")
        if a.prompt_check:
            res = prompt_check(a.prompt_check, a.profile_of, a.threads, a.tokens,
                               [int(x) for x in a.prompt_tokens.split(",")])
        else:
            res = budget_check(a.budget_check, a.profile_of, a.threads, [int(x) for x in a.budgets.split(",")])
        print("the same presets in every variant" if res["same"] else "DIFFERENT presets")
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=1)
        return 0 if res["same"] else 1
    if a.search_check:
        res = search_check(a.search_check, a.threads, a.tokens, a.profile_of)
        print(json.dumps({k: v for k, v in res.items() if k != "not_measured"}, indent=1))
        print(("the same presets" if res["same"] else "DIFFERENT presets") + f": the search measured {res['measured']} "
              f"of {res['grid']} settings in {res['rounds']} rounds")
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=1)
        return 0 if res["same"] else 1
    if a.fit:
        res = fit(a.rows)
        print_fit(res)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=1)
        return 0
    if a.margin:
        res = prediction_margin(a.margin, a.threads, a.tokens, a.profile_of)
        print_margin(res)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=1)
        return 0
    if not a.no_llama and not os.path.exists(os.path.join(TOOLS, "llama-quantize")):
        ap.error("llama-imatrix / llama-quantize are missing: run ./scripts/build_llama_tools.sh")
    results = []
    for name in a.models.split(","):
        f16 = f16_of(name, a.threads)
        size = os.path.getsize(f16)
        with tempfile.TemporaryDirectory(prefix="convert-cost-", dir=os.path.dirname(f16)) as tmp:
            r = {"model": os.path.basename(name), "river_type": a.river_type, "f16_bytes": size,
                 "plan": plan_side(f16, tmp, a.threads, a.river_type),
                 "river": river_side(f16, tmp, a.threads, a.river_type)}
            if not a.no_llama:
                r["llama"] = llama_side(f16, tmp, a.threads, a.river_type)
                r["ratio"] = r["river"]["seconds"] / r["llama"]["seconds"]
        r["rss_within"] = r["river"]["peak_rss"] <= size + 2 * GIB
        results.append(r)
        os.makedirs(a.rows, exist_ok=True)
        with open(os.path.join(a.rows, f"{r['model']}-{a.river_type}.json"), "w") as f:
            json.dump(dict(r, threads=a.threads), f, indent=1)
        st = r["river"]["stages"]
        seconds, peak = plan_totals(r["plan"])
        print(f"{name}: the dry run predicted {seconds:.0f} s ({seconds / r['river']['seconds'] - 1:+.0%}) and a peak of "
              f"{peak / GIB:.2f} GiB ({peak / r['river']['peak_rss'] - 1:+.0%})")
        print(f"{name}: F16 {size / GIB:.2f} GiB; river_gguf {r['river']['seconds']:.0f} s "
              f"({', '.join(f'{k} {v:.0f}' for k, v in st.items())}), peak RSS {r['river']['peak_rss'] / GIB:.2f} GiB"
              + (f"; llama.cpp {r['llama']['seconds']:.0f} s (imatrix {r['llama']['stages']['llama-imatrix']:.0f}, "
                 f"quantize {r['llama']['stages']['llama-quantize']:.0f}), peak RSS {r['llama']['peak_rss'] / GIB:.2f} GiB; "
                 f"{r['ratio']:.2f}x" if "llama" in r else ""), flush=True)
    print("\n| model | F16 GiB | " + " | ".join(STAGES) + " | river_gguf s | llama.cpp s | ratio | peak RSS GiB (F16 + 2) |")
    print("|---|---:|" + "---:|" * len(STAGES) + "---:|---:|---:|---|")
    for r in results:
        st = r["river"]["stages"]
        print(f"| {r['model']} | {r['f16_bytes'] / GIB:.2f} | " + " | ".join(f"{st.get(k, 0):.0f}" for k in STAGES)
              + f" | {r['river']['seconds']:.0f} | {r.get('llama', {}).get('seconds', float('nan')):.0f} | "
              f"{r.get('ratio', float('nan')):.2f} | {r['river']['peak_rss'] / GIB:.2f} "
              f"({(r['f16_bytes'] + 2 * GIB) / GIB:.2f}) |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"threads": a.threads, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
