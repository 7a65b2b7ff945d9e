"""Where precision pays, by KL divergence from F16: static mixes of llama.cpp's quants of one model.

    RIVER_GGUF_CACHE=.cache/test .venv/bin/python benchmarks/mix_study.py [--model smollm2] \\
        [--items N] [--tokens 64] [--out reports/MODEL/mix_study.md] [--river FILE] [--only LABEL,...]

Each row is a plain GGUF: a base quant with some tensor kinds (attention, ffn_down, ...) taken
from a more precise file of the same model (convert.hybrid.write_mixed_gguf). All are scored by
the same code, teacher-forced on the evaluation split against the F16's next-token distribution
(static files: one batched pass per item, measure/divergence.py), and listed with the weight bytes
one decode step reads (every layer matrix and the head). Mixes are cached beside the model's
derived files. --river FILE adds a row per preset of that River GGUF, scored the same way (decode
path, exits live), with the weight bytes its steps read on average. Each row has paired intervals
against Q4_0, Q4_K_M (both imatrix) and Q8_0 on the same items. Nothing here is timed.
"""
import argparse
import os
import sys
import time

try:  # an installed (or dev-overlay) river_gguf; the checkout's python/ has no native module
    import river_gguf  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

from tqdm import tqdm  # noqa: E402

from river_gguf import Model, presets  # noqa: E402
from river_gguf.calibrate import cost_model  # noqa: E402
from river_gguf.convert.hybrid import write_mixed_gguf  # noqa: E402
from river_gguf.default_model import cache_dir  # noqa: E402
from river_gguf.measure import data as eval_data  # noqa: E402
from river_gguf.measure import divergence
from river_gguf.eval import model_zoo  # noqa: E402
from river_gguf.eval import report as evaluate  # noqa: E402
from river_gguf.gguf.reader import GGUFReader

ATTN = ("attn_q", "attn_k", "attn_v", "attn_output")
KINDS = {"attention": ATTN, "attn_v": ("attn_v",), "ffn_down": ("ffn_down",), "attn_v+ffn_down": ("attn_v", "ffn_down"),
         "ffn": ("ffn_gate", "ffn_up", "ffn_down")}

# (label, base kind, {tensor group: source kind}); "head" = output.weight (or the tied embedding).
MIXES = [
    ("Q4_0 (imatrix)", "q4_0-imatrix", {}),
    ("Q4_0 (imatrix) + attention Q8_0", "q4_0-imatrix", {"attention": "q8_0"}),
    ("Q4_0 (imatrix) + attn_v, ffn_down Q8_0", "q4_0-imatrix", {"attn_v+ffn_down": "q8_0"}),
    ("Q4_K_M (imatrix)", "q4_k_m-imatrix", {}),
    ("Q4_K_M (imatrix) + attention Q8_0", "q4_k_m-imatrix", {"attention": "q8_0"}),
    ("Q4_K_M (imatrix) + ffn_down Q8_0", "q4_k_m-imatrix", {"ffn_down": "q8_0"}),
    ("Q8_0 + ffn Q4_K_M (imatrix)", "q8_0", {"ffn": "q4_k_m-imatrix"}),
    ("Q8_0", "q8_0", {}),
]


def _group_of(name: str):
    if not name.startswith("blk."):
        return None
    kind = name.split(".")[2]
    return next((g for g, members in KINDS.items() if kind in members), None)


def mixed_file(model: str, base: str, mix: dict) -> str:
    if not mix:
        return model_zoo.derived(model, base)
    tag = "+".join(f"{g}-{k}" for g, k in sorted(mix.items()))
    stem = os.path.basename(model_zoo.derived(model, "f16")).removesuffix(".f16.gguf")
    dst = cache_dir() / f"{stem}.mix.{base}.{tag}.gguf"
    if not dst.is_file():
        groups = {}
        for g, k in mix.items():
            for member in KINDS[g]:
                groups[member] = k
        sources = {k: model_zoo.derived(model, k) for k in set(mix.values())}

        def pick(name):
            if not name.startswith("blk."):
                return None
            return groups.get(name.split(".")[2])

        write_mixed_gguf(model_zoo.derived(model, base), dst, sources, pick)
    return str(dst)


def step_bytes_and_types(path: str):
    r = GGUFReader(path)
    sizes = {t.name: t for t in r.tensors}
    head = sizes.get("output.weight", sizes.get("token_embd.weight"))
    mats = [t for n, t in sizes.items() if n.startswith("blk.") and len(t.shape) == 2]
    types = {}
    for t in mats + [head]:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + int(t.n_elements)
    total = sum(types.values())
    return sum(int(t.n_bytes) for t in mats) + int(head.n_bytes), {k: v / total for k, v in sorted(types.items())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2", choices=model_zoo.names())
    ap.add_argument("--items", type=int, default=None, help="evaluation items per domain (default: all)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--river", default=None, metavar="FILE", help="also score this River GGUF's presets")
    ap.add_argument("--only", default=None, help="comma-separated labels of MIXES to score (default: all)")
    a = ap.parse_args(argv)
    t0 = time.time()
    ref = Model(model_zoo.derived(a.model, "f16"), n_ctx=1024, n_threads=a.threads)
    prepared = [p for d in eval_data.DOMAINS for p in evaluate.prepare(
        ref, eval_data.select(eval_data.load_domain(d), "evaluation", a.items), a.tokens, 256)]
    only = None if a.only is None else set(a.only.split(","))
    files = {label: mixed_file(a.model, base, mix) for label, base, mix in MIXES if only is None or label in only}
    configs = {label: (Model(p, n_ctx=1024, n_threads=a.threads), dict(mode="backbone")) for label, p in files.items()}
    river_rows = {}
    if a.river:
        rm = Model(a.river, n_ctx=1024, n_threads=a.threads)
        for name in presets.NAMES:
            if name in rm.presets:
                opts = dict(exit_layer=None, **rm.presets[name].setting.call_options())
                river_rows[f"River {name}"] = opts
                configs[f"River {name}"] = (rm, opts)
    n_tok = sum(len(t) - p for t, p in prepared)
    with tqdm(total=n_tok * len(configs), desc="KLD", unit="tok") as bar:
        runs = divergence.score_configs(ref, configs, prepared, bar=bar)
    refs = [r for r in ("Q4_0 (imatrix)", "Q4_K_M (imatrix)", "Q8_0") if r in runs]
    lines = ["| file | MB read per step | KLD from F16 [95% CI] | same top % | "
             + " | ".join(f"vs {r} [paired CI]" for r in refs) + " | types (share of weights) |",
             "|---|---:|---|---|" + "---|" * len(refs) + "---|"]
    if river_rows:
        layers, head = cost_model.weight_bytes(rm)
    for label in configs:
        s = divergence.summarize(runs[label])
        if label in river_rows:
            o = river_rows[label]
            mb = cost_model.step_bytes(layers, head, rm.n_layer,
                                    *cost_model.setting_step(presets.Setting.of(**o), rm.n_layer,
                                                             runs[label].mean_exit_layer))
            types = {"options": str({k: v for k, v in o.items() if v is not None})}
        else:
            mb, types = step_bytes_and_types(files[label])
            types = {k: f"{100 * v:.0f}%" for k, v in types.items()}
        ds = [divergence.paired_delta(runs[label], runs[r]) if r != label else None for r in refs]
        lines.append(f"| {label} | {mb / 1e6:.1f} | {divergence.fmt_ci(s['kld'], s['kld_ci'])} | "
                     f"{100 * s['same_top']:.1f} | "
                     + " | ".join(divergence.fmt_ci(d['kld'], d['kld_ci'], '{:+.4f}') if d else "-" for d in ds) + " | "
                     + ", ".join(f"{k} {v}" for k, v in types.items()) + " |")
    md = (f"# {a.model}: static mixes by KL divergence from F16\n\nGenerated by `RIVER_GGUF_CACHE=.cache/test "
          f".venv/bin/python benchmarks/mix_study.py {' '.join(argv if argv is not None else sys.argv[1:])}` "
          f"({time.time() - t0:.0f} s): {len(prepared)} evaluation items, {n_tok} scored tokens.\n\n" + "\n".join(lines) + "\n")
    print(md)
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            f.write(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
