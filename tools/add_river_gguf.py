#!/usr/bin/env python3
"""Add an exit river to a GGUF: write a River GGUF.

    python tools/add_river_gguf.py BACKBONE.gguf -o MODEL.river.gguf [--river-type q4_k_m|q4_0|q3_k_m|...]
        [--river EXISTING.gguf] [--threshold 0.97] [--min-exit-layer N] [--river-head/--no-river-head]
        [--prefill backbone|river] [--tail N] [--imatrix auto|none|FILE] [--backbone-type auto|f16|q8_0]
        [--presets/--no-presets] [--replace-river] [--dry-run] [--threads N]

The default is a Q8_0 backbone and a river of build.py's DEFAULT_RIVER_TYPE (Q4_K_M) quantized by
llama.cpp with an importance matrix collected from the input's activations on the calibration
split, and the file stores measured fast/balanced/quality presets (see river_gguf/convert/build.py and
river_gguf/calibrate/cost_model.py; the options are river_gguf/cli/convert_cmd.py's). --dry-run
prints the plan, the predicted time and peak memory, and writes nothing. Errors print a message to
stderr and exit with status 2; Ctrl-C exits with status 130 and leaves no file behind.
Same as ``river-gguf convert``.
"""
import os
import sys

try:
    import river_gguf  # noqa: F401
except ImportError:  # a checkout without an install: use ../python
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "python"))

if __name__ == "__main__":
    try:
        from river_gguf.cli.convert_cmd import main

        sys.exit(main())
    except KeyboardInterrupt:  # Ctrl-C before the conversion started (main() handles it after)
        print("add_river_gguf.py: interrupted", file=sys.stderr)
        sys.exit(130)
