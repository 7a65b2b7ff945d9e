"""Task accuracy, as the River paper judges it: HumanEval pass@1 and GSM8K exact match, greedy,
for the F16 backbone, llama.cpp's static quants and every preset of the model's default River GGUF.

    RIVER_GGUF_CACHE=.cache/test PYTHONPATH=python python benchmarks/task_accuracy.py \\
        [--model qwen2.5-coder-0.5b] [--configs f16,q8_0,q4_0,preset:fast,...] [--limit N] [--out DIR]

Every configuration runs on river_gguf's engine (a static file in backbone mode computes what
llama.cpp computes, bit for bit: tests/test_engine_parity.py), greedy, batch 1. HumanEval: all 164
problems, the prompt continued and cut at the usual stop sequences, checked in eval/tasks.py's
sandbox (own process group, time and memory limits, no network). GSM8K: the 100 shipped items,
4-shot from the calibration split (never an item's own text), the last number of the answer
against the reference's. Accuracy intervals are 95% bootstrap intervals over problems; each
configuration's difference from F16 has a paired interval (the same problems resampled for both).

Writes OUT/tasks.json and OUT/tasks.md (default OUT: reports/MODEL).
"""
import argparse
import json
import os
import sys
import time

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


def run(model: str, configs, limit, n_threads: int) -> dict:
    he = tasks.humaneval_problems()
    gs = all_gs = tasks.gsm8k_problems()
    if limit:
        he, gs = he[:limit], gs[:limit]
    out = {"model": model, "threads": n_threads, "configs": {}, "humaneval_n": len(he), "gsm8k_n": len(gs)}
    for config in configs:
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
    rng = np.random.default_rng(SEED)
    idx = {k: rng.integers(0, n, size=(DRAWS, n)) for k, n in (("humaneval", len(he)), ("gsm8k", len(gs))) if n}
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
    a = ap.parse_args(argv)
    t0 = time.time()
    rep = run(a.model, [c for c in a.configs.split(",") if c], a.limit, a.threads)
    rep["command"] = "RIVER_GGUF_CACHE=.cache/test PYTHONPATH=python python benchmarks/task_accuracy.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    rep["seconds"] = time.time() - t0
    out = a.out or os.path.join("reports", a.model)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "tasks.json"), "w", encoding="utf-8") as f:
        json.dump(rep, f, indent=1)
    md = (f"# {rep['model']}: task accuracy, greedy\n\nGenerated by `{rep['command'].strip()}` "
          f"({rep['seconds']:.0f} s, {rep['threads']} threads).\n\n" + markdown(rep))
    with open(os.path.join(out, "tasks.md"), "w", encoding="utf-8") as f:
        f.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
