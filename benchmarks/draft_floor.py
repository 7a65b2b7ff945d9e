"""Lossless mode's draft step against its bandwidth floor: the bytes a river draft step reads over
the machine's measured read bandwidth, against the step's measured time; the backbone step the
same; and the verify batches in backbone steps.

    .venv/bin/python benchmarks/draft_floor.py --shapes qwen2.5-1.5b,llama-3.1-8b [--make-river-gguf] [--json OUT.json]
    .venv/bin/python benchmarks/draft_floor.py /tmp/bench/q05b.river.gguf [MORE.river.gguf ...] [--json OUT.json]
        [-t 2] [--rounds 3] [--steps 8] [--max-batch 9] [--draft-vocab N] [--bandwidth-mib N] [--no-breakdown]

--shapes times a random-weight F16 model of each shape with a Q4_0 river (benchmarks/random_models.py,
made once into RIVER_GGUF_CACHE): a step's cost does not depend on the weights. Its River GGUF
where the cache holds one (--make-river-gguf makes it), else the F16 with llama.cpp's static Q4_0
of it loaded as a separate river: the same tensors at a fifth of the disk for Llama 3.1 8B.
Positional arguments are River GGUFs, or BACKBONE,RIVER pairs of plain GGUFs, timed as they are.
Run it alone on the machine.

1. Read bandwidth: --threads Python threads (the engine's thread count) each reduce their share of
   one float32 buffer at least 8x the last-level cache and >= 1 GiB (np.maximum.reduce and
   np.add.reduce: numpy releases the GIL inside a reduction), all started at once by a barrier;
   the bandwidth is the buffer's bytes over the span from the first start to the last end, the
   best over methods and repetitions (a reduction can only read slower than the memory allows,
   so the fastest is the closest to it). The same with one thread is printed beside it, and the
   reductions' rate over 1 MiB that stays in cache (far higher: the big buffer's rate is the
   memory's, not the reduction's).
2. Bytes of a step, from the file's tensor table (calibrate.cost_model.weight_bytes): a draft
   step reads the river layers the draft setting runs (river-only: every layer below the
   setting's backbone tail; the backbone's attention tensors where river_attention says so), its
   head (the river's with river_head: the draft vocabulary's rows where the Model has one, which
   the engine keeps as draft_vocab tokens + 512 context rows, all multiplied; else the whole
   head), the output norm, the other tensors outside the layers (rope factors), one row of the
   embedding table, and the F16 KV cache rows its attention reads at the timed positions (with
   flash attention, the rows in use: ggml's one-token kernel skips masked rows; without it,
   the padded length); a backbone step the backbone's layers and head over the whole vocabulary.
   floor = bytes / bandwidth; ratio = measured time / floor.
3. Times: calibrate.lossless.measure_costs (a backbone step, a draft step through the engine's
   own draft, verify batches of 2..--max-batch, each the median of --rounds rounds after the same
   CONTEXT-position prompt).
5. With a BACKBONE,RIVER pair (every --shapes file without a River GGUF), llama.cpp's own decode
   step on the RIVER file alone (a plain static quant: llama_decode timed alone, flash attention
   on, the same thread count and context), against its floor: every tensor but the embedding
   table (one row of it; the whole table where the head is tied to it) and the same KV cache
   rows. What ggml's kernels make of those types on this machine, beside the draft step.
4. The draft step broken down (--no-breakdown leaves it out), measured: the same draft timed
   with the head over the whole vocabulary, with the Model's draft vocabulary, and with a draft
   vocabulary of one token (its 512 context rows still multiplied), each Model loaded alone (two
   more loads of the file) and timed as measure_costs times its draft; a least-squares line
   time = layers + rows * per_row through them splits the step into its layers (the line at 0
   rows) and its head, each against its own floor. (The engine's observer, which could time each
   node, is not reachable from Python, and it would turn off the kept graphs a draft runs.)

Prints a markdown table (model, river type, draft MiB, floor ms, draft ms, ratio; the backbone the
same; V(2), V(5), V(9) in backbone steps), each step's bytes by part, a note where a step's
bytes fit the last-level cache (steps timed back to back may then beat the memory's floor), and
the breakdown; --json writes every number.
"""
import argparse
import gc
import json
import os
import statistics
import sys
import threading
import time

import numpy as np

try:  # an installed river_gguf (the checkout's python/ has no native module)
    import river_gguf  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/random_models.py
from river_gguf import Model  # noqa: E402
from river_gguf.calibrate import cost_model  # noqa: E402
from river_gguf.calibrate import lossless as lossless_cost  # noqa: E402
from river_gguf.default_model import cache_dir  # noqa: E402
from river_gguf.gguf.copy import RIVER_PREFIX, plain_tensors, river_tensors_by_name  # noqa: E402
from river_gguf.gguf.reader import GGUFReader  # noqa: E402
from river_gguf.gguf.river_index import read_field  # noqa: E402
from river_gguf.measure.llama_decode import LlamaDecoder  # noqa: E402

MIB = 1 << 20
GIB = 1 << 30
#: The draft head's rows after the draft vocabulary's (native draft_vocab.h kDraftContextRows):
#: the end-of-generation tokens pinned and the context's tokens; all are multiplied every step.
DRAFT_CONTEXT_ROWS = 512
#: Where Model's draft_vocab option is None (auto): this many tokens for a vocabulary at least
#: twice as large, else none (native draft_vocab.h kAutoDraftVocab). head_rows checks the
#: Model's draft vocabulary against it, so a change there fails here instead of miscounting.
AUTO_DRAFT_VOCAB = 32768
KV_BYTES = 2  # the engine's KV cache is F16
N_CTX = 512
#: The tau given to a backbone loaded with a separate river (benchmarks/random_models.py's).
SEPARATE_RIVER_TAU = 0.97
#: The verify batches the table shows, in backbone steps.
SHOWN_VERIFY = (2, 5, 9)


# ----- the machine's read bandwidth ------------------------------------------------------
def last_level_cache() -> int:
    """Bytes of the largest CPU cache sysfs lists for cpu0 (0 where it lists none)."""
    best = 0
    root = "/sys/devices/system/cpu/cpu0/cache"
    for entry in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        try:
            with open(os.path.join(root, entry, "size")) as f:
                text = f.read().strip()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": MIB, "G": GIB}
        best = max(best, int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
    return best


def _threaded_read(parts, reduce) -> float:
    """Seconds from the first thread's start to the last one's end, each thread reducing its part."""
    spans = [None] * len(parts)
    barrier = threading.Barrier(len(parts))

    def work(i):
        barrier.wait()
        t0 = time.perf_counter()
        reduce(parts[i])
        spans[i] = (t0, time.perf_counter())

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(parts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return max(e for _, e in spans) - min(s for s, _ in spans)


def _label(method: str, threads: int) -> str:
    return f"{method}, {threads} thread" + ("s" if threads > 1 else "")


def read_bandwidth(threads: int, n_bytes: int, reps: int = 8) -> dict:
    """The machine's read bandwidth in bytes/s with `threads` threads (and with one), measured
    as the module docstring says, over a float32 buffer of n_bytes."""
    if threads < 1 or n_bytes < 4 * threads:
        raise ValueError(f"need at least one thread and 4 bytes a thread, got {threads} threads, {n_bytes} bytes")
    buf = np.ones(n_bytes // 4, dtype=np.float32)  # written once, so every page is in memory before timing
    methods = {"np.maximum.reduce": np.maximum.reduce, "np.add.reduce": np.add.reduce}
    per_method = {}
    for n in sorted({threads, 1}, reverse=True):
        parts = np.array_split(buf, n)
        for name, fn in methods.items():
            per_method[_label(name, n)] = buf.nbytes / min(_threaded_read(parts, fn) for _ in range(reps))
    # The reductions' own speed, on a buffer that stays in the L2 cache: far above the rate over
    # the big buffer, it shows that rate is the memory's and not the reduction's.
    small = np.ones(1 << 18, dtype=np.float32)
    in_cache = max(small.nbytes * 64 / min(_timed_repeat(fn, small, 64) for _ in range(reps))
                   for fn in methods.values())
    how = (f"{threads} Python threads, each np.maximum.reduce or np.add.reduce over its share of one "
           f"{buf.nbytes / GIB:.2f} GiB float32 buffer (numpy releases the GIL), started by a barrier; the "
           f"buffer's bytes over first start to last end, best of {reps} repetitions and both reductions")
    return {"bytes_per_s": max(per_method[_label(m, threads)] for m in methods),
            "one_thread_bytes_per_s": max(per_method[_label(m, 1)] for m in methods),
            "in_cache_one_thread_bytes_per_s": in_cache, "threads": threads, "buffer_bytes": int(buf.nbytes),
            "repetitions": reps, "per_method": per_method, "how": how}


def _timed_repeat(fn, a, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn(a)
    return time.perf_counter() - t0


# ----- the bytes a step reads ----------------------------------------------------------
def split_files(spec: str) -> tuple:
    """(backbone, river) of a file argument: a River GGUF ("PATH", river None) or a backbone GGUF
    and a plain GGUF of the same model loaded as its river ("BACKBONE,RIVER": Model's river)."""
    parts = spec.split(",")
    if len(parts) > 2 or not all(parts):
        raise ValueError(f"a file argument is PATH or BACKBONE,RIVER, got {spec!r}")
    return parts[0], parts[1] if len(parts) == 2 else None


def _entry(t) -> dict:
    return {"bytes": int(t.n_bytes), "rows": int(t.shape[1]) if len(t.shape) > 1 else 1,
            "type": t.tensor_type.name}


def tensor_table(spec: str) -> dict:
    """The files' tensors by name: the backbone's and the river's (plain names: river. stripped),
    each {"bytes", "rows", "type"}; and the river's type (a River GGUF's river.type, else the type
    of most of its layers' bytes)."""
    backbone, river_path = split_files(spec)
    reader = GGUFReader(backbone)
    if river_path is None:
        river = {n: _entry(t) for n, t in river_tensors_by_name(reader, RIVER_PREFIX).items()}
        if not river:
            raise ValueError(f"{backbone} is not a River GGUF (it holds no river tensors)")
        river_type = read_field(reader, "river.type")
    else:
        river = {t.name: _entry(t) for t in plain_tensors(GGUFReader(river_path))}
        river_type = None
    if river_type is None:
        by_type = {}
        for n, t in river.items():
            if n.startswith("blk."):
                by_type[t["type"]] = by_type.get(t["type"], 0) + t["bytes"]
        river_type = max(by_type, key=by_type.get).lower()
    return {"backbone": {t.name: _entry(t) for t in plain_tensors(reader)}, "river": river,
            "river_type": str(river_type)}


def head_rows(model, asked) -> int:
    """Rows of the river head a draft step multiplies on `model` (loaded with draft_vocab=asked):
    the draft vocabulary's tokens and DRAFT_CONTEXT_ROWS, or the whole vocabulary where it has
    none. Raises RuntimeError where the Model's draft vocabulary disagrees with that rule."""
    n_vocab = model.n_vocab
    size = (AUTO_DRAFT_VOCAB if n_vocab >= 2 * AUTO_DRAFT_VOCAB else 0) if asked is None else int(asked)
    restricted = 0 < size < n_vocab
    vocab = model.draft_vocab  # the draft vocabulary's tokens and the pinned end-of-generation ones
    pinned = sum(1 for t in vocab if model.is_eog(t))
    if bool(vocab) != restricted or (restricted and not size <= len(vocab) <= size + pinned):
        raise RuntimeError(f"{model.model_path}: the draft vocabulary holds {len(vocab)} tokens, where "
                           f"draft_vocab={asked!r} should give {size if restricted else 'none'}; "
                           "benchmarks/draft_floor.py's rule is out of date")
    return size + DRAFT_CONTEXT_ROWS if restricted else n_vocab


def kv_rows(context: int, steps: int, flash_attn: bool, n_ctx: int) -> float:
    """Mean KV cache rows a layer's attention reads over the timed steps: step i (0-based) after
    `context` positions attends context + i + 1 rows; without flash attention, the engine's padded
    length (a multiple of 256, at least 256, at most n_ctx) enters the product whole."""
    rows = [context + i + 1 for i in range(steps)]
    if not flash_attn:
        rows = [min(n_ctx, max(256, (r + 255) // 256 * 256)) for r in rows]
    return sum(rows) / len(rows)


def step_bytes(table: dict, layers, heads, n_layer: int, draft, kv_row_bytes: int, kv_read_rows: float,
               rows=None) -> dict:
    """The bytes one step reads, by part. draft: None for a backbone step, else the draft's
    ExitOptions (river-only: its tail, river_head and river_attention decide which side each layer
    and the head come from); rows: the river head's rows it multiplies (None: all of them).
    layers/heads: calibrate.cost_model.weight_bytes of the file."""
    bb = table["backbone"]
    if draft is None:
        layer_part = cost_model.step_bytes(layers, {"backbone": 0, "river": 0}, n_layer, n_layer - 1, 0, False)
        side, river_head = "backbone", False
    else:
        layer_part = cost_model.step_bytes(layers, {"backbone": 0, "river": 0}, n_layer, -1, draft.tail,
                                           draft.river_head, draft.river_attention)
        side, river_head = ("river", True) if draft.river_head else ("backbone", False)
    tensors = table[side]
    head_name = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    head = heads[side]
    if river_head and rows is not None:
        head = head * rows // tensors[head_name]["rows"]
    # The embedding: the river's table where the draft runs the river's head (the engine's
    # river_embd), else the backbone's; one row of it.
    embd = tensors["token_embd.weight"]
    others = sum(t["bytes"] for n, t in bb.items()
                 if not n.startswith("blk.") and n not in ("token_embd.weight", "output.weight", "output_norm.weight"))
    parts = {"layers": int(layer_part), "head": int(head), "output_norm": bb["output_norm.weight"]["bytes"],
             "other_globals": others, "embedding_row": embd["bytes"] // embd["rows"],
             "kv_cache": int(round(kv_read_rows * kv_row_bytes * n_layer))}
    parts["total"] = sum(parts.values())
    return parts


def kv_row_bytes(table: dict, model) -> int:
    """Bytes of one position's K and V in one layer of the F16 cache (the K/V projections' widths,
    or n_head_kv x head_dim each where the file joins them)."""
    bb = table["backbone"]
    if "blk.0.attn_k.weight" in bb and "blk.0.attn_v.weight" in bb:
        return KV_BYTES * (bb["blk.0.attn_k.weight"]["rows"] + bb["blk.0.attn_v.weight"]["rows"])
    hp = model.hparams
    return KV_BYTES * 2 * hp["n_head_kv"] * hp["head_dim"]


# ----- timing ----------------------------------------------------------------------------
def draft_seconds(model, options, rounds: int, steps: int, context: int) -> float:
    """Seconds of one draft step timed as measure_costs times it (a draft of `steps` tokens after
    the same prompt of `context` positions, per token, the median of `rounds`), after one untimed
    draft that builds the graph."""
    text = model.tokenize(lossless_cost.PROMPT)
    prompt = (text * (context // len(text) + 1))[:max(context, len(text))]
    timing = options.with_overrides(draft_max=steps, draft_p_min=0.0)
    per_token = []
    with model.session(timing) as session:
        session.prefill(prompt)
        base = session.n_past
        session.draft(prompt[0])
        for _ in range(rounds):
            session.truncate(base)
            t0 = time.perf_counter()
            drafted = len(session.draft(prompt[0]))
            per_token.append((time.perf_counter() - t0) / max(drafted, 1))
        session.truncate(0)
    return statistics.median(per_token)


def open_model(spec: str, args, draft_vocab) -> Model:
    backbone, river = split_files(spec)
    # A plain backbone stores no tau, and a load would profile one; river-only drafts and
    # backbone steps never read it, so any will do.
    kw = {} if river is None else {"river": river, "threshold": SEPARATE_RIVER_TAU}
    return Model(backbone, n_ctx=N_CTX, n_threads=args.threads, draft_vocab=draft_vocab, **kw)


def draft_options(model):
    """The lossless options whose drafts are timed: the file's own (lossless mode's, as a call with
    mode="lossless" gets them), river-only drafting. A plain backbone stores no setting: its
    separate river drafts with the river's own head, as the converter's River GGUFs store it
    (river.head)."""
    separate = {"river_head": True} if model.river_path else {}
    return model.options(mode="lossless", draft_mode="river-only", **separate)


def measure_file(path: str, args, bandwidth: float) -> dict:
    """One River GGUF: its steps' bytes, floors and measured times, the verify batches, and the
    draft's breakdown (args.breakdown)."""
    table = tensor_table(path)
    model = open_model(path, args, args.draft_vocab)
    try:
        opts = draft_options(model)
        costs = lossless_cost.measure_costs(model, opts, args.max_batch, rounds=args.rounds, steps=args.steps)
        layers, heads = cost_model.weight_bytes(model)
        kv = kv_rows(costs.context, args.steps, model.flash_attn, model.n_ctx)
        own = _variant(table, model, opts, kv, bandwidth)
        draft = own["bytes"]
        backbone = step_bytes(table, layers, heads, model.n_layer, None, kv_row_bytes(table, model), kv)
        out = {"path": path, "model": " + ".join(os.path.basename(p) for p in split_files(path) if p),
               "river_type": table["river_type"],
               "n_layer": model.n_layer, "n_vocab": model.n_vocab, "flash_attn": model.flash_attn,
               "draft_options": {k: getattr(opts, k) for k in ("tail", "river_head", "river_attention", "draft_mode")},
               "draft_head_rows": own["head_rows"], "kv_rows_read": kv, "costs": costs.as_dict(),
               "draft": _against_floor(draft, costs.draft, bandwidth),
               "backbone": _against_floor(backbone, costs.step, bandwidth),
               "verify_in_steps": {str(n): v / costs.step for n, v in costs.verify.items()}}
        if args.breakdown:
            own.update(label=("the Model's: whole vocabulary" if own["head_rows"] == model.n_vocab
                              else "the Model's draft vocabulary"), draft_vocab=args.draft_vocab,
                       seconds=draft_seconds(model, opts, args.rounds, args.steps, costs.context))
    finally:
        del model
        gc.collect()
    if args.breakdown:
        out["breakdown"] = breakdown(path, args, table, costs.context, own, bandwidth)
    river_path = split_files(path)[1]
    if river_path is not None:
        out["llama_river"] = llama_step(river_path, args.threads, costs.context, args.rounds, args.steps,
                                        draft["kv_cache"], bandwidth)
    return out


def llama_step(path: str, threads: int, context: int, rounds: int, steps: int, kv_bytes: float,
               bandwidth: float) -> dict:
    """llama.cpp's decode step on a plain GGUF (the median over rounds of the median step of each
    round, after the same `context` positions), against its floor: the file's tensors, one row of
    the embedding table unless the head is that table, and kv_bytes of KV cache."""
    tensors = {t.name: _entry(t) for t in plain_tensors(GGUFReader(path))}
    embd = tensors["token_embd.weight"]
    weights = sum(t["bytes"] for t in tensors.values())
    if "output.weight" in tensors:
        weights -= embd["bytes"] - embd["bytes"] // embd["rows"]
    parts = {"weights": weights, "kv_cache": kv_bytes, "total": weights + kv_bytes}
    dec = LlamaDecoder(path, N_CTX, threads)
    try:
        tokens = [int(t) for t in np.random.default_rng(0).integers(1, 1000, context + steps)]
        medians = []
        for _ in range(rounds):
            dec.reset()
            dec.decode(tokens[:context])
            medians.append(statistics.median(dec.decode([t]) for t in tokens[context:]))
    finally:
        dec.close()
    return dict(_against_floor(parts, statistics.median(medians), bandwidth), path=path)


def _against_floor(parts: dict, seconds: float, bandwidth: float) -> dict:
    floor = parts["total"] / bandwidth
    return {"bytes": parts, "floor_s": floor, "seconds": seconds, "ratio": seconds / floor}


def _variant(table: dict, model, opts, kv: float, bandwidth: float) -> dict:
    """The draft step's bytes and floor on `model` (its own draft vocabulary) with options opts."""
    layers, heads = cost_model.weight_bytes(model)
    rows = head_rows(model, model.river_options.draft_vocab) if opts.river_head else model.n_vocab
    parts = step_bytes(table, layers, heads, model.n_layer, opts, kv_row_bytes(table, model), kv, rows)
    return {"head_rows": rows, "bytes": parts, "floor_s": parts["total"] / bandwidth}


def breakdown(path: str, args, table: dict, context: int, own: dict, bandwidth: float) -> dict:
    """The draft timed with the head over the whole vocabulary and over one draft token (its
    context rows still multiplied), beside the Model's own (`own`), and the line through them.
    A draft on the backbone's head (river_head off) has no draft rows: nothing to vary."""
    variants = [own]
    for label, vocab in (("whole vocabulary", 0), ("one draft token", 1)):
        model = open_model(path, args, vocab)
        try:
            opts = draft_options(model)
            if not opts.river_head:
                break
            v = _variant(table, model, opts, kv_rows(context, args.steps, model.flash_attn, model.n_ctx), bandwidth)
            if all(w["head_rows"] != v["head_rows"] for w in variants):
                v.update(label=label, draft_vocab=vocab,
                         seconds=draft_seconds(model, opts, args.rounds, args.steps, context))
                variants.append(v)
        finally:
            del model
            gc.collect()
    for v in variants:
        v["ratio"] = v["seconds"] / v["floor_s"]
    out = {"variants": variants}
    if len(variants) >= 2:
        x = np.array([v["head_rows"] for v in variants], dtype=np.float64)
        y = np.array([v["seconds"] for v in variants])
        per_row, layers_s = np.polyfit(x, y, 1)
        ref = variants[0]["bytes"]
        out["line"] = {"layers_s": float(layers_s), "per_row_s": float(per_row),
                       "layers_floor_s": (ref["total"] - ref["head"]) / bandwidth,
                       "per_row_floor_s": ref["head"] / variants[0]["head_rows"] / bandwidth,
                       "residuals_s": [float(r) for r in y - (layers_s + per_row * x)]}
    return out


# ----- output ----------------------------------------------------------------------------
def print_tables(bw: dict, records: list) -> None:
    print(f"\nread bandwidth: {bw['bytes_per_s'] / 1e9:.2f} GB/s ({bw['how']}); one thread "
          f"{bw['one_thread_bytes_per_s'] / 1e9:.2f} GB/s (the same reductions over 1 MiB in cache: "
          f"{bw['in_cache_one_thread_bytes_per_s'] / 1e9:.2f} GB/s); last-level cache {bw['llc_bytes'] / MIB:.0f} MiB")
    for k, v in bw["per_method"].items():
        print(f"  {k}: {v / 1e9:.2f} GB/s")
    shown = [n for n in SHOWN_VERIFY if any(str(n) in r["verify_in_steps"] for r in records)]
    print("\n| model | river type | draft MiB | floor ms | draft ms | ratio | backbone MiB | floor ms | backbone ms "
          "| ratio | " + " | ".join(f"V({n})" for n in shown) + " |")
    print("|---|---|" + "---:|" * (8 + len(shown)))
    for r in records:
        d, b = r["draft"], r["backbone"]
        v = " | ".join(f"{r['verify_in_steps'][str(n)]:.2f}" if str(n) in r["verify_in_steps"] else "-" for n in shown)
        print(f"| {r['model']} | {r['river_type']} | {d['bytes']['total'] / MIB:.1f} | {1e3 * d['floor_s']:.2f} | "
              f"{1e3 * d['seconds']:.2f} | {d['ratio']:.2f} | {b['bytes']['total'] / MIB:.1f} | "
              f"{1e3 * b['floor_s']:.2f} | {1e3 * b['seconds']:.2f} | {b['ratio']:.2f} | {v} |")
    print("\n| model | step | layers MiB | head MiB | head rows | KV cache MiB | KV rows a layer | rest MiB |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in records:
        for step, rows in (("draft", r["draft_head_rows"]), ("backbone", r["n_vocab"])):
            p = r[step]["bytes"]
            rest = p["output_norm"] + p["other_globals"] + p["embedding_row"]
            print(f"| {r['model']} | {step} | {p['layers'] / MIB:.1f} | {p['head'] / MIB:.1f} | {rows} | "
                  f"{p['kv_cache'] / MIB:.2f} | {r['kv_rows_read']:.1f} | {rest / MIB:.3f} |")
    for r in records:
        for step in ("draft", "backbone"):
            if r[step]["bytes"]["total"] < bw["llc_bytes"]:
                print(f"\n{r['model']}: the {step} step's bytes fit the last-level cache ({bw['llc_bytes'] / MIB:.0f} "
                      "MiB, shared on a virtual machine): steps timed back to back may read them from it, below "
                      "the memory's floor")
    anchored = [r for r in records if "llama_river" in r]
    if anchored:
        print("\nllama.cpp decoding each river file alone (a plain static quant), beside the draft step:\n")
        print("| river file | MiB | floor ms | llama.cpp step ms | ratio | draft step ratio |")
        print("|---|---:|---:|---:|---:|---:|")
        for r in anchored:
            a = r["llama_river"]
            print(f"| {os.path.basename(a['path'])} | {a['bytes']['total'] / MIB:.1f} | {1e3 * a['floor_s']:.2f} | "
                  f"{1e3 * a['seconds']:.2f} | {a['ratio']:.2f} | {r['draft']['ratio']:.2f} |")
    for r in records:
        if "breakdown" in r:
            print_breakdown(r)


def print_breakdown(r: dict) -> None:
    b = r["breakdown"]
    print(f"\n{r['model']}: the draft step with each head (each Model loaded alone)\n")
    print("| draft head | head rows | MiB | floor ms | draft ms | ratio |")
    print("|---|---:|---:|---:|---:|---:|")
    for v in sorted(b["variants"], key=lambda v: v["head_rows"]):
        print(f"| {v['label']} | {v['head_rows']} | {v['bytes']['total'] / MIB:.1f} | {1e3 * v['floor_s']:.2f} | "
              f"{1e3 * v['seconds']:.2f} | {v['ratio']:.2f} |")
    line = b.get("line")
    if line:
        print(f"\nleast-squares line through them: the layers (0 head rows, KV cache and norms included) "
              f"{1e3 * line['layers_s']:.2f} ms against a floor of {1e3 * line['layers_floor_s']:.2f} ms "
              f"({line['layers_s'] / line['layers_floor_s']:.2f}x); the head {1e6 * line['per_row_s'] * 1e3:.2f} us "
              f"per 1000 rows against {1e6 * line['per_row_floor_s'] * 1e3:.2f} us "
              f"({line['per_row_s'] / line['per_row_floor_s']:.2f}x); residuals "
              + ", ".join(f"{1e3 * x:+.2f}" for x in line["residuals_s"]) + " ms")


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", help="River GGUFs (or BACKBONE,RIVER pairs of plain GGUFs) to time as they are")
    ap.add_argument("--shapes", default="", help="comma-separated random_model.RANDOM_SHAPES to time (F16 + Q4_0 "
                                                 "river, benchmarks/random_models.py)")
    ap.add_argument("--make-river-gguf", action="store_true",
                    help="with --shapes: make a River GGUF where the cache has none (default: the F16 and its static "
                         "Q4_0 as a separate river)")
    ap.add_argument("-t", "--threads", type=int, default=2, help="the engine's threads, and the bandwidth's")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8, help="steps (and drafts) a round, as measure_costs takes it")
    ap.add_argument("--max-batch", type=int, default=9, help="verify batches of 2..N tokens")
    ap.add_argument("--draft-vocab", type=int, default=None,
                    help="the Model's draft_vocab option (default: its own; 0: the whole vocabulary)")
    ap.add_argument("--bandwidth-mib", type=int, default=None,
                    help="the bandwidth buffer (default: 8x the last-level cache, at least 1024 MiB)")
    ap.add_argument("--no-breakdown", dest="breakdown", action="store_false",
                    help="leave out the draft timed with other heads")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if not a.files and not a.shapes:
        ap.error("give River GGUF paths or --shapes")
    if a.threads < 1 or a.rounds < 1 or a.steps < 1 or a.max_batch < 2:
        ap.error("--threads, --rounds and --steps must be >= 1, --max-batch >= 2")
    for spec in a.files:
        try:
            missing = [p for p in split_files(spec) if p and not os.path.exists(p)]
        except ValueError as e:
            ap.error(str(e))
        if missing:
            ap.error(f"{', '.join(missing)} does not exist")
    return a


def shape_files(shape: str, make_river_gguf: bool, threads: int) -> str:
    """The file argument of a random-weight shape: its River GGUF where the cache holds one (or
    make_river_gguf), else its F16 with llama.cpp's static Q4_0 of it as a separate river (made
    once): the quantizer, type and tensors the River GGUF's river holds, without a second copy of
    the F16 (Llama 3.1 8B's River GGUF is 20.7 GB, its Q4_0 4.6 GB)."""
    from random_models import make
    river = os.path.join(cache_dir(), f"random-{shape}.f16+q4_0.river.gguf")
    if make_river_gguf or os.path.exists(river):
        return make(shape, [], "q4_0", str(cache_dir()), threads)["river"]
    files = make(shape, ["q4_0"], "", str(cache_dir()), threads)
    return f"{files['f16']},{files['q4_0']}"


def main(argv=None) -> int:
    args = parse_args(argv)
    paths = list(args.files)
    for shape in filter(None, args.shapes.split(",")):
        paths.append(shape_files(shape, args.make_river_gguf, args.threads))
    llc = last_level_cache()
    size = args.bandwidth_mib * MIB if args.bandwidth_mib else max(GIB, 8 * llc)
    bw = read_bandwidth(args.threads, size)
    bw["llc_bytes"] = llc
    gc.collect()
    records = []
    for p in paths:
        records.append(measure_file(p, args, bw["bytes_per_s"]))
        print(f"{p}: draft {1e3 * records[-1]['draft']['seconds']:.2f} ms, {records[-1]['draft']['ratio']:.2f}x "
              "its floor", file=sys.stderr)
    print_tables(bw, records)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "bandwidth": bw, "rounds": args.rounds, "steps": args.steps,
                       "context": lossless_cost.CONTEXT, "n_ctx": N_CTX, "files": records}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
