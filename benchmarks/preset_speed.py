"""Decode speed of a River GGUF's presets against llama.cpp's static quants, in one run, and the
fraction of the speed their weight bytes predict.

    RIVER_GGUF_CACHE=.cache/test python benchmarks/preset_speed.py [--model smollm2] [--tokens 128] [--repeats 5]
        [--river FILE] [--setting 'LABEL={"mode": "river-only", "river_attention": "backbone"}' ...]
        [--static q4_0-imatrix,q4_k_m-imatrix,q8_0]

The River GGUF is the one `river-gguf convert` makes with its defaults (evaluate.default_river_gguf),
or FILE; its stored presets are timed, and each --setting (exit options as JSON) beside them.
--static lists the ladder kinds llama.cpp runs (model_zoo.derived; default f16,q8_0,q4_k_m,q4_0), and
--static-file LABEL=FILE adds any other GGUF.
Each configuration decodes `--tokens` greedy tokens after the same prompt, never stopping at EOS;
river_gguf runs the package's token loop (a Model's Session), and only its evaluations (the
session's counters) and llama.cpp's `llama_decode` are timed (no Python-side sampling or
batch filling on either side), flash attention on both sides, configurations interleaved, median of
`--repeats`; "x REF" is the geometric mean over rounds of the ratio to llama.cpp's REF in the same
round, with a 95% bootstrap interval over rounds. "Predicted" is a line t = a + b * bytes through llama.cpp's own (F16 bytes, F16 time)
and (Q4_0 bytes, Q4_0 time) points, evaluated at the weight bytes a River step reads
(cost_model.step_bytes, averaged over the run's exit layers).
"""
import argparse
import json
import os
import statistics
import sys
import threading

import numpy as np

try:  # an installed river_gguf (the checkout's python/ has no native module)
    import river_gguf  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

from river_gguf import Model, presets  # noqa: E402
from river_gguf._loader import native  # noqa: E402
from river_gguf.session import Session  # noqa: E402
from river_gguf.calibrate import cost_model  # noqa: E402

from river_gguf.eval import report as evaluate

from river_gguf.eval import model_zoo
from river_gguf.measure.llama_decode import LlamaDecoder  # noqa: E402

# --gpu-check's settings beside the presets. "all tested": tau 1.0 runs the exit test after every
# layer and no cos passes it (cos <= 1), so against "backbone" it prices the test alone.
GPU_CHECK_SETTINGS = [
    ("backbone", {"mode": "backbone"}),
    ("river-only", {"mode": "river-only"}),
    ("tau 0.97", {"mode": "river", "threshold": 0.97, "tail": 0, "river_attention": "river"}),
    ("all tested", {"mode": "river", "threshold": 1.0, "min_exit_layer": 0, "tail": 0, "river_attention": "river"}),
]
PROMPT = "Once upon a time, in a small village by the sea, there lived an old fisherman who"
N_CTX = 1024


def argmax(row, seen):
    """Greedy, never stopping at EOS: every configuration decodes the same count of steps."""
    return int(np.argmax(row))


class RiverRun:
    def __init__(self, path, threads, join_weights=True, ngl=0):
        self.m = Model(path, n_ctx=N_CTX, n_threads=threads, n_gpu_layers=ngl)
        self.unjoined = None
        if not join_weights:
            # The engine as before joined Q/K/V and gate/up weights, for comparison: repacked but
            # not joined, which a Model does not offer (its repack=False turns off both).
            self.unjoined = native.Engine(path, "", n_ctx=N_CTX, n_threads=threads, n_batch=512, fuse=False)
        self.toks = self.m.tokenize(PROMPT)

    def session(self, options):
        if self.unjoined is None:
            return self.m.session(options)
        # The package's token loop on the unjoined engine, its cache its own (as Model.backbone_session's).
        return Session(self.m, self.unjoined, threading.RLock(), options, own_cache=True,
                       verify_kernels=self.m.verify_kernels)

    def decode(self, n, preset):
        o = self.m.options(**presets.Setting.of(**preset).call_options()) if isinstance(preset, dict) else self.m.options(preset=preset)
        # The package's token loop: a prefill, then n + 1 tokens, the first from the prefill's row
        # and n from decode steps (or lossless rounds, for a lossless setting); the session's
        # counters time each evaluation alone, as llama_decode alone below.
        with self.session(o) as session:
            session.prefill(self.toks)
            exits = [step.exit_layer for step in session.decode(argmax, limit=n + 1)][1:]
            c = session.counters
        if o.mode == "river-only":
            exits = [-1] * len(exits)
        return c.decode_tokens / c.decode_s, exits


def paired_ratio(a, b, draws: int = 2000, seed: int = 20261201):
    """Speed ratio a/b from rounds run side by side: the geometric mean of the per-round ratios
    (a slow round slows both alike and cancels), with a 95% bootstrap interval over rounds."""
    logs = np.log(np.asarray(a, dtype=float) / np.asarray(b, dtype=float))
    rng = np.random.default_rng(seed)
    boot = logs[rng.integers(0, len(logs), size=(draws, len(logs)))].mean(axis=1)
    return float(np.exp(logs.mean())), [float(np.exp(np.percentile(boot, 2.5))), float(np.exp(np.percentile(boot, 97.5)))]


class LlamaRun:
    def __init__(self, path, threads, ngl=0):
        self.dec = LlamaDecoder(path, N_CTX, threads, n_gpu_layers=ngl)
        self.toks = self.dec.tokenize(PROMPT)

    def decode(self, n, _preset=None):
        _, steps, secs = self.dec.greedy(self.toks, n + 1, stop_at_eog=False)
        return steps / secs, None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", choices=sorted(model_zoo.MODELS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--unjoined", action="store_true",
                    help="add the fast preset on an engine that does not join Q/K/V and gate/up weights")
    ap.add_argument("--river", default=None, metavar="FILE", help="River GGUF (default: the converter's default)")
    ap.add_argument("--setting", action="append", default=[], metavar="LABEL=JSON",
                    help="also time these exit options on the River GGUF, e.g. 'attn={\"mode\": \"river-only\"}'")
    ap.add_argument("--no-presets", action="store_true", help="time only the --setting rows")
    ap.add_argument("--static", default="f16,q8_0,q4_k_m,q4_0", help="llama.cpp's files to time (ladder kinds)")
    ap.add_argument("--static-file", action="append", default=[], metavar="LABEL=FILE",
                    help="also time this GGUF in llama.cpp (e.g. a static mix from benchmarks/mix_study.py)")
    ap.add_argument("--ngl", type=int, default=0,
                    help="layers offloaded to the GPU on both sides (-1: all, with the head and the river)")
    ap.add_argument("--gpu-check", action="store_true",
                    help="scripts/gpu_check.sh's table: the backbone, river-only, tau 0.97 and every layer tested "
                         "(tau 1.0, which no similarity passes) beside the presets, against llama.cpp's file of the "
                         "backbone's type and Q4_0, and the cost of one exit test")
    a = ap.parse_args(argv)

    path = a.river or evaluate.default_river_gguf(a.model, n_threads=a.threads, progress=False)
    river = RiverRun(path, a.threads, ngl=a.ngl)
    if a.gpu_check and not a.static_file:  # llama.cpp's files of the model: its backbone's type and Q4_0
        backbone_type = evaluate.river_types(river.m.metadata)[1].lower()
        a.static = ",".join(dict.fromkeys([backbone_type, "q4_0"]))
    if a.gpu_check:
        a.setting = [f"{label}={json.dumps(o)}" for label, o in GPU_CHECK_SETTINGS] + a.setting
    statics = {q.upper(): LlamaRun(model_zoo.derived(a.model, q), a.threads, ngl=a.ngl)
               for q in a.static.split(",") if q}
    for s in a.static_file:
        label, _, file = s.partition("=")
        statics[label] = LlamaRun(file, a.threads, ngl=a.ngl)
    configs = [] if a.no_presets else [(f"River {p}", river, p) for p in presets.NAMES if p in river.m.presets]
    for s in a.setting:
        label, _, js = s.partition("=")
        configs.append((f"River {label}", river, json.loads(js)))
    if a.unjoined:
        configs.append(("River fast, weights not joined", RiverRun(river.m.model_path, a.threads, False), "fast"))
    configs += [(f"llama.cpp {k}", r, None) for k, r in statics.items()]
    speeds = {name: [] for name, _, _ in configs}
    exits = {}
    for i in range(a.repeats):
        order = configs if i % 2 == 0 else list(reversed(configs))  # load drift hits every row alike
        for name, runner, p in order:
            tps, ex = runner.decode(a.tokens, p)
            speeds[name].append(tps)
            if ex is not None:
                exits[name] = ex
    med = {k: statistics.median(v) for k, v in speeds.items()}

    layers, head = cost_model.weight_bytes(river.m)
    L = river.m.n_layer
    # llama.cpp's per-step bytes: the same layer/head accounting on its own files.
    b_f16 = cost_model.step_bytes(layers, head, L, L - 1, 0, False)
    b_q4 = cost_model.step_bytes(layers, head, L, -1, 0, True)
    rows = []
    line = None
    if "llama.cpp F16" in med and "llama.cpp Q4_0" in med:
        t_f16, t_q4 = 1 / med["llama.cpp F16"], 1 / med["llama.cpp Q4_0"]
        slope = (t_f16 - t_q4) / (b_f16 - b_q4)
        line = lambda b: 1 / (t_q4 + slope * (b - b_q4))  # noqa: E731
    for name, _, p in configs:
        row = {"config": name, "decode_tok_s": med[name], "runs": speeds[name]}
        for ref in statics:
            x, ci = paired_ratio(speeds[name], speeds[f"llama.cpp {ref}"])
            row[f"x_{ref}"], row[f"x_{ref}_ci"] = x, ci
        if p is not None:
            o = presets.Setting.of(**p) if isinstance(p, dict) else river.m.presets[p].setting
            b = float(np.mean([cost_model.step_bytes(layers, head, L, *cost_model.setting_step(o, L, e))
                               for e in exits[name]]))
            row.update(options=o.named(), mean_exit_layer=float(np.mean(exits[name])), mib_per_token=b / 2**20)
            if line is not None:
                row.update(predicted_tok_s=line(b), x_predicted=med[name] / line(b))
        rows.append(row)

    print(f"\n{a.model}: {a.threads} threads, {a.tokens} greedy tokens, median of {a.repeats}, interleaved\n")
    refs = list(statics)
    print("| config | decode tok/s | " + " | ".join(f"x {k}" for k in refs) + " | MiB/token | predicted tok/s | x predicted |")
    print("|---|---:|" + "---:|" * len(refs) + "---:|---:|---:|")
    for r in rows:
        f = lambda k, fmt: fmt.format(r[k]) if k in r else ""  # noqa: E731
        xs = " | ".join(f"{r[f'x_{k}']:.2f} [{r[f'x_{k}_ci'][0]:.2f}, {r[f'x_{k}_ci'][1]:.2f}]" for k in refs)
        print(f"| {r['config']} | {r['decode_tok_s']:.1f} | {xs} | {f('mib_per_token', '{:.0f}')} | "
              f"{f('predicted_tok_s', '{:.1f}')} | {f('x_predicted', '{:.2f}')} |")
    if a.gpu_check:
        # One exit test: the step time it adds over the plain backbone, per tested layer (the
        # last layer is never tested: nothing is left for the river).
        t_all, t_bb = 1 / med["River all tested"], 1 / med["River backbone"]
        per = [(1 / x - 1 / y) / (L - 1) for x, y in zip(speeds["River all tested"], speeds["River backbone"])]
        print(f"\nexit test: {1e6 * (t_all - t_bb) / (L - 1):.1f} us per tested layer (median step times; "
              f"per round {', '.join(f'{1e6 * p:.1f}' for p in per)}), {L - 1} layers tested, "
              f"{100 * (t_all / t_bb - 1):.1f}% of a backbone step in all")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"model": a.model, "river": path, "rows": rows, "threads": a.threads, "tokens": a.tokens,
                       "repeats": a.repeats}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
