"""Random-weight models of the shapes users run, for timing what does not depend on the weights
(a decode step, a batch, a conversion) and for the GPU run on a machine where no real model can
travel (scripts/gpu_device_run.sh).

    .venv/bin/python benchmarks/random_models.py --shape smollm2-135m [--quants q8_0,q4_k_m,q4_0]
        [--river q4_0] [--out DIR] [-t THREADS]

Writes into DIR (default RIVER_GGUF_CACHE): random-SHAPE.f16.gguf
(river_gguf.eval.random_model.write_random_shape, F16, with SmolLM2's tokenizer or $RIVER_GGUF_TOKENIZER's), its static quants made by llama.cpp's
quantizer, and a River GGUF of the F16 backbone with a river of --river's type (no importance
matrix, no presets, tau 0.97), each only if missing. Prints {"f16": path, "q4_0": path, ...,
"river": path} as JSON on stdout.
"""
import argparse
import json
import os
import sys

try:  # an installed river_gguf (the checkout's python/ has no native module)
    import river_gguf  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

from river_gguf.convert.build import build_river_gguf  # noqa: E402
from river_gguf.default_model import cache_dir  # noqa: E402
from river_gguf.gguf.io import quantize  # noqa: E402
from river_gguf.eval.random_model import RANDOM_SHAPES, write_random_shape  # noqa: E402


def make(shape: str, quants, river_type: str, out: str, threads: int) -> dict:
    os.makedirs(out, exist_ok=True)
    files = {"f16": os.path.join(out, f"random-{shape}.f16.gguf")}
    if not os.path.exists(files["f16"]):
        write_random_shape(files["f16"], shape)
    for q in quants:
        files[q] = os.path.join(out, f"random-{shape}.{q}.gguf")
        if not os.path.exists(files[q]):
            quantize(files["f16"], files[q], q, n_threads=threads)
    if river_type:
        files["river"] = os.path.join(out, f"random-{shape}.f16+{river_type}.river.gguf")
        if not os.path.exists(files["river"]):
            build_river_gguf(files["f16"], files["river"], river_type=river_type, backbone_type="f16", imatrix=None,
                             presets=False, threshold=0.97, progress=False, n_threads=threads)
    return files


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", required=True, choices=sorted(RANDOM_SHAPES))
    ap.add_argument("--quants", default="q8_0,q4_k_m,q4_0")
    ap.add_argument("--river", default="q4_0", help="the river's type ('' for no River GGUF)")
    ap.add_argument("--out", default=None)
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 2)
    a = ap.parse_args(argv)
    files = make(a.shape, [q for q in a.quants.split(",") if q], a.river, a.out or str(cache_dir()), a.threads)
    print(json.dumps(files))
    return 0


if __name__ == "__main__":
    sys.exit(main())
