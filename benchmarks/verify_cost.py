"""A lossless verify batch's cost in decode steps, in ggml's batched kernels and in the decode
steps' kernels (lossless_kernels="decode"), on one file.

    .venv/bin/python benchmarks/verify_cost.py [FILE] [--sizes 2,3,5,9] [--context 300] [--reps 12]
        [-t 2] [--json OUT.json]

FILE: a River GGUF or a plain GGUF (default: Qwen2.5-Coder-0.5B's F16 backbone with its Q4_0-imatrix
river, as benchmarks/lossless_speed.py builds it). After a prompt of --context random tokens, the
engine evaluates one token (a decode step), then batches of each size with every row's logits, in
both kernels; each is the median of --reps runs (the first two left out: they build the graphs),
the cache truncated back before each. The engine is timed alone (Engine.eval: no sampling, no
Python round), flash attention on. Run it alone on the machine.
"""
import argparse
import json
import statistics
import sys
import time

import numpy as np

try:  # an installed river_gguf (the checkout's python/ has no native module)
    from river_gguf._loader import native
except ImportError:
    sys.exit("install river_gguf first: ./scripts/setup.sh")


def timed(engine, tokens, context: int, n: int, decode_kernels: bool, reps: int) -> float:
    """Median seconds of evaluating tokens[context:context + n] after the first `context`."""
    times = []
    for _ in range(reps):
        engine.truncate(context)
        t0 = time.perf_counter()
        engine.eval(tokens[context:context + n], all_logits=n > 1, decode_kernels=decode_kernels)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file", nargs="?", default=None)
    ap.add_argument("--sizes", default="2,3,5,9", help="comma-separated batch sizes")
    ap.add_argument("--context", type=int, default=300, help="cache positions before the batch")
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.file is None:
        sys.path.insert(0, __file__.rsplit("/", 1)[0])
        from lossless_speed import river_file

        args.file = river_file("qwen2.5-coder-0.5b", "f16", args.threads)
    n_ctx = args.context + max(sizes) + 16
    engine = native.Engine(args.file, n_ctx=max(256, n_ctx), n_threads=args.threads, flash_attn=True)
    if not engine.decode_kernels_exact:
        sys.exit(f"{args.file}: this engine cannot verify in the decode kernels (a repacked backbone weight)")
    vocab = engine.hparams["n_vocab"]
    tokens = [int(t) for t in np.random.default_rng(0).integers(0, vocab, args.context + max(sizes))]
    engine.eval(tokens[:args.context])
    step = timed(engine, tokens, args.context, 1, False, args.reps)
    rows = []
    print(f"{args.file}: decode step {1000 * step:.1f} ms, {args.threads} threads, after {args.context} positions")
    print("| batch | batched kernels ms | steps | decode kernels ms | steps | decode / batched |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n in sizes:
        batch = timed(engine, tokens, args.context, n, False, args.reps)
        decode = timed(engine, tokens, args.context, n, True, args.reps)
        rows.append(dict(n=n, batch_s=batch, decode_s=decode))
        print(f"| {n} | {1000 * batch:.1f} | {batch / step:.2f} | {1000 * decode:.1f} | {decode / step:.2f} "
              f"| {decode / batch:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(file=args.file, threads=args.threads, context=args.context, step_s=step, rows=rows), f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
