"""Fits the decode cost per weight element of each ggml type from stock llama.cpp's own timings,
the table cost_model.TYPE_COST stores.

    RIVER_GGUF_CACHE=.cache/test python benchmarks/type_costs.py [--model smollm2] [--tokens 128] [--repeats 5]

Each file of the static ladder (and the static mixes of benchmarks/mix_study.py that exist in the
cache) decodes `--tokens` greedy tokens in llama.cpp, `llama_decode` timed alone, flash attention
on, files interleaved, median of `--repeats`. Then a least-squares fit of

    seconds per step = overhead + sum over weight matrices of n_elements * cost[type]

with the types each file actually holds (read from the file). The costs are printed relative to
Q8_0's, the unit of cost_model.TYPE_COST. Why per element and not per byte: on a small model with
few threads, decode is bound by the dot-product kernels, not memory, and a Q5_0 element costs more
than a Q8_0 element though it is smaller (SmolLM2 on 2 cores: Q8_0 attention runs as fast as Q5_0's).
"""
import argparse
import json
import os
import statistics
import sys
from collections import defaultdict

import numpy as np

try:  # an installed river_gguf (the checkout's python/ has no native module)
    import river_gguf  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

from river_gguf.eval import model_zoo  # noqa: E402
from river_gguf.measure.llama_decode import LlamaDecoder  # noqa: E402
from river_gguf.gguf.reader import GGUFReader

PROMPT = "Once upon a time, in a small village by the sea, there lived an old fisherman who"


def type_elements(path: str) -> dict:
    """{type name: elements} of a file's 2-D weights (the head counted once, as a tied embedding is)."""

    r = GGUFReader(path)
    names = {t.name for t in r.tensors}
    out = defaultdict(int)
    for t in r.tensors:
        if len(t.shape) < 2 or t.name.startswith("river."):
            continue
        if t.name == "token_embd.weight" and "output.weight" in names:
            continue  # a lookup, not a product, when the head is its own tensor
        out[t.tensor_type.name] += int(np.prod([int(x) for x in t.shape]))
    return dict(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", choices=sorted(model_zoo.MODELS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--file", action="append", default=[], metavar="GGUF", help="also time this file")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)

    files = {k: model_zoo.derived(a.model, k) for k in model_zoo.ladder_kinds(a.model)
             if not k.endswith(model_zoo.IMATRIX_SUFFIX)}
    for f in a.file:
        files[os.path.basename(f)] = f
    runners = {k: LlamaDecoder(p, 1024, a.threads) for k, p in files.items()}
    toks = next(iter(runners.values())).tokenize(PROMPT)
    times = defaultdict(list)
    names = list(runners)
    for i in range(a.repeats):
        for k in (names if i % 2 == 0 else names[::-1]):
            _, steps, secs = runners[k].greedy(toks, a.tokens + 1, stop_at_eog=False)
            times[k].append(secs / steps)
    step = {k: statistics.median(v) for k, v in times.items()}
    elems = {k: type_elements(p) for k, p in files.items()}
    types = sorted({t for e in elems.values() for t in e})
    X = np.array([[1.0] + [elems[k].get(t, 0) for t in types] for k in names])
    y = np.array([step[k] for k in names])
    coef, *_ = np.linalg.lstsq(X, y, rcond=None)
    fit = X @ coef
    print(f"\n{a.model}: {a.threads} threads, {a.tokens} tokens, median of {a.repeats}\n")
    print("| file | ms/step | fitted | types (M elements) |")
    print("|---|---:|---:|---|")
    for k, f in zip(names, fit):
        print(f"| {k} | {step[k] * 1e3:.2f} | {f * 1e3:.2f} | "
              + ", ".join(f"{t} {n / 1e6:.1f}" for t, n in sorted(elems[k].items())) + " |")
    unit = coef[1 + types.index("Q8_0")]
    rel = {t: float(c / unit) for t, c in zip(types, coef[1:])}
    print(f"\noverhead {coef[0] * 1e3:.2f} ms/step; cost per element relative to Q8_0: "
          + ", ".join(f"{t} {v:.3f}" for t, v in rel.items()))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"model": a.model, "threads": a.threads, "step_seconds": step, "elements": elems,
                       "overhead_s": float(coef[0]), "relative_cost": rel}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
