"""Does the default River GGUF beat the static quants? Its presets against llama.cpp's ladder and
the static "imatrix Q4_0 + backbone tail" hybrids, on the evaluation split, in one run.

    RIVER_GGUF_CACHE=.cache/test python benchmarks/preset_check.py [--out reports/smollm2-presets.json]

Perplexity: teacher-forced through the decode path (river_gguf's engine, bit-identical to
llama.cpp for plain files), evaluation split of GSM8K and HumanEval. Speed: greedy decode, every
configuration interleaved prompt by prompt; River presets run on river_gguf, static files on
stock llama.cpp with its decode timed alone (evaluate.LlamaCppRunner).
"""
import argparse
import json
import os
import sys
import time

try:  # an installed river_gguf (the checkout's python/ has no native module)
    import river_gguf  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

from river_gguf import Model, eval_data, evaluate  # noqa: E402
from river_gguf.convert import build_river_gguf  # noqa: E402
from river_gguf.default_model import cache_dir, derived_model  # noqa: E402
from river_gguf.hybrid import write_hybrid_gguf  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--items", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=80)
    ap.add_argument("--gen-items", type=int, default=2)
    ap.add_argument("--gen-tokens", type=int, default=48)
    ap.add_argument("--tails", default="2,4")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    t0 = time.time()
    f16 = derived_model("f16")
    river = str(cache_dir() / "SmolLM2-135M-Instruct.f16+q4_0-imatrix.presets.river.gguf")
    if not os.path.exists(river):
        build_river_gguf(f16, river, progress=True)  # the converter's defaults
    m = Model(river, n_ctx=1024, n_threads=2)
    statics = {q.upper(): derived_model(q) for q in ("f16", "q8_0", "q4_k_m", "q4_0")}
    for t in (int(x) for x in a.tails.split(",")):
        p = str(cache_dir() / f"smollm2-imatrix-q4_0-tail{t}.gguf")
        if not os.path.exists(p):
            write_hybrid_gguf(river, river, p, exit_layer=-1, river_head=True, tail=t)
        statics[f"imatrix Q4_0 + F16 tail {t} (static)"] = p
    items = {d: eval_data.select(eval_data.load_domain(d), "evaluation") for d in eval_data.DOMAINS}
    prepared = [p for its in items.values() for p in evaluate.prepare(m, its[:a.items], a.tokens, 256)]
    gen = [evaluate._prompt_part(m, it, 256) for its in items.values() for it in its[:a.gen_items]]

    rows = {}
    for name in m.presets:
        r = evaluate.score_items(m, prepared, preset=name)
        rows[f"River {name}"] = {"ppl": r.perplexity, "mean_exit_layer": r.mean_exit_layer,
                                 "options": m.presets[name]["options"]}
    models = {}
    for name, path in statics.items():
        mm = Model(path, n_ctx=1024, n_threads=2)
        rows[name] = {"ppl": evaluate.score_items(mm, prepared, mode="backbone").perplexity}
        models[name] = evaluate.LlamaCppRunner(path, 1024, 2)
        del mm
    runs = {k: evaluate.GreedyRun() for k in rows}
    for i, p in enumerate(gen):
        order = list(rows) if i % 2 == 0 else list(reversed(rows))
        for k in order:
            if k.startswith("River "):
                res = evaluate.greedy_river(m, p, a.gen_tokens, preset=k[len("River "):])
            else:
                res = models[k].greedy(p, a.gen_tokens)
            runs[k].add(*res)
    for k in rows:
        rows[k]["decode_tok_s"] = runs[k].decode_tok_s
    out = {"rows": rows, "seconds": time.time() - t0, "items": a.items, "tokens": a.tokens,
           "gen_items": a.gen_items, "gen_tokens": a.gen_tokens}
    print("| config | ppl | decode tok/s |\n|---|---:|---:|")
    for k, r in rows.items():
        print(f"| {k} | {r['ppl']:.4f} | {r['decode_tok_s']:.1f} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
