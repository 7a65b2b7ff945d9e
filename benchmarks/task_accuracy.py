"""Task accuracy, as the River paper judges it: HumanEval pass@1 and GSM8K exact match, greedy,
for the F16 backbone, llama.cpp's static quants and every preset of the model's default River GGUF.

    RIVER_GGUF_CACHE=.cache/test .venv/bin/python benchmarks/task_accuracy.py \\
        [--model qwen2.5-coder-0.5b] [--configs f16,q8_0,q4_0,preset:fast,...] [--limit N] [--out DIR]

Every configuration runs on river_gguf's engine (a static file in backbone mode computes what
llama.cpp computes, bit for bit: tests/native/test_engine_parity.py), greedy, batch 1. HumanEval: all 164
problems, the prompt continued and cut at the usual stop sequences, checked in eval/tasks.py's
sandbox (own process group, time and memory limits, no network). GSM8K: the 100 shipped items,
4-shot from the calibration split (never an item's own text), the last number of the answer
against the reference's. Accuracy intervals are 95% bootstrap intervals over problems; each
configuration's difference from F16 has a paired interval (the same problems resampled for both).

Writes OUT/tasks.json and OUT/tasks.md (default OUT: reports/MODEL), again after every
configuration, so a run cut short keeps what it finished. --merge keeps the configurations an
earlier OUT/tasks.json holds (same model and problems) and runs only those it lacks, so the
whole table can be made over several sittings (each configuration takes about 30 minutes for
Qwen2.5-Coder-0.5B on 2 cores).
"""
import argparse
import json
import os
import sys
import time
from typing import Optional

try:  # an installed (or dev-overlay) river_gguf; the checkout's python/ has no native module
    import river_gguf  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from river_gguf import Model  # noqa: E402
from river_gguf.greedy import greedy  # noqa: E402
from river_gguf.eval import model_zoo, tasks  # noqa: E402
from river_gguf.eval import report as evaluate  # noqa: E402

DEFAULT_CONFIGS = ("f16", "q8_0", "q4_0", "q4_0-imatrix", "preset:fast", "preset:balanced", "preset:quality")
HUMANEVAL_TOKENS = 384
GSM8K_TOKENS = 256
DRAWS, SEED = 2000, 20261201


def _interval(x: np.ndarray, idx: np.ndarray):
    s = x[idx].mean(axis=1)
    return [float(np.quantile(s, 0.025)), float(np.quantile(s, 0.975))]


def _model_for(model: str, config: str, n_ctx: int, n_threads: int):
    if config.startswith("preset:"):
        path = evaluate.default_river_gguf(model, n_threads=n_threads)
        return Model(path, n_ctx=n_ctx, n_threads=n_threads), dict(preset=config.split(":", 1)[1])
    return Model(model_zoo.derived(model, config), n_ctx=n_ctx, n_threads=n_threads), dict(mode="backbone")


def run(model: str, configs, limit, n_threads: int, done: Optional[dict] = None, save=None) -> dict:
    """Run `configs` (those not already in done["configs"]); save(out) after each one."""
    he = tasks.humaneval_problems()
    gs = all_gs = tasks.gsm8k_problems()
    if limit:
        he, gs = he[:limit], gs[:limit]
    out = {"model": model, "threads": n_threads, "configs": {}, "humaneval_n": len(he), "gsm8k_n": len(gs)}
    if done is not None:
        if (done.get("model"), done.get("humaneval_n"), done.get("gsm8k_n")) != (model, len(he), len(gs)):
            raise SystemExit(f"--merge: the earlier results are for {done.get('model')} with "
                             f"{done.get('humaneval_n')}/{done.get('gsm8k_n')} problems, not {model} with "
                             f"{len(he)}/{len(gs)}")
        out["configs"] = {k: v for k, v in done["configs"].items()}
    for config in configs:
        if config in out["configs"]:
            continue
        t0 = time.perf_counter()
        m, opts = _model_for(model, config, 2048, n_threads)
        he_pass, gs_ok, steps, exits = [], [], 0, []
        for p in tqdm(he, desc=f"{config} humaneval", unit="problem"):
            g = greedy(m, p.prompt, HUMANEVAL_TOKENS, stop=tasks.HUMANEVAL_STOPS, **opts)
            he_pass.append(tasks.check_humaneval(p, g.text).passed)
            steps += len(g.tokens)
            exits += g.decode_exit_layers
        for p in tqdm(gs, desc=f"{config} gsm8k", unit="problem"):
            prompt = tasks.gsm8k_prompt(p, tasks.gsm8k_shots(p, all_gs))
            g = greedy(m, prompt, GSM8K_TOKENS, stop=tasks.GSM8K_STOPS, **opts)
            gs_ok.append(tasks.gsm8k_correct(p, g.text))
            steps += len(g.tokens)
            exits += g.decode_exit_layers
        out["configs"][config] = {"humaneval": [bool(x) for x in he_pass], "gsm8k": [bool(x) for x in gs_ok],
                                  "options": opts, "file": os.path.basename(m.model_path),
                                  "mean_exit_layer": float(np.mean(exits)) if exits else None,
                                  "tokens": steps, "seconds": time.perf_counter() - t0}
        del m
        if save is not None:
            save(summarize(out))
    return summarize(out)


def summarize(out: dict) -> dict:
    """Accuracies, bootstrap intervals and paired differences from F16, from the per-problem
    results (recomputed whenever configurations are added)."""
    he_n, gs_n = out["humaneval_n"], out["gsm8k_n"]
    rng = np.random.default_rng(SEED)
    idx = {k: rng.integers(0, n, size=(DRAWS, n)) for k, n in (("humaneval", he_n), ("gsm8k", gs_n)) if n}
    base = out["configs"].get("f16")
    for c in out["configs"].values():
        for task in ("humaneval", "gsm8k"):
            x = np.array(c[task], dtype=float)
            if not len(x):
                continue
            c[f"{task}_acc"] = float(x.mean())
            c[f"{task}_ci"] = _interval(x, idx[task])
            if base is not None:
                d = x - np.array(base[task], dtype=float)
                c[f"{task}_vs_f16"] = float(d.mean())
                c[f"{task}_vs_f16_ci"] = _interval(d, idx[task])
    return out


def markdown(rep: dict) -> str:
    lines = [f"| configuration | HumanEval pass@1 ({rep['humaneval_n']}) [95% CI] | vs F16 [paired CI] | "
             f"GSM8K exact match ({rep['gsm8k_n']}) [95% CI] | vs F16 [paired CI] | mean exit | wall s |",
             "|---|---|---|---|---|---|---|"]

    def pct(v, ci, sign=False):
        if v is None:
            return "-"
        f = "{:+.1f}" if sign else "{:.1f}"
        return f"{f.format(100 * v)} [{f.format(100 * ci[0])}, {f.format(100 * ci[1])}]"

    for name, c in rep["configs"].items():
        lines.append(" | ".join([
            f"| {name}", pct(c.get("humaneval_acc"), c.get("humaneval_ci")),
            pct(c.get("humaneval_vs_f16"), c.get("humaneval_vs_f16_ci"), True),
            pct(c.get("gsm8k_acc"), c.get("gsm8k_ci")), pct(c.get("gsm8k_vs_f16"), c.get("gsm8k_vs_f16_ci"), True),
            "-" if c.get("mean_exit_layer") is None else f"{c['mean_exit_layer']:.1f}", f"{c['seconds']:.0f} |"]))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b", choices=model_zoo.names())
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                    help="comma-separated: derived kinds (f16, q8_0, q4_0, q4_0-imatrix, ...) and preset:NAME")
    ap.add_argument("--limit", type=int, default=None, help="only the first N problems of each task")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="default reports/MODEL")
    ap.add_argument("--merge", action="store_true",
                    help="keep the configurations OUT/tasks.json already holds and run only the others")
    ap.add_argument("--merge-from", action="append", default=[], metavar="JSON",
                    help="also keep the configurations of this tasks.json (another run's --out, e.g. one "
                         "run beside this one); repeatable; implies --merge")
    a = ap.parse_args(argv)
    t0 = time.time()
    out = a.out or os.path.join("reports", a.model)
    os.makedirs(out, exist_ok=True)
    done = None
    earlier = [os.path.join(out, "tasks.json")] if a.merge or a.merge_from else []
    for path in [p for p in earlier if os.path.isfile(p)] + a.merge_from:
        with open(path, encoding="utf-8") as f:
            rep = json.load(f)
        if done is None:
            done = rep
            continue
        if (done.get("model"), done.get("humaneval_n"), done.get("gsm8k_n")) != \
                (rep.get("model"), rep.get("humaneval_n"), rep.get("gsm8k_n")):
            raise SystemExit(f"--merge-from {path}: its results are for another model or problem set")
        done["commands"] = done.get("commands", []) + [c for c in rep.get("commands", [])
                                                       if c not in done.get("commands", [])]
        done["configs"].update({k: v for k, v in rep["configs"].items() if k not in done["configs"]})
    command = "RIVER_GGUF_CACHE=.cache/test .venv/bin/python benchmarks/task_accuracy.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    commands = (done or {}).get("commands", []) + [command.strip()]

    def save(rep: dict) -> str:
        rep["commands"] = commands
        rep["seconds"] = sum(c["seconds"] for c in rep["configs"].values())
        with open(os.path.join(out, "tasks.json"), "w", encoding="utf-8") as f:
            json.dump(rep, f, indent=1)
        md = (f"# {rep['model']}: task accuracy, greedy\n\nGenerated by "
              + ", then ".join(f"`{c}`" for c in commands)
              + f" ({rep['seconds']:.0f} s of decoding in all, {rep['threads']} threads).\n\n" + markdown(rep))
        with open(os.path.join(out, "tasks.md"), "w", encoding="utf-8") as f:
            f.write(md)
        return md

    rep = run(a.model, [c for c in a.configs.split(",") if c], a.limit, a.threads, done=done, save=save)
    print(save(rep))
    print(f"({time.time() - t0:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
