"""What the converter's importance matrix costs per calibration token, against llama.cpp's own
`llama-imatrix` on the same F16 file, the same text and the same thread count.

    ./scripts/build_llama_tools.sh            # once: .cache/llama-tools/build/bin/llama-imatrix
    RIVER_GGUF_CACHE=.cache/test .venv/bin/python benchmarks/imatrix_cost.py \\
        [--models smollm2,qwen2.5-coder-0.5b] [--threads 2] [--repeats 2] [--json out.json]

Both sides read the calibration split the converter reads (convert.imatrix.calibration_texts).
river_gguf runs collect_imatrix (each text from an empty cache, cut to 1024 tokens, the LM head's
statistics included); llama-imatrix gets the same texts joined into one file and runs its usual
chunks of 512 tokens with `--process-output` (the head's statistics too) and its perplexity on
(what it does by default). Each side is timed as a whole process step, model load included,
alternating, best of --repeats; the figure compared is calibration tokens per second. Run it
alone on the machine: a second job on the cores changes both sides.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

try:  # an installed river_gguf (the checkout's python/ has no native module)
    import river_gguf  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

from river_gguf.convert.imatrix import calibration_texts, collect_imatrix  # noqa: E402
from river_gguf.eval import model_zoo  # noqa: E402

DEFAULT_TOOL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".cache", "llama-tools", "build", "bin",
                            "llama-imatrix")


def time_river(f16: str, texts, threads: int) -> dict:
    t0 = time.perf_counter()
    imx = collect_imatrix(f16, texts, n_threads=threads, progress=False)
    secs = time.perf_counter() - t0
    return {"seconds": secs, "tokens": imx.n_tokens, "tok_s": imx.n_tokens / secs}


def time_llama(tool: str, f16: str, text_file: str, threads: int, out_dir: str) -> dict:
    out = os.path.join(out_dir, "llama.imatrix.gguf")
    cmd = [tool, "-m", f16, "-f", text_file, "-o", out, "-t", str(threads), "-c", "512", "--process-output",
           "-ngl", "0"]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    secs = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"llama-imatrix failed ({r.returncode}):\n{r.stderr[-3000:]}")
    log = r.stdout + r.stderr
    # compute_imatrix logs "computing over N chunks, n_ctx=512, batch_size=..., n_seq=..."
    m = re.search(r"computing over (\d+) chunks?, n_ctx=(\d+)", log)
    if not m:
        raise SystemExit("cannot read llama-imatrix's chunk count from its log:\n" + log[-3000:])
    tokens = int(m.group(1)) * int(m.group(2))
    return {"seconds": secs, "tokens": tokens, "tok_s": tokens / secs, "command": " ".join(cmd)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2,qwen2.5-coder-0.5b")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--tool", default=DEFAULT_TOOL, help="the llama-imatrix binary")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if not os.path.isfile(a.tool):
        raise SystemExit(f"no llama-imatrix at {a.tool}: run ./scripts/build_llama_tools.sh")
    texts = calibration_texts()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        text_file = os.path.join(tmp, "calibration.txt")
        with open(text_file, "w", encoding="utf-8") as f:
            f.write("\n\n".join(texts))
        for name in [m for m in a.models.split(",") if m]:
            f16 = model_zoo.derived(name, "f16")
            river, llama = [], []
            for _ in range(a.repeats):
                river.append(time_river(f16, texts, a.threads))
                llama.append(time_llama(a.tool, f16, text_file, a.threads, tmp))
            r = max(river, key=lambda x: x["tok_s"])
            ll = max(llama, key=lambda x: x["tok_s"])
            results[name] = {"river_gguf": r, "llama_imatrix": ll, "ratio": r["tok_s"] / ll["tok_s"],
                             "river_runs": [x["tok_s"] for x in river], "llama_runs": [x["tok_s"] for x in llama]}
            print(f"{name}: river_gguf {r['tokens']} tokens in {r['seconds']:.1f} s ({r['tok_s']:.0f} tok/s); "
                  f"llama-imatrix {ll['tokens']} tokens in {ll['seconds']:.1f} s ({ll['tok_s']:.0f} tok/s); "
                  f"river_gguf at {results[name]['ratio']:.2f}x llama-imatrix's tokens per second", flush=True)
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump({"threads": a.threads, "repeats": a.repeats, "models": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
