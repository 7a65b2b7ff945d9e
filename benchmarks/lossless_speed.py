"""Lossless mode's decode speed against the backbone alone, llama.cpp decoding the backbone file,
and every speculative loop of llama.cpp on the same weights, in one run.

    .venv/bin/python benchmarks/lossless_speed.py [--model qwen2.5-coder-0.5b] [--backbone f16]
        [--prompts 2] [--tokens 128] [--rounds 3] [--draft-max 3,5] [--adaptive-max 8]
        [--ngram-mod-max 16,64] [--draft-p-min 0] [--exit-tau 0.95] [--sampled] [--json OUT.json]

Files (derived once into RIVER_GGUF_CACHE; model_zoo): the backbone, the model's F16 or Q8_0; the
River GGUF, that backbone with a Q4_0 river quantized from the F16 with the model's importance
matrix (`river-gguf convert --backbone-type B --river-type q4_0 --imatrix FILE --no-presets`); and
llama.cpp's draft, the static Q4_0 of the same F16 with the same importance matrix (q4_0-imatrix):
the same weights the river holds, in a file of their own.

Prompts, --prompts of each kind: prose written afresh, code from scratch (HumanEval's first
evaluation items), arithmetic (GSM8K's), and an edit (rename a variable in a given 12-line
function: most of the answer copies the prompt, where n-gram drafts hit). Rows, each generating
--tokens tokens after each prompt, end of generation ignored:
  - lossless with the river alone drafting, for each --draft-max (fixed length, no n-grams); lossless
    as it runs by default (n-gram drafts beside the river's and a draft length that follows
    acceptance, up to --adaptive-max); the adaptive length without n-grams; River-exit drafts (tau);
  - the backbone alone (mode="backbone"), the same river_gguf.Llama;
  - llama.cpp decoding the backbone file: llama_decode timed alone, greedy (its speed does not
    depend on the sampler);
  - llama.cpp's speculative loops (built by scripts/build_llama_tools.sh), the backbone file as
    target, flash attention on, each timed by its own "decoded ... t/s": llama-speculative with the
    static Q4_0 as draft (--spec-draft-n-max K), and llama-speculative-simple with
    --spec-type draft-simple (the same draft, each K), ngram-mod (no draft model, each
    --ngram-mod-max), and draft-simple,ngram-mod (each K).
river_gguf's rows are timed as llama-speculative times itself: wall time from the first sampled
token to the last, sampling included ("wall"); "engine" counts only the engine's draft, verify
and step calls. Rows are interleaved within each round (order reversed every other round); the
table gives the median over rounds of the mean over prompts, and each row's ratio to the backbone,
to llama-speculative at the same k, and to the fastest llama.cpp loop (each family at its best
draft length) is the geometric mean of the per-round ratios; a second table gives each row over
the backbone per prompt kind.

--sampled samples at temperature 0.8, top-k 40, top-p 0.9, repeat penalty 1.1 with a fixed seed
(llama.cpp's loops then accept drafts by their stochastic rule). --costs also times the engine's
step, draft step and verify batches (calibrate.lossless.measure_costs) and prints the speedup
they predict at the acceptance measured in the run. Run it alone on the machine.

    .venv/bin/python benchmarks/lossless_speed.py --shape llama-3.2-1b --acceptance 0.87,0.92

times only those costs, on a random-weight F16 model of that shape (benchmarks/random_models.py,
written once into the cache) with a Q4_0 river (--ngl -1: on the GPU), and prints the speedup they
predict at each acceptance (the ones measured on the real models): the cost of a step does not
depend on the weights.
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
SPECULATIVE_SIMPLE = SPECULATIVE + "-simple"
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


#: Prose the model writes afresh: nothing in the prompt to copy.
PROSE = ("Write a short paragraph explaining why rivers flow to the sea.\n\n",
         "Describe in a few sentences how a bicycle turns the rider's effort into motion.\n\n")
#: The function the edit prompts change: 12 lines whose names recur, so most of an edit copies it.
EDIT_FUNCTION = """def summarize(values):
    total = 0
    count = 0
    for value in values:
        if value is None:
            continue
        total += value
        count += 1
    if count == 0:
        return None
    mean = total / count
    return {"total": total, "count": count, "mean": mean}
"""
EDIT = tuple(f"Rename the variable `{old}` to `{new}` in this Python function and change nothing else.\n\n"
             f"```python\n{EDIT_FUNCTION}```\n\nThe same function with `{old}` renamed to `{new}`:\n\n```python\n"
             for old, new in (("total", "running_sum"), ("count", "n_values")))
KINDS = ("prose", "code", "arithmetic", "edit")


def prompts(n: int):
    """(kind, prompt) pairs, up to n of each kind: prose written afresh, code from scratch (the
    first HumanEval evaluation items), arithmetic (GSM8K's), and an edit of a given function."""
    def items(domain):
        return [it.prompt for it in eval_data.select(eval_data.load_domain(domain), "evaluation", n)]

    by_kind = {"prose": list(PROSE[:n]), "code": items("humaneval"), "arithmetic": items("gsm8k"),
               "edit": list(EDIT[:n])}
    return [(kind, text) for kind in KINDS for text in by_kind[kind]]


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
                   round_ms=1000 * (t_last - t_first) / n, drafts_per_round=s["drafted"] / n,
                   ngram_share=s["ngram_drafted"] / max(s["drafted"], 1))
        row["other_ms"] = row["round_ms"] - row["draft_ms"] - row["verify_ms"]
    return row


def llama_cpp_row(dec, llm, prompt: str, tokens: int) -> dict:
    toks = llm.tokenize(prompt.encode(), add_bos=True, special=True)
    out, steps, secs = dec.greedy(toks, tokens, stop_at_eog=False)
    return {"tok_s": steps / secs}


def speculative_row(target: str, draft: str, prompt: str, tokens: int, k: int, p_min: float, threads: int,
                    sampled: bool) -> dict:
    return _llama_tool(SPECULATIVE, target, prompt, tokens, threads, sampled,
                       ["-md", draft] + _draft_args(k, p_min))


def speculative_simple_row(target: str, draft: str, prompt: str, tokens: int, spec: dict, p_min: float,
                           threads: int, sampled: bool) -> dict:
    """llama-speculative-simple with spec = {"types": [...], "k": draft-simple's n-max, "ngram": ngram-mod's}."""
    extra = ["--spec-type", ",".join(spec["types"])]
    if "draft-simple" in spec["types"]:
        extra += ["-md", draft] + _draft_args(spec["k"], p_min)
    if "ngram-mod" in spec["types"]:
        n = spec["ngram"]  # ngram-mod's own proportion of its defaults (n-min 48 of n-max 64)
        extra += ["--spec-ngram-mod-n-max", str(n), "--spec-ngram-mod-n-min", str(max(1, 3 * n // 4))]
    return _llama_tool(SPECULATIVE_SIMPLE, target, prompt, tokens, threads, sampled, extra)


def _draft_args(k: int, p_min: float) -> list:
    return ["--spec-draft-n-max", str(k), "--spec-draft-n-min", "0", "--spec-draft-p-min", str(p_min)]


def _llama_tool(binary: str, target: str, prompt: str, tokens: int, threads: int, sampled: bool, extra) -> dict:
    """Run one of llama.cpp's speculative programs; its own "decoded ... t/s" and draft counts."""
    samp = (["--temp", str(SAMPLING["temp"]), "--top-k", str(SAMPLING["top_k"]), "--top-p", str(SAMPLING["top_p"]),
             "--repeat-penalty", str(SAMPLING["repeat_penalty"])] if sampled else ["--temp", "0"])
    cmd = [binary, "-m", target, "-p", prompt, "-n", str(tokens), "-c", str(N_CTX),
           "-t", str(threads), "-tb", str(threads), "-td", str(threads), "-tbd", str(threads),
           "-fa", "on", "-s", str(SEED), "--ignore-eos", "-ngl", "0"] + samp + list(extra)
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    log = res.stdout + res.stderr
    m = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s", log)
    if res.returncode != 0 or not m:
        raise RuntimeError(f"{os.path.basename(binary)} failed ({res.returncode}):\n{log[-3000:]}")
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


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b", choices=model_zoo.names())
    ap.add_argument("--backbone", default="f16", choices=("f16", "q8_0"))
    ap.add_argument("--prompts", type=int, default=2, help="prompts of each kind (prose, code, arithmetic, edit)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--draft-max", default="3,5", help="comma-separated draft_max values (default 3,5)")
    ap.add_argument("--adaptive-max", type=int, default=8,
                    help="draft_max of the default lossless rows (n-gram drafts and an adaptive draft length)")
    ap.add_argument("--ngram-mod-max", default="16,64",
                    help="llama.cpp's ngram-mod rows: comma-separated --spec-ngram-mod-n-max values (n-min 3/4 of it)")
    ap.add_argument("--draft-p-min", type=float, default=0.0)
    ap.add_argument("--draft-vocab", default=None,
                    help="comma-separated draft vocabulary sizes, a lossless row each (0: the whole vocabulary; "
                         "default: the Llama's default)")
    ap.add_argument("--exit-tau", type=float, default=None, help="also a lossless row with River-exit drafts at TAU")
    ap.add_argument("--lossless-kernels", default="decode",
                    help="comma-separated verify kernels (decode, batch), the lossless rows for each (default decode)")
    ap.add_argument("--static", default="q8_0",
                    help="more llama.cpp rows: comma-separated ladder files (model_zoo kinds; default q8_0, the "
                         "speed an F16 lossless backbone would have to reach to dominate it; '' for none)")
    ap.add_argument("--sampled", action="store_true", help="sample (temp 0.8, top-k 40, top-p 0.9, penalty 1.1)")
    ap.add_argument("--no-speculative", action="store_true",
                    help="leave out llama-speculative and llama-speculative-simple")
    ap.add_argument("--costs", action="store_true", help="also time step, draft and verify costs and predict")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--shape", default=None, help="only the costs of a random-weight model of this shape")
    ap.add_argument("--acceptance", default="0.85,0.9", help="with --shape: acceptances to predict at")
    ap.add_argument("--ngl", type=int, default=0, help="with --shape: layers offloaded to the GPU (-1: all)")
    args = ap.parse_args(argv)
    if not args.shape and not args.no_speculative:
        for binary in (SPECULATIVE, SPECULATIVE_SIMPLE):
            if not os.path.exists(binary):
                ap.error(f"{binary} is missing: run ./scripts/build_llama_tools.sh (or pass --no-speculative)")
    return args


def row_table(args, ks, vocabs, kernels, decoders) -> dict:
    """name -> (kind, argument) of every row the run times. A lossless row's `llm` names its Llama:
    (draft vocabulary, verify kernels)."""
    rows = {}
    for kern in kernels:
        # The first kernels' rows keep their plain names (the default's: decode).
        tag = "" if kern == kernels[0] else f" ({kern} kernels)"
        for k in ks:
            for v in vocabs:
                rows[f"lossless k={k} river" + ("" if v is None else f" draft vocab {v}") + tag] = (
                    "river", dict(mode="lossless", draft_max=k, draft_p_min=args.draft_p_min, llm=(v, kern),
                                  ngram_draft=False, adaptive_draft=False))
        big = args.adaptive_max
        rows[f"lossless n-gram + adaptive k<={big}{tag}"] = (
            "river", dict(mode="lossless", draft_max=big, draft_p_min=args.draft_p_min, llm=(None, kern)))
        rows[f"lossless adaptive k<={big} river{tag}"] = (
            "river", dict(mode="lossless", draft_max=big, draft_p_min=args.draft_p_min, ngram_draft=False,
                          llm=(None, kern)))
    if args.exit_tau is not None:
        rows[f"lossless k={ks[-1]} exit-drafts tau={args.exit_tau:g}"] = (
            "river", dict(mode="lossless", draft_max=ks[-1], draft_p_min=args.draft_p_min, draft_mode="river",
                          threshold=args.exit_tau, ngram_draft=False, adaptive_draft=False, llm=(None, kernels[0])))
    rows["backbone (river_gguf)"] = ("river", dict(mode="backbone", llm=(None, kernels[0])))
    for kind in decoders:
        rows[f"llama.cpp {kind} (llama_decode)"] = ("llama_cpp", kind)
    if not args.no_speculative:
        for k in ks:
            rows[f"llama-speculative k={k}"] = ("speculative", k)
        for k in ks:
            rows[f"spec-simple draft-simple k={k}"] = ("simple", dict(types=["draft-simple"], k=k))
        for n in (int(x) for x in args.ngram_mod_max.split(",")):
            rows[f"spec-simple ngram-mod n-max={n}"] = ("simple", dict(types=["ngram-mod"], ngram=n))
        for k in ks:
            rows[f"spec-simple draft-simple,ngram-mod k={k}"] = (
                "simple", dict(types=["draft-simple", "ngram-mod"], k=k, ngram=64))
    return rows


def family(name: str) -> str:
    """The anchor family of a llama.cpp speculative row ('' for any other row)."""
    if name.startswith("llama-speculative"):
        return "llama-speculative"
    if name.startswith("spec-simple "):
        return name.split()[1]
    return ""


def run_rows(args, rows, texts, llms, decoders, llm, target, draft, sampling):
    """Every row on every prompt, rows interleaved (order reversed every other round). Returns
    tok/s per row, round and prompt, and each run's details."""
    speed = {name: [] for name in rows}
    detail = {name: [] for name in rows}
    for rnd in range(args.rounds):
        order = list(rows) if rnd % 2 == 0 else list(rows)[::-1]
        got = {name: [] for name in rows}
        for kind_of_text, text in texts:
            for name in order:
                kind, arg = rows[name]
                if kind == "river":
                    opts = {k: v for k, v in arg.items() if k != "llm"}
                    r = river_row(llms[arg["llm"]], text, args.tokens, sampling, **opts)
                elif kind == "llama_cpp":
                    r = llama_cpp_row(decoders[arg], llm, text, args.tokens)
                elif kind == "speculative":
                    r = speculative_row(target, draft, text, args.tokens, arg, args.draft_p_min, args.threads,
                                        args.sampled)
                else:
                    r = speculative_simple_row(target, draft, text, args.tokens, arg, args.draft_p_min, args.threads,
                                               args.sampled)
                got[name].append(r["tok_s"])
                detail[name].append(dict({k: v for k, v in r.items() if k != "tokens"}, prompt_kind=kind_of_text))
                print(f"round {rnd} {kind_of_text} {name}: {r['tok_s']:.2f} tok/s"
                      + (f", acceptance {100 * r['acceptance']:.0f}%" if "acceptance" in r else ""),
                      file=sys.stderr, flush=True)
        for name in rows:
            speed[name].append(got[name])
    return speed, detail


def print_tables(args, rows, texts, speed, detail) -> list:
    """The table of every row (and each against the backbone, the same-k llama-speculative and
    the fastest llama.cpp loop), per prompt kind, and where a lossless round's time goes."""
    per_round = {name: [statistics.mean(r) for r in speed[name]] for name in rows}
    base = per_round["backbone (river_gguf)"]
    # Each anchor family at its best draft length (by its median), and the fastest of them.
    best = {}
    for name in rows:
        fam = family(name)
        if fam and (fam not in best or statistics.median(per_round[name]) > statistics.median(per_round[best[fam]])):
            best[fam] = name
    fastest = max(best.values(), key=lambda n: statistics.median(per_round[n])) if best else None
    print(f"\n{args.model}, {args.backbone} backbone + Q4_0-imatrix river, {'sampled' if args.sampled else 'greedy'}, "
          f"{args.prompts} prompts of each kind x {args.tokens} tokens, {args.rounds} rounds, {args.threads} threads"
          + (f"; fastest llama.cpp loop: {fastest}" if fastest else "") + "\n")
    print("| row | tok/s | x backbone | x llama-speculative (same k) | x fastest llama.cpp loop | acceptance |")
    print("|---|---:|---:|---:|---:|---:|")
    table = []
    for name in rows:
        med = statistics.median(per_round[name])
        acc = [d["acceptance"] for d in detail[name] if "acceptance" in d]
        kind, arg = rows[name]
        k = arg.get("draft_max") if kind == "river" else arg if kind == "speculative" else None
        same_k = f"llama-speculative k={k}" if k is not None else None
        vs_spec = gmean_ratio(per_round[name], per_round[same_k]) if same_k in per_round else float("nan")
        vs_fast = gmean_ratio(per_round[name], per_round[fastest]) if fastest else float("nan")
        entry = {"row": name, "tok_s": med, "x_backbone": gmean_ratio(per_round[name], base),
                 "x_speculative": vs_spec, "x_fastest_llama_cpp": vs_fast,
                 "acceptance": statistics.mean(acc) if acc else None, "rounds": per_round[name],
                 "best_of_family": name in best.values()}
        table.append(entry)
        spec_cell = "-" if math.isnan(vs_spec) or family(name) else f"{vs_spec:.2f}"
        fast_cell = "-" if math.isnan(vs_fast) else f"{vs_fast:.2f}"
        acc_cell = "-" if entry["acceptance"] is None else f"{100 * entry['acceptance']:.0f}%"
        mark = " (best of its family)" if entry["best_of_family"] else ""
        print(f"| {name}{mark} | {med:.2f} | {entry['x_backbone']:.2f} | {spec_cell} | {fast_cell} | {acc_cell} |")
    print_per_kind(rows, texts, speed)
    return table


def print_per_kind(rows, texts, speed) -> None:
    """Each row's speed over the backbone's, per prompt kind (geometric mean over rounds)."""
    kinds = [k for k in KINDS if any(kind == k for kind, _ in texts)]
    print("\n| row | " + " | ".join(f"x backbone, {k}" for k in kinds) + " |")
    print("|---|" + "---:|" * len(kinds))
    base = speed["backbone (river_gguf)"]
    for name in rows:
        cells = []
        for k in kinds:
            idx = [i for i, (kind, _) in enumerate(texts) if kind == k]
            mine = [statistics.mean(r[i] for i in idx) for r in speed[name]]
            ref = [statistics.mean(r[i] for i in idx) for r in base]
            cells.append(f"{gmean_ratio(mine, ref):.2f}")
        print(f"| {name} | " + " | ".join(cells) + " |")


def print_round_times(rows, detail) -> dict:
    """Where a round's time goes, per lossless row (median over its generations, each column on its
    own: `other` is each generation's round less its draft and verify time, then the median, since
    a difference of medians can come from different prompts)."""
    print("\n| row | drafts a round | n-gram share of drafts | draft ms | verify ms | other ms | round ms |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    per_round_ms = {}
    for name in rows:
        ds = [d for d in detail[name] if "round_ms" in d]
        if not ds:
            continue
        med = {k: statistics.median(d[k] for d in ds)
               for k in ("drafts_per_round", "draft_ms", "verify_ms", "other_ms", "round_ms", "ngram_share")}
        per_round_ms[name] = med
        print(f"| {name} | {med['drafts_per_round']:.2f} | {100 * med['ngram_share']:.0f}% | {med['draft_ms']:.1f} | "
              f"{med['verify_ms']:.1f} | {med['other_ms']:.1f} | "
              f"{med['round_ms']:.1f} |")
    return per_round_ms


def print_costs(args, rows, ks, first, llms, detail, per_round_ms) -> dict:
    """The engine's measured costs, the speedup they predict, and the round time they predict
    against the measured one, for each fixed-k river-only row."""
    m = llms[first].river_model
    opts = m.options(mode="lossless", draft_max=max(ks))
    costs = lossless_cost.measure_costs(m, opts, max(ks) + 1)
    # The acceptance that gives the largest k's measured drafts accepted a round.
    k_name = next(name for name in rows if name.startswith(f"lossless k={ks[-1]}")
                  and rows[name][1].get("llm") == first)
    acc = lossless_cost.acceptance_of(statistics.mean(d["mean_accepted"] for d in detail[k_name]), ks[-1])
    choice = lossless_cost.best_draft_max(costs, acc)
    print("\n" + lossless_cost.describe(choice, costs))
    print("\n| row | predicted round ms | measured round ms | measured / predicted |")
    print("|---|---:|---:|---:|")
    for name, med in per_round_ms.items():
        arg = rows[name][1]
        if arg.get("draft_mode") or arg.get("llm") != first or arg.get("adaptive_draft", True):
            continue
        k = arg["draft_max"]
        pred = 1000 * (med["drafts_per_round"] * costs.draft + costs.verify[k + 1])
        print(f"| {name} | {pred:.1f} | {med['round_ms']:.1f} | {med['round_ms'] / pred:.2f} |")
    return {"costs": costs.as_dict(), "prediction": choice}


def main(argv=None) -> int:
    args = parse_args(argv)
    ks = [int(x) for x in args.draft_max.split(",")]
    if args.shape:
        out = shape_costs(args.shape, [float(a) for a in args.acceptance.split(",")], args.threads, max(ks), args.ngl)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
        return 0
    target = model_zoo.derived(args.model, args.backbone)
    draft = model_zoo.derived(args.model, "q4_0-imatrix")
    river = river_file(args.model, args.backbone, args.threads)
    texts = prompts(args.prompts)
    sampling = SAMPLING if args.sampled else GREEDY
    # One Llama per draft vocabulary and verify kernels compared (both are fixed at load); a None
    # vocabulary is the Llama's default.
    vocabs = [None] if args.draft_vocab is None else [int(v) for v in args.draft_vocab.split(",")]
    kernels = args.lossless_kernels.split(",")
    llms = {}
    for kern in kernels:
        for v in vocabs + [None]:
            if (v, kern) not in llms:
                llms[v, kern] = Llama(river, n_ctx=N_CTX, n_threads=args.threads, flash_attn=True, verbose=False,
                                      lossless_kernels=kern, **({} if v is None else {"draft_vocab": v}))
    llm = llms[None, kernels[0]]
    decoders = {args.backbone: LlamaDecoder(target, N_CTX, args.threads)}
    for kind in filter(None, args.static.split(",")):
        if kind not in decoders:
            decoders[kind] = LlamaDecoder(model_zoo.derived(args.model, kind), N_CTX, args.threads)
    rows = row_table(args, ks, vocabs, kernels, decoders)
    speed, detail = run_rows(args, rows, texts, llms, decoders, llm, target, draft, sampling)
    table = print_tables(args, rows, texts, speed, detail)
    per_round_ms = print_round_times(rows, detail)
    out = {"model": args.model, "backbone": args.backbone, "sampled": args.sampled, "tokens": args.tokens,
           "prompts": [kind for kind, _ in texts], "rounds": args.rounds, "threads": args.threads, "rows": table,
           "per_round_ms": per_round_ms, "per_prompt": {name: speed[name] for name in rows}}
    if args.costs:
        out.update(print_costs(args, rows, ks, (vocabs[0], kernels[0]), llms, detail, per_round_ms))
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
