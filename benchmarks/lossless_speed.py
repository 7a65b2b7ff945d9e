"""Lossless mode's decode speed against the backbone alone, llama.cpp decoding the backbone file,
and llama.cpp's own speculative decoding of the same pair of weights, in one run.

    .venv/bin/python benchmarks/lossless_speed.py [--model qwen2.5-coder-0.5b] [--backbone f16]
        [--prompts 4] [--tokens 128] [--rounds 3] [--draft-max 3,5] [--draft-p-min 0]
        [--exit-tau 0.95] [--sampled] [--json OUT.json]

Files (derived once into RIVER_GGUF_CACHE; model_zoo): the backbone, the model's F16 or Q8_0; the
River GGUF, that backbone with a Q4_0 river quantized from the F16 with the model's importance
matrix (`river-gguf convert --backbone-type B --river-type q4_0 --imatrix FILE --no-presets`); and
llama.cpp's draft, the static Q4_0 of the same F16 with the same importance matrix (q4_0-imatrix):
the same weights the river holds, in a file of their own.

Rows, each generating --tokens tokens after each prompt (the first --prompts evaluation items:
HumanEval for a code model, GSM8K otherwise), end of generation ignored:
  - lossless, river-only drafts, for each --draft-max; lossless with River-exit drafts (tau);
  - the backbone alone (mode="backbone"), the same river_gguf.Llama;
  - llama.cpp decoding the backbone file: llama_decode timed alone, greedy (its speed does not
    depend on the sampler);
  - llama-speculative (built by scripts/build_llama_tools.sh) with the backbone file as target and
    the static Q4_0 as draft, --spec-draft-n-max K, flash attention on, its own "decoded ... t/s".
river_gguf's rows are timed as llama-speculative times itself: wall time from the first sampled
token to the last, sampling included ("wall"); "engine" counts only the engine's draft, verify
and step calls. Rows are interleaved within each round (order reversed every other round); the
table gives the median over rounds of the mean over prompts, and each row's ratio to the backbone
and to llama-speculative is the geometric mean of the per-round ratios.

--sampled samples at temperature 0.8, top-k 40, top-p 0.9, repeat penalty 1.1 with a fixed seed
(llama-speculative then accepts drafts by its stochastic rule). --costs also times the engine's
step, draft step and verify batches (calibrate.lossless.measure_costs) and prints the speedup
they predict at the acceptance measured in the run. Run it alone on the machine.

    .venv/bin/python benchmarks/lossless_speed.py --shape llama-3.2-1b --acceptance 0.87,0.92

times only those costs, on a random-weight F16 model of that shape (benchmarks/random_models.py,
written once into the cache) with a Q4_0 river (--ngl -1: on the GPU), and prints the speedup they predict at each acceptance (the
ones measured on the real models): the cost of a step does not depend on the weights.
"""
import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time

try:  # an installed river_gguf (the checkout's python/ has no native module)
    import river_gguf  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/random_models.py
from river_gguf.calibrate import lossless as lossless_cost  # noqa: E402
from river_gguf.default_model import cache_dir  # noqa: E402
from river_gguf.measure import data as eval_data  # noqa: E402
from river_gguf.eval import model_zoo  # noqa: E402
from river_gguf.measure.llama_decode import LlamaDecoder  # noqa: E402
from river_gguf.llama import Llama  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
SPECULATIVE = os.path.join(ROOT, ".cache", "llama-tools", "build", "bin", "llama-speculative")
N_CTX = 1024
SAMPLING = dict(temp=0.8, top_k=40, top_p=0.9, repeat_penalty=1.1)
GREEDY = dict(temp=0.0)
SEED = 1234


def river_file(model: str, backbone: str, threads: int) -> str:
    """The River GGUF: `backbone` with a Q4_0 river of the F16, quantized with the model's imatrix."""
    from river_gguf.convert.build import build_river_gguf

    dst = cache_dir() / f"{model}.{backbone}+q4_0-imatrix.lossless.river.gguf"
    if not dst.is_file():
        imatrix = model_zoo.imatrix_path(model)
        build_river_gguf(model_zoo.derived(model, "f16"), dst, river_type="q4_0", backbone_type=backbone,
                         imatrix=imatrix, presets=False, progress=True, n_threads=threads)
    return str(dst)


def prompts(model: str, n: int):
    domain = "humaneval" if "coder" in model else "gsm8k"
    items = eval_data.load_domain(domain)
    return [it.prompt for it in eval_data.select(items, "evaluation", n)]


def river_row(llm, prompt: str, tokens: int, sampling: dict, **opts) -> dict:
    """Generate `tokens` tokens (end of generation ignored); time from the first to the last."""
    toks = llm.tokenize(prompt.encode(), add_bos=True, special=True)
    llm.set_seed(SEED)
    gen = llm.generate(toks, reset=True, **sampling, **opts)
    out, t_first = [], None
    for t in gen:
        now = time.perf_counter()
        t_first = now if t_first is None else t_first
        out.append(t)
        if len(out) >= tokens:
            break
    t_last = time.perf_counter()
    gen.close()
    s = llm.last_stats
    row = {"tok_s": (len(out) - 1) / (t_last - t_first), "engine_tok_s": s["decode_tok_s"], "tokens": out}
    if s.get("mode") == "lossless":
        row.update(acceptance=s["acceptance_rate"], mean_accepted=s["mean_accepted"], drafted=s["drafted"])
        # Per round: the engine's draft and verify calls, and the rest of the wall time (sampling,
        # Python, the binding), over the rounds after the first token.
        n = max(s["rounds"], 1)
        row.update(rounds=s["rounds"], draft_ms=1000 * s["draft_s"] / n, verify_ms=1000 * s["verify_s"] / n,
                   round_ms=1000 * (t_last - t_first) / n, drafts_per_round=s["drafted"] / n)
    return row


def llama_cpp_row(dec, llm, prompt: str, tokens: int) -> dict:
    toks = llm.tokenize(prompt.encode(), add_bos=True, special=True)
    out, steps, secs = dec.greedy(toks, tokens, stop_at_eog=False)
    return {"tok_s": steps / secs}


def speculative_row(target: str, draft: str, prompt: str, tokens: int, k: int, p_min: float, threads: int,
                    sampled: bool) -> dict:
    samp = (["--temp", str(SAMPLING["temp"]), "--top-k", str(SAMPLING["top_k"]), "--top-p", str(SAMPLING["top_p"]),
             "--repeat-penalty", str(SAMPLING["repeat_penalty"])] if sampled else ["--temp", "0"])
    cmd = [SPECULATIVE, "-m", target, "-md", draft, "-p", prompt, "-n", str(tokens), "-c", str(N_CTX),
           "-t", str(threads), "-tb", str(threads), "-td", str(threads), "-tbd", str(threads),
           "--spec-draft-n-max", str(k), "--spec-draft-n-min", "0", "--spec-draft-p-min", str(p_min),
           "-fa", "on", "-s", str(SEED), "--ignore-eos", "-ngl", "0"] + samp
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    log = res.stdout + res.stderr
    m = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s", log)
    if res.returncode != 0 or not m:
        raise RuntimeError(f"llama-speculative failed ({res.returncode}):\n{log[-3000:]}")
    drafted = int(re.search(r"n_drafted = (\d+)", log).group(1))
    accepted = int(re.search(r"n_accept\s+= (\d+)", log).group(1))
    return {"tok_s": float(m.group(3)), "decoded": int(m.group(1)), "acceptance": accepted / max(drafted, 1),
            "drafted": drafted}


def shape_costs(shape: str, acceptances, threads: int, max_draft: int, ngl: int = 0) -> dict:
    """Step, draft and verify costs of a random-weight model of `shape` (benchmarks/random_models.py:
    F16 backbone, Q4_0 river), with `ngl` layers offloaded, and the speedups they predict at each
    acceptance."""
    from random_models import make
    from river_gguf import Model

    river = make(shape, [], "q4_0", str(cache_dir()), threads)["river"]
    m = Model(river, n_ctx=512, n_threads=threads, n_gpu_layers=ngl)
    costs = lossless_cost.measure_costs(m, m.options(mode="lossless", draft_max=max_draft), max_draft + 1,
                                        rounds=3, steps=8)
    out = {"shape": shape, "ngl": ngl, "costs": costs.as_dict(), "predicted": {}}
    where = "all layers on the GPU" if ngl else f"{threads} threads"
    print(f"\n{shape} (random F16 + Q4_0 river, {where}): step {1e3 * costs.step:.2f} ms, "
          f"draft step {1e3 * costs.draft:.2f} ms, verify "
          + ", ".join(f"{n}: {1e3 * v:.2f} ms ({v / costs.step:.2f} steps)" for n, v in costs.verify.items()))
    for a in acceptances:
        choice = lossless_cost.best_draft_max(costs, a)
        out["predicted"][str(a)] = choice
        print(lossless_cost.describe(choice, costs))
    return out


def gmean_ratio(a, b):
    return math.exp(statistics.mean(math.log(x / y) for x, y in zip(a, b)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b", choices=model_zoo.names())
    ap.add_argument("--backbone", default="f16", choices=("f16", "q8_0"))
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--draft-max", default="3,5", help="comma-separated draft_max values (default 3,5)")
    ap.add_argument("--draft-p-min", type=float, default=0.0)
    ap.add_argument("--draft-vocab", default=None,
                    help="comma-separated draft vocabulary sizes, a lossless row each (0: the whole vocabulary; "
                         "default: the Llama's default)")
    ap.add_argument("--exit-tau", type=float, default=None, help="also a lossless row with River-exit drafts at TAU")
    ap.add_argument("--static", default="q8_0",
                    help="more llama.cpp rows: comma-separated ladder files (model_zoo kinds; default q8_0, the "
                         "speed an F16 lossless backbone would have to reach to dominate it; '' for none)")
    ap.add_argument("--sampled", action="store_true", help="sample (temp 0.8, top-k 40, top-p 0.9, penalty 1.1)")
    ap.add_argument("--no-speculative", action="store_true", help="leave out llama-speculative")
    ap.add_argument("--costs", action="store_true", help="also time step, draft and verify costs and predict")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--shape", default=None, help="only the costs of a random-weight model of this shape")
    ap.add_argument("--acceptance", default="0.85,0.9", help="with --shape: acceptances to predict at")
    ap.add_argument("--ngl", type=int, default=0, help="with --shape: layers offloaded to the GPU (-1: all)")
    args = ap.parse_args(argv)
    ks = [int(x) for x in args.draft_max.split(",")]
    if args.shape:
        out = shape_costs(args.shape, [float(a) for a in args.acceptance.split(",")], args.threads, max(ks), args.ngl)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
        return 0
    if not args.no_speculative and not os.path.exists(SPECULATIVE):
        ap.error(f"{SPECULATIVE} is missing: run ./scripts/build_llama_tools.sh (or pass --no-speculative)")

    target = model_zoo.derived(args.model, args.backbone)
    draft = model_zoo.derived(args.model, "q4_0-imatrix")
    river = river_file(args.model, args.backbone, args.threads)
    texts = prompts(args.model, args.prompts)
    sampling = SAMPLING if args.sampled else GREEDY
    llm = Llama(river, n_ctx=N_CTX, n_threads=args.threads, flash_attn=True, verbose=False)
    # One Llama per draft vocabulary compared (it is fixed at load); None is `llm`'s default.
    vocabs = [None] if args.draft_vocab is None else [int(v) for v in args.draft_vocab.split(",")]
    llms = {None: llm}
    for v in vocabs:
        if v not in llms:
            llms[v] = Llama(river, n_ctx=N_CTX, n_threads=args.threads, flash_attn=True, verbose=False, draft_vocab=v)
    decoders = {args.backbone: LlamaDecoder(target, N_CTX, args.threads)}
    for kind in filter(None, args.static.split(",")):
        if kind not in decoders:
            decoders[kind] = LlamaDecoder(model_zoo.derived(args.model, kind), N_CTX, args.threads)

    rows = {f"lossless k={k}" + ("" if v is None else f" draft vocab {v}"):
            ("river", dict(mode="lossless", draft_max=k, draft_p_min=args.draft_p_min, llm=v))
            for k in ks for v in vocabs}
    if args.exit_tau is not None:
        rows[f"lossless k={ks[-1]} exit-drafts tau={args.exit_tau:g}"] = (
            "river", dict(mode="lossless", draft_max=ks[-1], draft_p_min=args.draft_p_min, draft_mode="river",
                          threshold=args.exit_tau))
    rows["backbone (river_gguf)"] = ("river", dict(mode="backbone"))
    for kind in decoders:
        rows[f"llama.cpp {kind} (llama_decode)"] = ("llama_cpp", kind)
    if not args.no_speculative:
        for k in ks:
            rows[f"llama-speculative k={k}"] = ("speculative", k)

    per_round = {name: [] for name in rows}
    detail = {name: [] for name in rows}
    for rnd in range(args.rounds):
        order = list(rows) if rnd % 2 == 0 else list(rows)[::-1]
        got = {name: [] for name in rows}
        for text in texts:
            for name in order:
                kind, arg = rows[name]
                if kind == "river":
                    opts = {k: v for k, v in arg.items() if k != "llm"}
                    r = river_row(llms[arg.get("llm")], text, args.tokens, sampling, **opts)
                elif kind == "llama_cpp":
                    r = llama_cpp_row(decoders[arg], llm, text, args.tokens)
                else:
                    r = speculative_row(target, draft, text, args.tokens, arg, args.draft_p_min, args.threads,
                                        args.sampled)
                got[name].append(r["tok_s"])
                detail[name].append({k: v for k, v in r.items() if k != "tokens"})
                print(f"round {rnd} {name}: {r['tok_s']:.2f} tok/s"
                      + (f", acceptance {100 * r['acceptance']:.0f}%" if "acceptance" in r else ""),
                      file=sys.stderr, flush=True)
        for name in rows:
            per_round[name].append(statistics.mean(got[name]))

    base = per_round["backbone (river_gguf)"]
    print(f"\n{args.model}, {args.backbone} backbone + Q4_0-imatrix river, {'sampled' if args.sampled else 'greedy'}, "
          f"{args.prompts} prompts x {args.tokens} tokens, {args.rounds} rounds, {args.threads} threads\n")
    print("| row | tok/s | x backbone | x llama-speculative (same k) | acceptance |")
    print("|---|---:|---:|---:|---:|")
    table = []
    for name in rows:
        med = statistics.median(per_round[name])
        acc = [d["acceptance"] for d in detail[name] if "acceptance" in d]
        kind, arg = rows[name]
        k = arg.get("draft_max") if kind == "river" else arg if kind == "speculative" else None
        same_k = f"llama-speculative k={k}" if k is not None and not args.no_speculative else None
        vs_spec = gmean_ratio(per_round[name], per_round[same_k]) if same_k in per_round else float("nan")
        entry = {"row": name, "tok_s": med, "x_backbone": gmean_ratio(per_round[name], base),
                 "x_speculative": vs_spec, "acceptance": statistics.mean(acc) if acc else None,
                 "rounds": per_round[name]}
        table.append(entry)
        spec_cell = "-" if math.isnan(vs_spec) or name.startswith("llama-spec") else f"{vs_spec:.2f}"
        acc_cell = "-" if entry["acceptance"] is None else f"{100 * entry['acceptance']:.0f}%"
        print(f"| {name} | {med:.2f} | {entry['x_backbone']:.2f} | {spec_cell} | {acc_cell} |")
    # Where a round's time goes, per lossless row (median over its generations).
    print("\n| row | drafts a round | draft ms | verify ms | other ms | round ms |")
    print("|---|---:|---:|---:|---:|---:|")
    per_round_ms = {}
    for name in rows:
        ds = [d for d in detail[name] if "round_ms" in d]
        if not ds:
            continue
        med = {k: statistics.median(d[k] for d in ds) for k in ("drafts_per_round", "draft_ms", "verify_ms", "round_ms")}
        per_round_ms[name] = med
        print(f"| {name} | {med['drafts_per_round']:.2f} | {med['draft_ms']:.1f} | {med['verify_ms']:.1f} | "
              f"{med['round_ms'] - med['draft_ms'] - med['verify_ms']:.1f} | {med['round_ms']:.1f} |")
    out = {"model": args.model, "backbone": args.backbone, "sampled": args.sampled, "tokens": args.tokens,
           "prompts": args.prompts, "rounds": args.rounds, "threads": args.threads, "rows": table,
           "per_round_ms": per_round_ms}
    if args.costs:
        m = llms[vocabs[0]].river_model
        opts = m.options(mode="lossless", draft_max=max(ks))
        costs = lossless_cost.measure_costs(m, opts, max(ks) + 1)
        # The acceptance that gives the largest k's measured drafts accepted a round.
        k_name = next(name for name in rows if name.startswith(f"lossless k={ks[-1]}")
                      and rows[name][1].get("llm") == vocabs[0])
        acc = lossless_cost.acceptance_of(statistics.mean(d["mean_accepted"] for d in detail[k_name]), ks[-1])
        choice = lossless_cost.best_draft_max(costs, acc)
        print("\n" + lossless_cost.describe(choice, costs))
        out.update(costs=costs.as_dict(), prediction=choice)
        # The costs' round against the measured one, for each lossless row of river-only drafts:
        # its drafts a round at the draft step, and a verify batch of one more token.
        print("\n| row | predicted round ms | measured round ms | measured / predicted |")
        print("|---|---:|---:|---:|")
        for name, med in per_round_ms.items():
            k = rows[name][1]["draft_max"]
            if rows[name][1].get("draft_mode") or rows[name][1].get("llm") != vocabs[0]:
                continue
            pred = 1000 * (med["drafts_per_round"] * costs.draft + costs.verify[k + 1])
            print(f"| {name} | {pred:.1f} | {med['round_ms']:.1f} | {med['round_ms'] / pred:.2f} |")
    for d in decoders.values():
        d.close()
    for m in llms.values():
        m.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
