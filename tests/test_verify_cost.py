"""benchmarks/verify_cost.py on tiny models: it times each batch size in both kernels and writes
them; a file whose backbone the CPU repacks (no decode kernels there) is refused with a message."""
import json
import os
import runpy

import pytest

from support import THREADS

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "verify_cost.py")


def test_it_times_each_size_in_both_kernels(tiny, tmp_path):
    path = tiny.model("qwen2", n_layer=2, n_embd=128, n_head=4, n_head_kv=2, n_ff=256, dtype="f16", seed=11)
    out = tmp_path / "cost.json"
    main = runpy.run_path(SCRIPT)["main"]
    assert main([path, "--sizes", "2,3", "--context", "20", "--reps", "4", "-t", str(THREADS),
                 "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert [r["n"] for r in got["rows"]] == [2, 3]
    assert got["step_s"] > 0 and all(r["batch_s"] > 0 and r["decode_s"] > 0 for r in got["rows"])


def test_a_repacked_backbone_is_refused(q4_0_path):
    main = runpy.run_path(SCRIPT)["main"]
    with pytest.raises(SystemExit, match="decode kernels"):
        main([q4_0_path, "--sizes", "2", "--reps", "3", "-t", str(THREADS)])
