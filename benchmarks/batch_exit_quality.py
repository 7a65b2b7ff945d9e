"""Quality of River's exit decided for a batch (the batch-min rule: a batch leaves the backbone
after a layer only when every token in it has settled) against the single-sequence exit.

    .venv/bin/python benchmarks/batch_exit_quality.py [--model FILE.gguf | --zoo-model NAME] [--items 16]
        [--prompt-tokens 64,128] [--tokens 64] [--sizes 1,2,4,8] [--preset balanced] [--threads T] [--json OUT.json]

Every row is teacher-forced on the same token streams, so rows of different batch sizes are
comparable: each prompt (the first 64 to 128 tokens, --prompt-tokens, of an evaluation item,
GSM8K and HumanEval in turn, lengths mixed so that a batch holds sequences at different positions) gets its backbone greedy continuation of --tokens tokens once, decoded alone.
Then, for each batch size N, the prompts go in groups of N to Sessions on sequences 0..N-1 of one
Model (Model.session(seq=k)), each session's decode loop in a thread of its own choosing the
stream's next token, so the decode steps of the group share each batch (Model.step_counts says
how many steps a batch held on average) under the dynamic exit (--preset). Each decode step's
row is compared (measure.divergence.compare: KLD, same top token) with the backbone's row at the
same position (mode="backbone", the same forced loop alone); the row after the prompt is a
prompt batch's and is not scored. N=1 is the single-sequence exit. Intervals: bootstrap 95% over
prompts (measure.divergence.summarize).

Output: one JSON object (--json writes it too) and a markdown table: N, mean exit layer, mean
steps per batch, KLD [CI], same-top % [CI]. Run it alone on the machine; at a tiny size
(--items 2 --prompt-tokens 8,12 --tokens 4 --sizes 1,2) it only checks that it works.
"""
import argparse
import itertools
import json
import os
import sys
import tempfile
import threading
import time

import numpy as np

from river_gguf import Model
from river_gguf.eval import model_zoo
from river_gguf.eval import report as evaluate
from river_gguf.measure import data as eval_data
from river_gguf.measure.divergence import DivergenceRun, compare, summarize
from river_gguf.sequences import greedy_sequences
from river_gguf.session import STOP

MIN_PROMPT_TOKENS = 8
JOIN_S = 3600  # a hang fails the run instead of stalling it


def prompt_lengths(n_items: int, shortest: int, longest: int):
    """Prompt lengths spread over [shortest, longest], mixed so that a batch holds sequences at
    different positions."""
    return [shortest + (i * 41) % (longest - shortest + 1) for i in range(n_items)]


def evaluation_prompts(model, lengths):
    """A token prompt per length, GSM8K and HumanEval evaluation items in turn, each the first
    `length` tokens of its item's text (prompt then completion); shorter items are skipped."""
    pools = [eval_data.select(eval_data.load_domain(d)) for d in eval_data.DOMAINS]
    prompts = []
    for items in itertools.zip_longest(*pools):
        for item in items:
            tokens = item.tokens(model)[0] if item is not None else []
            if len(prompts) < len(lengths) and len(tokens) >= lengths[len(prompts)]:
                prompts.append(tokens[:lengths[len(prompts)]])
    if len(prompts) < len(lengths):
        raise SystemExit(f"only {len(prompts)} evaluation items are long enough")
    return prompts


def forced_rows(model, options, prompts, streams, n: int, out: np.ndarray, exits: np.ndarray) -> dict:
    """Teacher-force stream i after prompt i, prompts in groups of n decoded together (sessions on
    sequences 0..n-1, one thread each). out[i, k]: the row that step k (k >= 1) chose stream[i][k]
    from (out[i, 0] is the prompt batch's row); exits[i, k]: its exit layer. Returns the step
    batcher's counts over the whole run."""
    before = model.step_counts
    for g in range(0, len(prompts), n):
        group = list(range(g, min(g + n, len(prompts))))
        sessions = [model.session(options, seq=s) for s in range(len(group))]
        errors = []
        try:
            for s, i in zip(sessions, group):
                s.prefill(prompts[i])

            def run(s, i):
                def choose(row, seen):
                    k = seen - len(prompts[i])  # the index in the stream of the token chosen now
                    if k >= len(streams[i]):
                        return STOP
                    out[i, k] = row
                    return streams[i][k]
                arrived = False
                try:
                    for step in s.decode(choose, limit=len(streams[i])):
                        exits[i, step.seen - len(prompts[i])] = step.exit_layer
                        if not arrived:
                            # The first token is yielded after the session joined the step batcher
                            # and before any step is evaluated: once every thread is here, each
                            # step waits for the others' (a thread started late on a loaded
                            # machine would otherwise find its partner's steps already run alone).
                            arrived = True
                            start.wait(JOIN_S)
                except BaseException as e:  # raised in the caller's thread
                    errors.append(e)
                finally:
                    if not arrived:  # a loop that ended at once still lets the others start
                        try:
                            start.wait(JOIN_S)
                        except threading.BrokenBarrierError:
                            pass

            start = threading.Barrier(len(group))
            threads = [threading.Thread(target=run, args=(s, i), daemon=True) for s, i in zip(sessions, group)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(JOIN_S)
            if any(t.is_alive() for t in threads):
                raise RuntimeError("a decode thread hung")
            if errors:
                raise errors[0]
        finally:
            for s in sessions:
                s.close()
    after = model.step_counts
    return {k: after[k] - before[k] for k in ("batches", "steps")}


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, metavar="FILE.gguf",
                    help="a River GGUF (default: the converter's default River GGUF of --zoo-model)")
    ap.add_argument("--zoo-model", default="qwen2.5-coder-0.5b", choices=model_zoo.names(),
                    help="without --model: whose default River GGUF (eval.report.default_river_gguf; "
                         "default qwen2.5-coder-0.5b, built and cached when absent)")
    ap.add_argument("--items", type=int, default=16, help="prompts (default 16)")
    ap.add_argument("--prompt-tokens", default="64,128", metavar="MIN,MAX",
                    help="prompt lengths, spread over this range (default 64,128)")
    ap.add_argument("--tokens", type=int, default=64, help="teacher-forced tokens per prompt (default 64)")
    ap.add_argument("--sizes", default="1,2,4,8", help="comma-separated batch sizes N (default 1,2,4,8)")
    ap.add_argument("--preset", default="balanced",
                    help="the dynamic exit preset (default balanced; 'file': mode river at the file's own tau; 'backbone': no exit)")
    ap.add_argument("--threads", type=int, default=min(4, os.cpu_count() or 1))
    ap.add_argument("--step-window", type=float, default=0.05,
                    help="seconds a step waits for the others of its batch (Model.step_window; default 0.05)")
    ap.add_argument("--json", default=None, metavar="OUT.json", help="also write the result here")
    args = ap.parse_args(argv)
    args.sizes = [int(n) for n in args.sizes.split(",")]
    args.prompt_tokens = [int(n) for n in args.prompt_tokens.split(",")]
    if len(args.prompt_tokens) != 2 or not MIN_PROMPT_TOKENS <= args.prompt_tokens[0] <= args.prompt_tokens[1]:
        ap.error(f"--prompt-tokens takes MIN,MAX with {MIN_PROMPT_TOKENS} <= MIN <= MAX")
    if args.items < 1 or args.tokens < 2 or min(args.sizes) < 1:
        ap.error("--items and --sizes must be >= 1, --tokens >= 2")
    if args.model is None:
        args.model = evaluate.default_river_gguf(args.zoo_model, n_threads=args.threads, progress=True)
    return args


def summary_row(n, rows, reference, streams, exits, counts) -> dict:
    run = DivergenceRun()
    for i in range(len(streams)):
        run.add(compare(reference[i, 1:], rows[i, 1:], streams[i][1:]), exits[i, 1:].tolist())
    s = summarize(run)
    return {"n": n, "mean_exit_layer": run.mean_exit_layer, "steps_per_batch": counts["steps"] / max(counts["batches"], 1),
            "batches": counts["batches"], "steps": counts["steps"],
            **{k: s[k] for k in ("n_items", "n_tokens", "kld", "kld_ci", "kld_median", "kld_p99",
                                 "same_top", "same_top_ci")}}


def main(argv=None) -> int:
    args = parse_args(argv)
    n_ctx = max(args.sizes) * (args.prompt_tokens[1] + args.tokens + 1)
    model = Model(args.model, n_ctx=n_ctx, n_threads=args.threads)
    model.step_window = args.step_window
    if args.preset in ("file", "backbone"):  # backbone: every row the reference's (a check of the plumbing)
        # "file": the file's own τ with a dynamic exit, whatever its default preset's mode.
        options = model.options(mode="river") if args.preset == "file" else model.options(mode="backbone")
    else:
        options = model.options(args.preset)
    backbone = model.options(mode="backbone")
    prompts = evaluation_prompts(model, prompt_lengths(args.items, *args.prompt_tokens))
    t0 = time.perf_counter()
    streams = [greedy_sequences(model, [p], args.tokens, stop_at_eog=False, mode="backbone")[0].tokens
               for p in prompts]
    if any(len(s) != args.tokens for s in streams):  # only the context could cut one short
        raise SystemExit("a backbone continuation ended early: raise n_ctx")
    shape = (len(prompts), args.tokens, model.n_vocab)
    with tempfile.TemporaryDirectory() as folder:
        # The rows of one run over every prompt: [items, tokens, n_vocab] float32, on disk.
        reference = np.lib.format.open_memmap(os.path.join(folder, "ref.npy"), "w+", np.float32, shape)
        rows = np.lib.format.open_memmap(os.path.join(folder, "rows.npy"), "w+", np.float32, shape)
        exits = np.zeros(shape[:2], dtype=np.int32)
        forced_rows(model, backbone, prompts, streams, 1, reference, exits)
        table = []
        for n in args.sizes:
            counts = forced_rows(model, options, prompts, streams, n, rows, exits)
            table.append(summary_row(n, rows, reference, streams, exits, counts))
        del reference, rows
    result = {"model": os.path.abspath(args.model), "preset": args.preset, "options": str(options),
              "n_layer": model.n_layer, "items": len(prompts), "prompt_tokens": args.prompt_tokens,
              "tokens": args.tokens, "threads": args.threads, "step_window": args.step_window,
              "seconds": time.perf_counter() - t0, "rows": table}
    text = json.dumps(result, indent=2, default=float)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(f"\n{os.path.basename(args.model)}, preset {args.preset}, {len(prompts)} prompts x {args.tokens - 1} "
          f"scored tokens, KLD and same-top against the backbone's rows (bootstrap 95% over prompts)\n")
    print("| N | mean exit layer | steps per batch | KLD [95% CI] | same top % [95% CI] |\n|---|---|---|---|---|")
    for r in table:
        print(f"| {r['n']} | {r['mean_exit_layer']:.2f} | {r['steps_per_batch']:.2f} | {r['kld']:.5f} "
              f"[{r['kld_ci'][0]:.5f}, {r['kld_ci'][1]:.5f}] | {100 * r['same_top']:.1f} "
              f"[{100 * r['same_top_ci'][0]:.1f}, {100 * r['same_top_ci'][1]:.1f}] |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
