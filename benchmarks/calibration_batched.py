"""The presets' calibration scored two ways on the same River GGUF and items: the converter's
default (static settings batched at prefill speed, dynamic ones by decode on half the items) and
everything through decode on every item. Per setting, both KLDs with their intervals and the
difference; the presets each way chooses; the seconds each way took.

    .venv/bin/python benchmarks/calibration_batched.py [--model smollm2] [--river FILE] [--tokens 1024]
        [--river-only]

The River GGUF is the converter's default of the model (eval/report.default_river_gguf), or FILE.
A batched pass of quantized weights is not the computation decode runs (ggml's batched kernels
quantize activations per batch row differently from single-token ones), so the question is how
much the KLDs move, and whether the presets do. Each static setting runs its items whole in a
batch, prompt included, as it prefills in use; the reference is the file's backbone, each way.
--river-only measures the plain river-only setting alone (its batched KLD against its decoded
interval).
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

from river_gguf.calibrate import open_model  # noqa: E402
from river_gguf import presets  # noqa: E402
from river_gguf.calibrate.preset_grid import calibrate_presets  # noqa: E402
from river_gguf.convert.build import preset_score_tokens  # noqa: E402
from river_gguf.eval import model_zoo  # noqa: E402
from river_gguf.eval import report as evaluate  # noqa: E402


def label(o: dict) -> str:
    parts = [o.get("mode", "")]
    if o.get("mode") == "river":
        parts.append(f"tau {o['threshold']}")
    if o.get("tail"):
        parts.append(f"tail {o['tail']}")
    if o.get("river_attention") == "backbone":
        parts.append("bb attention")
    return ", ".join(parts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", choices=model_zoo.names())
    ap.add_argument("--river", default=None)
    ap.add_argument("--tokens", type=int, default=1024, help="calibration tokens per setting (default 1024)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--river-only", action="store_true", help="the river-only setting alone")
    a = ap.parse_args(argv)
    settings = [presets.Setting.of(mode="river-only", tail=0, river_head=True)] if a.river_only else None
    path = a.river or evaluate.default_river_gguf(a.model, n_threads=a.threads, progress=True)
    m = open_model(path, n_ctx=1024, n_threads=a.threads, threshold=2.0)
    res, secs = {}, {}
    for way, batched in (("batched", True), ("decode", False)):
        t0 = time.perf_counter()
        res[way] = calibrate_presets(m, score_tokens=preset_score_tokens(a.tokens), progress=True, batched=batched,
                                     min_tokens=a.tokens, settings=settings)
        secs[way] = time.perf_counter() - t0
    print(f"\n{a.model}: {path}, {a.tokens} tokens a setting; batched {secs['batched']:.0f} s, "
          f"decode {secs['decode']:.0f} s ({secs['decode'] / secs['batched']:.1f}x)\n")
    print("| setting | scored | KLD batched [95% CI] | KLD decode [95% CI] | batched - decode |")
    print("|---|---|---|---|---:|")
    ci = lambda r: f"[{r['kld_ci'][0]:.4f}, {r['kld_ci'][1]:.4f}]" if r.get("kld_ci") else "(no interval)"  # noqa: E731
    for rb, rd in zip(res["batched"]["rows"], res["decode"]["rows"]):
        print(f"| {label(rb['options'].named())} | {rb['scored']} | {rb['kld']:.4f} {ci(rb)} "
              f"| {rd['kld']:.4f} {ci(rd)} | {rb['kld'] - rd['kld']:+.4f} |")
    print()
    for tier in res["batched"]["presets"]:
        pb, pd = res["batched"]["presets"][tier], res["decode"]["presets"][tier]
        same = "the same" if pb.setting == pd.setting else "DIFFERENT"
        print(f"{tier}: batched {label(pb.setting.named())}; decode {label(pd.setting.named())} ({same})")
    if a.json:
        with open(a.json, "w") as f:
            stored = json.loads(presets.dump({w: {"rows": r["rows"], "presets": r["presets"]} for w, r in res.items()}))
            json.dump({"model": a.model, "river": path, "tokens": a.tokens, "seconds": secs,
                       "rows": {w: r["rows"] for w, r in stored.items()},
                       "presets": {w: {k: v["options"] for k, v in r["presets"].items()} for w, r in stored.items()}},
                      f, indent=1, default=float)
    return 0


if __name__ == "__main__":
    sys.exit(main())
