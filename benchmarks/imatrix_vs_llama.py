"""The converter's importance matrix against llama.cpp's `llama-imatrix` on the same F16 and the
same text, per tensor: the relative difference of the column sums (in_sum2) and of the counts.

    ./scripts/build_llama_tools.sh llama-imatrix      # once: .cache/llama-tools/build/bin/llama-imatrix
    .venv/bin/python benchmarks/imatrix_vs_llama.py [--model smollm2] [--chunks 8] [--threads 2]
        [--tool PATH] [--json OUT.json]

Two comparisons, one text: the converter's calibration texts joined into one file (as
benchmarks/convert_cost.py gives llama-imatrix).

- **The same chunks.** llama-imatrix tokenizes the whole file once, cuts it into chunks of 512
  tokens, puts BOS at the start of each where the vocabulary adds one, and runs each from an empty cache
  (`-c 512 -b 512 --process-output --no-ppl`, the first --chunks chunks). The converter's
  collection (convert.imatrix.collect_chunks, the engine's activation observer) runs exactly
  those token lists. Where the two agree on the input, the sums differ only by the two engines'
  arithmetic (joined Q/K/V and gate/up, attention kernels, summation order: float32 against
  double).
- **The converter's chunking.** What the converter collects (collect_on: each text on its own
  from an empty cache, cut to 1,024 tokens) against llama-imatrix's default run on the joined file (chunks
  of 512 across text boundaries, the last partial chunk dropped): the importance (sum / count,
  what the quantizer reads) per tensor, since the two see different token counts.

Names present on one side only are listed: llama-imatrix collects the head only under the name
"output.weight", so a model with a tied embedding (SmolLM2) gets no head statistics from it, where
the converter keeps the head's (token_embd.weight, the tensor the river's tied head is quantized
from).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

try:  # an installed river_gguf (the checkout's python/ has no native module)
    import river_gguf  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

from river_gguf.convert import imatrix as imx  # noqa: E402
from river_gguf.eval import model_zoo  # noqa: E402
from river_gguf.model import Model  # noqa: E402

DEFAULT_TOOL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".cache", "llama-tools", "build", "bin",
                            "llama-imatrix")
CHUNK = 512


def f16_of(name: str) -> str:
    return os.path.abspath(name) if os.path.isfile(name) else model_zoo.derived(name, "f16")


def llama_imatrix(tool: str, f16: str, text_path: str, out: str, threads: int, chunks: int) -> imx.Imatrix:
    cmd = [tool, "-m", f16, "-f", text_path, "-o", out, "-c", str(CHUNK), "-b", str(CHUNK), "--process-output",
           "--no-ppl", "-t", str(threads), "-ngl", "0", "--chunks", str(chunks)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return imx.read_imatrix_gguf(out)


def llama_chunks(model: Model, text: str, chunks: int):
    """llama-imatrix's chunks of `text`: the whole text tokenized as the vocabulary adds special
    tokens, cut into CHUNK tokens, the last partial chunk dropped, and, where the vocabulary adds
    BOS (SmolLM2's does not), each chunk's first token replaced by BOS."""
    toks = model.tokenize(text, add_special=True)
    adds_bos = len(toks) > len(model.tokenize(text, add_special=False))
    out = []
    for i in range(min(len(toks) // CHUNK, chunks)):
        c = list(toks[i * CHUNK:(i + 1) * CHUNK])
        if adds_bos:
            c[0] = model.token_bos()
        out.append(c)
    return out


def compare(ours: imx.Imatrix, theirs: imx.Imatrix, by: str) -> dict:
    """Per tensor on both sides: the largest column difference relative to the largest column
    (by="sums": raw in_sum2; "importance": sum / count) and the counts' ratio."""
    rows = {}
    for name in sorted(set(ours.names()) & set(theirs.names())):
        a = ours.sums[name].astype(np.float64) if by == "sums" else ours.importance(name).astype(np.float64)
        b = theirs.sums[name].astype(np.float64) if by == "sums" else theirs.importance(name).astype(np.float64)
        rows[name] = {"rel_max": float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)),
                      "rel_l2": float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)),
                      "counts": [ours.counts[name], theirs.counts[name]]}
    rel = np.array([r["rel_max"] for r in rows.values()])
    l2 = np.array([r["rel_l2"] for r in rows.values()])
    worst = max(rows, key=lambda n: rows[n]["rel_max"]) if rows else None
    return {"by": by, "tensors": len(rows), "rel_max": {"median": float(np.median(rel)), "max": float(rel.max()),
                                                         "worst": worst},
            "rel_l2": {"median": float(np.median(l2)), "max": float(l2.max())},
            "counts_equal": sum(1 for r in rows.values() if r["counts"][0] == r["counts"][1]),
            "only_ours": sorted(set(ours.names()) - set(theirs.names())),
            "only_llama": sorted(set(theirs.names()) - set(ours.names())), "rows": rows}


def describe(title: str, c: dict) -> None:
    print(f"{title}: {c['tensors']} tensors on both sides ({c['by']}); relative difference, largest column: "
          f"median {c['rel_max']['median']:.2e}, max {c['rel_max']['max']:.2e} ({c['rel_max']['worst']}); "
          f"relative L2: median {c['rel_l2']['median']:.2e}, max {c['rel_l2']['max']:.2e}; counts equal on "
          f"{c['counts_equal']} of {c['tensors']}")
    if c["only_ours"]:
        print(f"  only the converter's: {', '.join(c['only_ours'])}")
    if c["only_llama"]:
        print(f"  only llama-imatrix's: {', '.join(c['only_llama'])}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="a model_zoo name (its F16) or an F16 path")
    ap.add_argument("--chunks", type=int, default=8, help="chunks of 512 tokens in the same-chunks comparison")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--tool", default=DEFAULT_TOOL)
    ap.add_argument("--same-only", action="store_true", help="only the same-chunks comparison")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if not os.path.exists(a.tool):
        ap.error(f"{a.tool} is missing: run ./scripts/build_llama_tools.sh llama-imatrix (or pass --tool)")
    f16 = f16_of(a.model)
    texts = imx.calibration_texts()
    text = "\n\n".join(texts)
    res = {"model": os.path.basename(f16), "chunk": CHUNK}
    with tempfile.TemporaryDirectory(prefix="imatrix-vs-llama-") as tmp:
        text_path = os.path.join(tmp, "calibration.txt")
        with open(text_path, "w") as f:
            f.write(text)
        model = Model(f16, n_ctx=CHUNK, n_batch=CHUNK, n_threads=a.threads, mode="backbone", repack=False)
        chunks = llama_chunks(model, text, a.chunks)
        ours = imx.collect_chunks(model, chunks, total=len(chunks), progress=False)
        del model
        theirs = llama_imatrix(a.tool, f16, text_path, os.path.join(tmp, "same.gguf"), a.threads, len(chunks))
        res["same_chunks"] = dict(compare(ours, theirs, "sums"), n_chunks=len(chunks))
        describe(f"{res['model']}, the same {len(chunks)} chunks of {CHUNK}", res["same_chunks"])
        if not a.same_only:
            conv = imx.collect_imatrix(f16, texts, n_threads=a.threads, progress=False)
            full = llama_imatrix(a.tool, f16, text_path, os.path.join(tmp, "all.gguf"), a.threads, -1)
            res["converter_chunking"] = dict(compare(conv, full, "importance"),
                                             tokens=[int(conv.n_tokens), int(full.n_tokens)])
            describe(f"{res['model']}, the converter's chunking ({conv.n_tokens} tokens, each text on its own) "
                     f"against llama-imatrix's ({full.n_tokens} tokens, chunks of {CHUNK})", res["converter_chunking"])
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
