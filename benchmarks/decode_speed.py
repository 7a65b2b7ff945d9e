"""Prefill and decode speed of river_gguf (backbone) against llama.cpp, on SmolLM2 Q4_1 and F16.

    .venv/bin/python benchmarks/decode_speed.py [--threads 2] [--tokens 128] [--repeats 3] [--json out.json]

Both engines get the same token ids, the same thread count, flash attention and an F16 KV
cache, and do the same work per step: one token per eval, a copy of its logits row into
numpy, greedy argmax. Prefill is the best of the repeats (it is short, so the minimum is
the least noisy estimate); decode is the median. Repeats alternate the engine order so
that drifting machine load hits both sides alike.

river_gguf's side runs the package's token loop (a Model's Session: greedy's argmax for the
plain path), whose counters time each evaluation alone, as llama_decode is timed alone on the
other side.

"Segmented" is river_gguf's exit-capable decode path (Session.decode(trace=True)): the backbone
graph with an exit-decision node after every layer, each recording its layer's score; its cost
over the plain backbone graph is the price of deciding exits at all.
"""
import argparse
import json
import statistics
import sys

import numpy as np

from river_gguf.greedy import greedy

N_CTX = 1024
PROMPT_TOKENS = 200
PARAGRAPH = (
    "The river rose in the hills above the town. Every spring it carried snow water down past the mill, "
    "and the miller's children counted the days until the ice broke. One year the flood came early; "
    "the bridge held, but the road to the market was closed for a week, and the town lived on what "
    "the cellars and the smokehouse had kept through the winter. "
)


def argmax(row, seen):
    """Greedy, never stopping: every run decodes the same count of steps."""
    return int(np.argmax(row))


def river_prefill(model, toks):
    """(seconds, first token) of a prompt batch from an empty cache, the evaluation alone."""
    with model.session() as session:  # a new session starts from an empty cache
        session.prefill(toks)
        return session.counters.prefill_s, argmax(session.row(len(toks) - 1), len(toks))


def river_decode(model, toks, n, trace=False):
    """(seconds, tokens) of n greedy decode steps after `toks`: the decode steps' evaluations
    alone, and the token each step's row chose."""
    if not trace:
        res = greedy(model, toks, n + 1, stop_at_eog=False)  # the first token comes from the prefill
        return res.decode_seconds, res.tokens[1:]
    with model.session() as session:
        session.prefill(toks)
        out = [step.token for step in session.decode(argmax, limit=n + 1, trace=True)][1:]
        return session.counters.decode_s, out


class RiverSide:
    name = "river_gguf"

    def __init__(self, path, threads):
        from river_gguf import Model

        self.m = Model(path, n_ctx=N_CTX, n_threads=threads, mode="backbone")

    def prefill(self, toks):
        return river_prefill(self.m, toks)

    def decode(self, toks, n, trace=False):
        return river_decode(self.m, toks, n, trace)


class LlamaSide:
    name = "llama.cpp"

    def __init__(self, path, threads):
        from river_gguf.measure.llama_decode import LlamaDecoder

        self.dec = LlamaDecoder(path, N_CTX, threads)

    def prefill(self, toks):
        self.dec.reset()
        secs = self.dec.decode(toks)
        return secs, int(np.argmax(self.dec.last_logits()))

    def decode(self, toks, n):
        _, tok = self.prefill(toks)
        out, secs = [], 0.0
        for _ in range(n):
            secs += self.dec.decode([tok])
            tok = int(np.argmax(self.dec.last_logits()))
            out.append(tok)
        return secs, out

    def close(self):
        self.dec.close()


def prompt_tokens(river_side):
    text = PARAGRAPH * (PROMPT_TOKENS // 40 + 2)
    toks = river_side.m.tokenize(text)[:PROMPT_TOKENS]
    assert len(toks) == PROMPT_TOKENS
    return toks


def bench_model(label, path, args):
    rs, ls = RiverSide(path, args.threads), LlamaSide(path, args.threads)
    toks = prompt_tokens(rs)
    for side in (rs, ls):  # warm-up: page in the mmap, spin up thread pools
        side.decode(toks, 4)
    rs.decode(toks, 4, trace=True)

    pre = {rs.name: [], ls.name: []}
    dec = {rs.name: [], ls.name: [], "segmented": []}
    outs = {}
    for r in range(args.repeats):
        for side in ((rs, ls) if r % 2 == 0 else (ls, rs)):
            pre[side.name].append(len(toks) / side.prefill(toks)[0])
            dt, outs[side.name] = side.decode(toks, args.tokens)
            dec[side.name].append(args.tokens / dt)
            if side is rs:
                dt, outs["segmented"] = rs.decode(toks, args.tokens, trace=True)
                dec["segmented"].append(args.tokens / dt)
    ls.close()

    def agree(a, b):  # leading tokens equal: a sanity check that both ran the same model
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    return {
        "model": label, "path": path, "prompt_tokens": len(toks),
        "prefill_tok_s": {k: max(v) for k, v in pre.items()},
        "decode_tok_s": {k: statistics.median(v) for k, v in dec.items()},
        "runs": {"prefill": pre, "decode": dec},
        "greedy_agreement": {"llama.cpp": agree(outs["river_gguf"], outs["llama.cpp"]),
                             "segmented": agree(outs["river_gguf"], outs["segmented"])},
    }


def markdown(results, args) -> str:
    lines = [f"threads={args.threads}, prompt={PROMPT_TOKENS} tokens, decode={args.tokens} tokens, "
             f"repeats={args.repeats} (prefill: best, decode: median)", "",
             "| model | prefill river_gguf | prefill llama.cpp | ratio | decode river_gguf | decode llama.cpp "
             "| ratio | decode segmented | segmented overhead | greedy agree (llama / seg) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        p, d = r["prefill_tok_s"], r["decode_tok_s"]
        overhead = d["river_gguf"] / d["segmented"] - 1  # extra time per token, relative to fused
        a = r["greedy_agreement"]
        lines.append(
            f"| {r['model']} | {p['river_gguf']:.1f} | {p['llama.cpp']:.1f} | {p['river_gguf'] / p['llama.cpp']:.2f} "
            f"| {d['river_gguf']:.1f} | {d['llama.cpp']:.1f} | {d['river_gguf'] / d['llama.cpp']:.2f} "
            f"| {d['segmented']:.1f} | {100 * overhead:+.0f}% | {a['llama.cpp']}/{args.tokens} / "
            f"{a['segmented']}/{args.tokens} |")
    lines.append("")
    lines.append("tok/s; ratio = river_gguf / llama.cpp; segmented overhead = extra time per decoded "
                 "token of the per-layer exit path over the fused backbone graph.")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128, help="decoded tokens per run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", metavar="OUT", help="also write the raw numbers here")
    args = ap.parse_args(argv)
    if not 1 <= args.tokens <= N_CTX - PROMPT_TOKENS - 1:
        ap.error(f"--tokens must be in [1, {N_CTX - PROMPT_TOKENS - 1}]")
    if args.repeats < 1 or args.threads < 1:
        ap.error("--repeats and --threads must be >= 1")

    from river_gguf.default_model import default_model_path, derived_model

    models = [("SmolLM2-135M Q4_1", default_model_path()), ("SmolLM2-135M F16", derived_model("f16"))]
    results = []
    for label, path in models:
        print(f"benchmarking {label} ...", file=sys.stderr, flush=True)
        results.append(bench_model(label, path, args))
    print(markdown(results, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "tokens": args.tokens, "repeats": args.repeats,
                       "n_ctx": N_CTX, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
