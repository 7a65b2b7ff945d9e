"""How often lossless greedy text parts from plain backbone decoding, and how close the parting rows are.

    .venv/bin/python benchmarks/lossless_partings.py [--model qwen2.5-coder-0.5b] [--backbone f16]
        [--river-gguf PATH] [--prompts 100] [--tokens 128] [--draft-max 4] [--exact]
        [--lossless-kernels decode|batch] [--json OUT.json]

Lossless mode's tokens are the backbone's argmax over rows computed in verify batches. In the
decode kernels (the default) every verify row is a decode step's bit for bit, so the texts must
not part at all (this counts it at scale). In the batched kernels (--lossless-kernels batch) plain
backbone decoding computes each row in a single-token step, whose kernels round otherwise (F16:
ggml_vec_dot_f16 against tinyBLAS, about 1e-2 in the logits), and the two texts agree except
where a row's top two logits are closer than that difference. This measures it: for each prompt
(the first --prompts evaluation items, alternating HumanEval and GSM8K, river_gguf.measure.data),
--tokens greedy tokens in mode="backbone" and in mode="lossless" (end of generation ignored),
compared token for token. At the first token where they part it records both rows' top-2 margins
and their largest difference.

Reported: the share of texts that part, with a 95% Wilson interval; the rate per token (partings
over the tokens compared up to and including each parting), with a 95% interval; the margins at
every parting. --exact also decodes with verify_kernels (each step's token with a throwaway copy
in one batch: the verify batch's kernels), which lossless text must equal at every prompt (its
partings are counted, and should be 0), and prints the decode speed of both backbone decodings
(wall time from the first token to the last, over the same runs): what bit-reproducible text
across modes costs. This is not a timing benchmark otherwise; run it alone for the speeds.
"""
import argparse
import json
import math
import os
import sys
import time

try:  # an installed river_gguf (the checkout's python/ has no native module)
    import river_gguf  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

import numpy as np  # noqa: E402

from river_gguf.eval import model_zoo  # noqa: E402
from river_gguf.llama import Llama  # noqa: E402
from river_gguf.measure import data as eval_data  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lossless_speed import river_file  # noqa: E402

Z95 = 1.959963984540054


def prompts(n: int) -> list:
    """The first n evaluation prompts, alternating HumanEval and GSM8K (then whichever is left)."""
    domains = [[it.prompt for it in eval_data.select(eval_data.load_domain(d), "evaluation")]
               for d in ("humaneval", "gsm8k")]
    out = []
    for i in range(max(len(d) for d in domains)):
        out += [d[i] for d in domains if i < len(d)]
    if len(out) < n:
        raise SystemExit(f"only {len(out)} evaluation prompts, asked for {n}")
    return out[:n]


def greedy(llm, prompt: str, n: int, **opts) -> tuple:
    """(tokens, the row each was chosen from, seconds from the first token to the last)."""
    rows = []

    def record(input_ids, row):
        rows.append(np.array(row, copy=True))
        return False

    toks = llm.tokenize(prompt.encode(), add_bos=True, special=True)
    out, t_first = [], None
    for t in llm.generate(toks, temp=0.0, reset=True, stopping_criteria=record, **opts):
        t_first = time.perf_counter() if t_first is None else t_first
        out.append(t)
        if len(out) >= n:
            break
    return out, rows, time.perf_counter() - t_first


def margin(row: np.ndarray) -> float:
    top = np.sort(row)[-2:]
    return float(top[1] - top[0])


def wilson(k: int, n: int) -> tuple:
    """95% Wilson score interval of a proportion k/n."""
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    d = 1 + Z95 ** 2 / n
    c = (p + Z95 ** 2 / (2 * n)) / d
    h = Z95 * math.sqrt(p * (1 - p) / n + Z95 ** 2 / (4 * n * n)) / d
    return (max(0.0, c - h), min(1.0, c + h))


def parting(a: list, b: list, rows_a: list, rows_b: list):
    """The first place two texts part, with both rows' margins and difference; None if they agree."""
    i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if i is None:
        return None
    return dict(token=i, backbone=a[i], lossless=b[i], margin_backbone=margin(rows_a[i]),
                margin_lossless=margin(rows_b[i]), largest_difference=float(np.abs(rows_a[i] - rows_b[i]).max()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b", choices=model_zoo.names())
    ap.add_argument("--backbone", default="f16", choices=("f16", "q8_0"))
    ap.add_argument("--river-gguf", default=None, help="a River GGUF to use instead of the model's")
    ap.add_argument("--prompts", type=int, default=100)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--draft-max", type=int, default=4)
    ap.add_argument("--exact", action="store_true", help="also decode with verify_kernels (the exact reference)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--lossless-kernels", default="decode", choices=("decode", "batch"),
                    help="the kernels of lossless verify rows (default decode)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    path = args.river_gguf or river_file(args.model, args.backbone, args.threads)
    kw = dict(n_ctx=2048, n_threads=args.threads, flash_attn=True, verbose=False,
              lossless_kernels=args.lossless_kernels)
    llm = Llama(path, **kw)
    exact = Llama(path, verify_kernels=True, **kw) if args.exact else None
    texts, partings, exact_partings, compared = prompts(args.prompts), [], [], 0
    seconds = {"backbone": 0.0, "verify_kernels": 0.0}
    for n, prompt in enumerate(texts, 1):
        ref, ref_rows, s = greedy(llm, prompt, args.tokens, mode="backbone")
        seconds["backbone"] += s
        got, got_rows, _ = greedy(llm, prompt, args.tokens, mode="lossless", draft_max=args.draft_max)
        p = parting(ref, got, ref_rows, got_rows)
        compared += args.tokens if p is None else p["token"] + 1
        if p is not None:
            partings.append(dict(prompt=n - 1, **p))
        if exact is not None:
            want, want_rows, s = greedy(exact, prompt, args.tokens, mode="backbone")
            seconds["verify_kernels"] += s
            q = parting(want, got, want_rows, got_rows)
            if q is not None:
                exact_partings.append(dict(prompt=n - 1, **q))
        print(f"{n}/{len(texts)}: {'parts at token ' + str(p['token']) if p else 'same'}", file=sys.stderr)

    k, n = len(partings), len(texts)
    lo, hi = wilson(k, n)
    tlo, thi = wilson(k, compared)
    lines = [f"# Lossless greedy against plain backbone decoding: {os.path.basename(path)}", "",
             f"{n} prompts x {args.tokens} tokens, draft_max {args.draft_max}, {llm.river_model.lossless_kernels} "
             "kernels.", "",
             f"- texts that part: {k}/{n} = {100 * k / n:.1f}% [95% CI {100 * lo:.1f}, {100 * hi:.1f}]",
             f"- per token: {k}/{compared} = {100 * k / compared:.3f}% [95% CI {100 * tlo:.3f}, {100 * thi:.3f}]"]
    if partings:
        lines += ["", "| prompt | token | backbone | lossless | top-2 margin (step) | top-2 margin (verify) "
                  "| largest row difference |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {p['prompt']} | {p['token']} | {p['backbone']} | {p['lossless']} | {p['margin_backbone']:.4g} "
                  f"| {p['margin_lossless']:.4g} | {p['largest_difference']:.3g} |" for p in partings]
    if exact is not None:
        speed = {m: n * args.tokens / s for m, s in seconds.items() if s > 0}
        lines += ["", f"- against the exact reference (verify_kernels): {len(exact_partings)}/{n} texts part",
                  f"- backbone decode: {speed['backbone']:.1f} tok/s single-token steps, "
                  f"{speed['verify_kernels']:.1f} tok/s in the verify kernels "
                  f"({100 * (speed['backbone'] / speed['verify_kernels'] - 1):+.0f}% time per token)"]
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(file=path, prompts=n, tokens=args.tokens, draft_max=args.draft_max,
                           lossless_kernels=llm.river_model.lossless_kernels, texts_parted=k,
                           texts_ci=[lo, hi], tokens_compared=compared, token_ci=[tlo, thi], partings=partings,
                           exact_partings=exact_partings, seconds=seconds), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
