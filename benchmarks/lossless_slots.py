"""Does lossless mode pay in a batch? N slots decoding together: plain batched steps against
lossless rounds per slot, and the engine's cost of one batch of B tokens.

    .venv/bin/python benchmarks/lossless_slots.py [--model qwen2.5-coder-0.5b] [--backbone f16]
        [--file RIVER.gguf] [--slots 1,2,4] [--tokens 128] [--rounds 3] [--draft-max 4]
        [--batches 1,2,4,8,12,16] [--threads T] [--json OUT.json]

The file: lossless_speed.py's River GGUF of --model (the --backbone with a Q4_0 river of the F16,
quantized with the model's importance matrix), or --file. One Model over it (flash attention on,
as the server runs), its cache room for the largest N's slots.

Throughput, for each N of --slots: N sessions on sequences 0..N-1, each its own prompt (the first
N of parallel_throughput.py's), prefilled untimed, then each decoding --tokens greedy tokens
(end of generation ignored) in a thread of its own, all started together; a row's aggregate is
the N x --tokens tokens over the wall time from the common start to the last thread's end.
  - backbone: plain decode steps, which the step batcher evaluates together (one batch of up to N
    tokens per step: the weights read once for all slots);
  - lossless: lossless rounds as they run by default (n-gram drafts beside the river's, the draft
    length following acceptance), each round alone under the Model's lock, so the slots' rounds
    take turns;
  - lossless k=K, for each K of --draft-max: the river alone drafting K a round.
Rows are interleaved within each round (order reversed every other round); the table gives the
median over rounds, and each lossless row's ratio to the backbone row at the same N.

The batch curve: calibrate.lossless.measure_costs on a session of the same Model after 256
positions: a single-token decode step (B = 1) and a verify batch of B tokens in one sequence, for
each B of --batches, in ms and over B = 1. From it, per N and draft length k with N x (k+1)
among the B timed: one verify of N x (k+1) tokens (what a joint verify of N slots' rounds would
cost) against N verifies of k+1 (what the slots' separate rounds cost). A joint verify pays only
where that ratio is well below 1; a verify batch's rows are the exact reference's only in its own
kernels, so a joint one would also need the reference to change.

The output is markdown tables and, with --json, one JSON object. Run it alone on the machine; at
a tiny size (--tokens 8 --rounds 1) it only checks that it works.
"""
import argparse
import json
import os
import statistics
import sys
import threading
import time

try:  # an installed river_gguf (the checkout's python/ has no native module)
    import river_gguf  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the other benchmarks
from parallel_throughput import PROMPTS  # noqa: E402
from river_gguf import Model  # noqa: E402
from river_gguf.calibrate import lossless as lossless_cost  # noqa: E402

#: Cache rows per slot: its prompt and --tokens, and a round's drafts beyond them.
SLOT_MARGIN = 64
JOIN_S = 3600


def _argmax(row, seen):
    return int(row.argmax())


def decode_together(m: Model, prompts, tokens: int, options: dict) -> dict:
    """len(prompts) sessions, one per sequence, each decoding `tokens` greedy tokens in a thread
    of its own after its prompt (prefilled first, untimed): aggregate tokens/s, and the lossless
    rounds' acceptance where there are rounds."""
    sessions = [m.session(seq=k, **options) for k in range(len(prompts))]
    try:
        for s, p in zip(sessions, prompts):
            s.prefill(p)
            s.reset_counters()
        barrier = threading.Barrier(len(sessions) + 1)
        made, errors = [0] * len(sessions), []

        def run(k):
            try:
                barrier.wait(timeout=60)
                for _ in sessions[k].decode(_argmax, limit=tokens):
                    made[k] += 1
            except Exception as e:  # noqa: BLE001 - reported after the row
                errors.append(e)

        threads = [threading.Thread(target=run, args=(k,), daemon=True) for k in range(len(sessions))]
        for t in threads:
            t.start()
        barrier.wait(timeout=60)
        t0 = time.perf_counter()
        for t in threads:
            t.join(JOIN_S)
        wall = time.perf_counter() - t0
        if errors:
            raise RuntimeError(f"a slot failed: {errors[0]!r}")
        row = {"tok_s": sum(made) / wall, "tokens": sum(made), "wall_s": wall}
        rounds = sum(s.counters.rounds for s in sessions)
        if rounds:
            drafted = sum(s.counters.drafted for s in sessions)
            accepted = sum(s.counters.accepted for s in sessions)
            row.update(rounds=rounds, drafts_per_round=drafted / rounds, accepted_per_round=accepted / rounds,
                       acceptance=accepted / drafted if drafted else float("nan"))
        return row
    finally:
        for s in sessions:
            s.close()


def row_options(ks) -> dict:
    rows = {"backbone": dict(mode="backbone"), "lossless": dict(mode="lossless")}
    for k in ks:
        rows[f"lossless k={k}"] = dict(mode="lossless", draft_max=k, ngram_draft=False, adaptive_draft=False)
    return rows


def throughput(m: Model, args, token_prompts) -> dict:
    """Per N, per row: the median over rounds of decode_together's rows."""
    rows = row_options(args.draft_max)
    runs = {n: {name: [] for name in rows} for n in args.slots}
    for r in range(args.rounds):
        order = list(rows) if r % 2 == 0 else list(reversed(rows))
        for n in args.slots:
            for name in order:
                runs[n][name].append(decode_together(m, token_prompts[:n], args.tokens, rows[name]))
    out = {}
    for n in args.slots:
        out[n] = {}
        for name, rs in runs[n].items():
            med = {"tok_s": statistics.median(x["tok_s"] for x in rs)}
            for key in ("acceptance", "drafts_per_round", "accepted_per_round"):
                if key in rs[0]:
                    med[key] = statistics.median(x[key] for x in rs)
            out[n][name] = med
    return out


def batch_curve(m: Model, batches) -> dict:
    """B -> seconds of one evaluation of B tokens: the decode step for B = 1, a verify batch else."""
    costs = lossless_cost.measure_costs(m, m.options(mode="lossless"), max(max(batches), 2))
    return {b: costs.step if b == 1 else costs.verify[b] for b in batches}


def joint_verifies(curve: dict, slots) -> list:
    """Per N and k with N x (k+1) timed: one verify of N x (k+1) against N verifies of k+1."""
    out = []
    for n in slots:
        for b in sorted(curve):
            if n > 1 and b >= 2 and n * b in curve:
                out.append({"slots": n, "k": b - 1, "joint_ms": 1e3 * curve[n * b], "separate_ms": 1e3 * n * curve[b],
                            "ratio": curve[n * b] / (n * curve[b])})
    return out


def print_tables(table: dict, curve: dict, joint: list) -> None:
    names = list(next(iter(table.values())))
    print("| slots | " + " | ".join(f"{name} tok/s" for name in names) + " | "
          + " | ".join(f"{name} / backbone" for name in names[1:]) + " | acceptance |")
    print("|---:|" + "---:|" * (2 * len(names) - 1) + "---|")
    for n, row in table.items():
        base = row["backbone"]["tok_s"]
        acc = ", ".join(f"{name} {row[name]['acceptance']:.2f}" for name in names[1:] if "acceptance" in row[name])
        print(f"| {n} | " + " | ".join(f"{row[name]['tok_s']:.1f}" for name in names) + " | "
              + " | ".join(f"{row[name]['tok_s'] / base:.2f}x" for name in names[1:]) + f" | {acc} |")
    print("\n| B tokens | ms | x B=1 |")
    print("|---:|---:|---:|")
    for b, s in sorted(curve.items()):
        print(f"| {b} | {1e3 * s:.1f} | {s / curve[min(curve)]:.2f} |")
    if joint:
        print("\n| slots | k | one verify of N(k+1) ms | N verifies of k+1 ms | joint / separate |")
        print("|---:|---:|---:|---:|---:|")
        for j in joint:
            print(f"| {j['slots']} | {j['k']} | {j['joint_ms']:.1f} | {j['separate_ms']:.1f} | {j['ratio']:.2f} |")


def _ints(text: str):
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b", help="a model_zoo name (default qwen2.5-coder-0.5b)")
    ap.add_argument("--backbone", default="f16", choices=("f16", "q8_0"))
    ap.add_argument("--file", default=None, help="a River GGUF to use instead of --model's")
    ap.add_argument("--slots", default="1,2,4", help="comma-separated slot counts N (default 1,2,4)")
    ap.add_argument("--tokens", type=int, default=128, help="greedy tokens each slot decodes (default 128)")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds (default 3; the median)")
    ap.add_argument("--draft-max", default="4", help="comma-separated fixed draft lengths K (default 4; empty: none)")
    ap.add_argument("--batches", default="1,2,4,8,12,16", help="batch sizes B of the curve (default 1,2,4,8,12,16)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--json", default=None, metavar="OUT.json")
    args = ap.parse_args(argv)
    args.slots, args.draft_max, args.batches = _ints(args.slots), _ints(args.draft_max), _ints(args.batches)
    if not args.slots or not all(1 <= n <= len(PROMPTS) for n in args.slots):
        ap.error(f"--slots must be 1 to {len(PROMPTS)} (one distinct prompt each)")
    if args.tokens < 1 or args.rounds < 1 or args.threads < 1 or not args.batches or min(args.batches) < 1:
        ap.error("--tokens, --rounds, --threads and every batch size must be at least 1")
    if any(k < 1 for k in args.draft_max):
        ap.error("--draft-max values must be at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.file is None:
        from lossless_speed import river_file

        args.file = river_file(args.model, args.backbone, args.threads)
    n_max = max(args.slots)
    probe = Model(args.file, n_ctx=512, n_threads=args.threads, flash_attn=True)
    token_prompts = [probe.tokenize(p) for p in PROMPTS[:n_max]]
    del probe  # its engine goes before the measured one loads
    per_slot = max(len(p) for p in token_prompts) + args.tokens + SLOT_MARGIN
    n_ctx = max(n_max * per_slot, 256 + 16 + max(args.batches) + 1)  # and room for the batch curve's context
    m = Model(args.file, n_ctx=n_ctx, n_threads=args.threads, flash_attn=True)
    table = throughput(m, args, token_prompts)
    curve = batch_curve(m, args.batches)
    joint = joint_verifies(curve, args.slots)
    print_tables(table, curve, joint)
    if args.json:
        out = {"file": os.path.abspath(args.file), "threads": args.threads, "tokens": args.tokens,
               "rounds": args.rounds, "n_ctx": n_ctx, "throughput": {str(n): row for n, row in table.items()},
               "batch_ms": {str(b): 1e3 * s for b, s in curve.items()}, "joint_verify": joint}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
