"""Decode speed of River mode against the backbone, river-only and llama.cpp, in one run.

    .venv/bin/python benchmarks/river_speed.py [--threads 2] [--tokens 128] [--repeats 3]
                                                       [--rivers q4_0,q4_k_m] [--json out.json]

Backbone: the F16 SmolLM2 written from the shipped Q4_1. For each river type it builds (once,
cached) a River GGUF, then measures greedy decode tok/s of river_gguf in `river` mode at the
file's tau (river head on and off), at tau = 0.97, in `backbone` and `river-only` mode, and of
llama.cpp on the F16 file and on the river-type file. Every River figure comes with its mean
exit layer.

"Predicted" is what the bytes read per token predict from llama.cpp's own speeds: a line
t = a + b * bytes through llama.cpp's (F16 bytes, F16 time) and (river-type bytes, time) points,
evaluated at the bytes a River token reads (its backbone layers, its river layers, its head).
"""
import argparse
import json
import os
import statistics
import sys

import numpy as np

from river_gguf.greedy import greedy

N_CTX = 1024
PROMPT = (
    "Write a Python function that returns the n-th Fibonacci number, then explain how it works. "
    "Question: A farmer has 12 cows and buys 3 times as many sheep. How many animals does he have?"
)


def tensor_bytes(path):
    from gguf import GGUFReader

    return {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors}


def bytes_per_token(sizes, n_layer, exit_layers, river_head, mode):
    """Weight bytes a decode step reads, averaged over the steps' exit layers."""
    def layer(prefix, l):
        key = f"{prefix}blk.{l}."
        return sum(v for k, v in sizes.items() if k.startswith(key))

    bb = [layer("", l) for l in range(n_layer)]
    rv = [layer("river.", l) for l in range(n_layer)]
    bb_head = sizes.get("output.weight", sizes["token_embd.weight"])
    rv_head = sizes.get("river.output.weight", sizes.get("river.token_embd.weight", bb_head))
    total = []
    for e in exit_layers:
        if mode == "river-only":
            e = -1
        exited = e < n_layer - 1
        head = rv_head if (exited and river_head) else bb_head
        total.append(sum(bb[: e + 1]) + sum(rv[e + 1:]) + head)
    return float(np.mean(total))


class RiverRun:
    def __init__(self, path, threads):
        from river_gguf import Model

        self.m = Model(path, n_ctx=N_CTX, n_threads=threads)
        self.toks = self.m.tokenize(PROMPT)

    def decode(self, n, **opts):
        # The package's token loop, greedy and never stopping at EOS, as in llama.cpp's loop below;
        # the session's counters time each decode step's evaluation alone, as llama_decode alone.
        res = greedy(self.m, self.toks, n, stop_at_eog=False, **opts)
        return res.decode_steps / res.decode_seconds, res.decode_exit_layers


class LlamaRun:
    def __init__(self, path, threads):
        from river_gguf.measure.llama_decode import LlamaDecoder

        self.dec = LlamaDecoder(path, N_CTX, threads)
        self.toks = self.dec.tokenize(PROMPT)

    def decode(self, n, **_):
        _, steps, secs = self.dec.greedy(self.toks, n, stop_at_eog=False)
        return steps / secs, None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rivers", default="q4_0,q4_k_m")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from river_gguf.convert.build import build_river_gguf
    from river_gguf.default_model import cache_dir, derived_model

    f16 = derived_model("f16")
    rows, results = [], {}
    llama_f16 = LlamaRun(f16, args.threads)
    for rt in args.rivers.split(","):
        quant = derived_model(rt)
        river_file = str(cache_dir() / f"bench.f16+{rt}.river.gguf")
        if not os.path.exists(river_file):
            build_river_gguf(f16, river_file, river_type=rt, progress=False, n_threads=args.threads)
        r = RiverRun(river_file, args.threads)
        tau = r.m.exit_options.threshold
        llama_q = LlamaRun(quant, args.threads)
        configs = [
            ("llama.cpp F16", llama_f16, {}),
            (f"llama.cpp {rt.upper()}", llama_q, {}),
            ("backbone", r, {"mode": "backbone"}),
            (f"river-only ({rt}, river head)", r, {"mode": "river-only", "river_head": True}),
            (f"river tau={tau:.4f} (file), river head", r, {"mode": "river", "river_head": True}),
            (f"river tau={tau:.4f} (file), backbone head", r, {"mode": "river", "river_head": False}),
            ("river tau=0.97, river head", r, {"mode": "river", "threshold": 0.97, "river_head": True}),
            ("river tau=0.98, river head", r, {"mode": "river", "threshold": 0.98, "river_head": True}),
        ]
        speeds = {name: [] for name, _, _ in configs}
        exits = {}
        for _ in range(args.repeats):
            for name, runner, opts in configs:  # interleaved, so load drift hits every row alike
                tps, ex = runner.decode(args.tokens, **opts)
                speeds[name].append(tps)
                if ex is not None:
                    exits[name] = ex
        sizes = tensor_bytes(river_file)
        n_layer = r.m.n_layer
        med = {k: statistics.median(v) for k, v in speeds.items()}
        f16_tps, q_tps = med["llama.cpp F16"], med[f"llama.cpp {rt.upper()}"]
        b_f16 = bytes_per_token(sizes, n_layer, [n_layer - 1], False, "backbone")
        b_q = bytes_per_token(sizes, n_layer, [-1], True, "river-only")
        slope = (1 / f16_tps - 1 / q_tps) / (b_f16 - b_q)
        for name, _, opts in configs:
            row = {"river_type": rt, "config": name, "decode_tok_s": med[name],
                   "x_llama_f16": med[name] / f16_tps}
            if name in exits:
                ex = exits[name]
                row["mean_exit_layer"] = float(np.mean(ex))
                b = bytes_per_token(sizes, n_layer, ex, opts.get("river_head", False), opts.get("mode"))
                predicted = 1 / (1 / q_tps + slope * (b - b_q))
                row.update(mb_per_token=b / 2**20, predicted_tok_s=predicted, x_predicted=med[name] / predicted)
            rows.append(row)
        results[rt] = {"tau_file": tau}

    print(f"\n{args.threads} threads, {args.tokens} greedy tokens, median of {args.repeats}\n")
    print("| river | config | decode tok/s | x llama.cpp F16 | mean exit layer | MiB/token | predicted tok/s | x predicted |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        f = lambda k, fmt: (fmt.format(r[k]) if k in r else "")
        print(f"| {r['river_type']} | {r['config']} | {r['decode_tok_s']:.1f} | {r['x_llama_f16']:.2f} | "
              f"{f('mean_exit_layer', '{:.1f}')} | {f('mb_per_token', '{:.0f}')} | {f('predicted_tok_s', '{:.1f}')} | "
              f"{f('x_predicted', '{:.2f}')} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"rows": rows, "rivers": results, "threads": args.threads, "tokens": args.tokens}, fh, indent=1)


if __name__ == "__main__":
    sys.exit(main())
