"""benchmarks/batch_exit_quality.py at a tiny size: its teacher-forced rows are the backbone's
where nothing exits, and its table says what the batches held."""
import json
import os
import runpy

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "batch_exit_quality.py")
# A step waits up to a second for the other sequence's (the default 50 ms window is a benchmark's:
# on a loaded machine, a test worker's other thread may come later, and every step would run alone).
ARGS = ["--items", "2", "--prompt-tokens", "8,12", "--tokens", "5", "--sizes", "1,2", "--threads", "1",
        "--step-window", "1.0"]


def _run(path, tmp_path, preset):
    out = tmp_path / f"{preset}.json"
    main = runpy.run_path(SCRIPT)["main"]
    assert main(["--model", path, "--preset", preset, "--json", str(out), *ARGS]) == 0
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def tiny_river(tiny):
    return tiny.river("llama", model=dict(n_layer=4, seed=3))


def test_backbone_rows_equal_the_reference_and_batches_hold_two_steps(tiny_river, tmp_path):
    """mode=backbone: alone, every row is the reference's own (KLD 0, same top everywhere); two
    sequences in a batch stay within the batched kernels' rounding."""
    r = _run(tiny_river, tmp_path, "backbone")
    one, two = r["rows"]
    assert (one["n"], two["n"]) == (1, 2)
    assert one["n_tokens"] == two["n_tokens"] == 2 * 4
    assert one["mean_exit_layer"] == two["mean_exit_layer"] == r["n_layer"] - 1
    assert one["kld"] == 0.0 and one["same_top"] == 1.0
    assert 0.0 <= two["kld"] < 1e-3 and two["same_top"] == 1.0
    assert one["steps_per_batch"] == 1.0
    assert 1.0 < two["steps_per_batch"] <= 2.0


def test_dynamic_exit_table(tiny_river, tmp_path):
    """The file's own tau: exits may come early, KLDs are non-negative, intervals hold the point."""
    r = _run(tiny_river, tmp_path, "file")
    for row in r["rows"]:
        assert 0 <= row["mean_exit_layer"] <= r["n_layer"] - 1
        assert row["kld_ci"][0] <= row["kld"] <= row["kld_ci"][1] and row["kld"] >= 0
        assert row["same_top_ci"][0] <= row["same_top"] <= row["same_top_ci"][1]
