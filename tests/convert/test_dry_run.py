"""`river-gguf convert --dry-run`: the plan of a conversion, before any work, and nothing written."""
import os
import subprocess
import sys

import pytest

from river_gguf.calibrate.cost_model import SCREEN, SEARCHED
from river_gguf.convert import dry_run
from river_gguf.convert.build import build_river_gguf
from river_gguf.presets import GRID_KEY, parse_grid
from river_gguf.eval.random_model import write_tiny_model
from river_gguf.gguf import io as gguf_io


def test_the_plan_is_what_the_conversion_does(tmp_path):
    src = write_tiny_model(tmp_path / "bb.gguf", "llama", n_layer=4, dtype="f16", seed=9)
    out = tmp_path / "out.gguf"
    plan = dry_run.plan_conversion(src, out, threshold=0.9, n_threads=1)
    assert sorted(os.listdir(tmp_path)) == ["bb.gguf"]  # nothing written, no temp left
    assert [s.name for s in plan.stages] == ["one pass over the input", "river", "backbone", "presets", "write"]
    assert all(s.seconds > 0 for s in plan.stages)
    assert plan.peak_bytes >= os.path.getsize(src)  # the input is mapped whole during its pass
    lines = plan.lines()
    assert lines[0].startswith("dry run:") and lines[-1].startswith("predicted:")

    # The settings it says are in play are the ones the conversion measures: every one it plans,
    # and of the tails it says are searched or screened those the search reaches; nothing else.
    meta = build_river_gguf(src, out, threshold=0.9, progress=False, n_threads=1)
    grid_rows = parse_grid(meta[GRID_KEY])
    measured = {r["options"] for r in grid_rows if "kld" in r}
    screened_rows = {r["options"] for r in grid_rows if r.get("scored") == "screened"}
    planned = {r["options"] for r in plan.settings if not r["why"]}
    searched = {r["options"] for r in plan.settings if r["why"] in (SEARCHED, SCREEN)}
    assert planned <= measured <= planned | searched and screened_rows <= searched
    assert any("not measured here" in line for line in lines)  # it names the constants it cannot measure


def test_the_plan_makes_the_conversions_decisions(tmp_path):
    """The dry run decides as the converter does (with convert.build's functions): "auto" keeps a
    quantized input's types (no backbone stage), imatrix None collects nothing, tau given and no
    presets need no pass over the input at all, tau to find needs the profile; a backbone type the
    converter refuses is refused with its message."""
    src = write_tiny_model(tmp_path / "bb.gguf", "llama", n_layer=2, dtype="f16", seed=6)
    q8 = gguf_io.quantize(src, tmp_path / "bb.q8_0.gguf", "q8_0", n_threads=1)
    out = tmp_path / "out.gguf"
    plan = dry_run.plan_conversion(q8, out, imatrix=None, presets=False, threshold=0.9, probe=False, n_threads=1)
    assert [s.name for s in plan.stages] == ["river", "write"]
    plan = dry_run.plan_conversion(src, out, imatrix=None, presets=False, probe=False, n_threads=1)
    assert [s.name for s in plan.stages] == ["one pass over the input", "river", "backbone", "write"]
    assert plan.stages[0].what.startswith("tau's profile")
    with pytest.raises(ValueError, match="backbone_type must be one of") as planned:
        dry_run.plan_conversion(src, out, backbone_type="q4_0", probe=False, n_threads=1)
    with pytest.raises(ValueError) as converted:
        build_river_gguf(src, out, backbone_type="q4_0", progress=False, n_threads=1)
    assert str(planned.value) == str(converted.value) and not out.exists()


def test_a_conversion_that_does_not_fit_says_so(tmp_path, monkeypatch):
    src = write_tiny_model(tmp_path / "bb.gguf", "llama", n_layer=2, dtype="f16", seed=3)
    monkeypatch.setattr(dry_run, "available_memory", lambda: 1 << 20)  # 1 MiB free
    plan = dry_run.plan_conversion(src, tmp_path / "out.gguf", threshold=0.9, presets=False, probe=False,
                                   n_threads=1)
    assert not plan.fits and plan.lines()[-1].startswith("warning:")
    assert [s.name for s in plan.stages] == ["one pass over the input", "river", "backbone", "write"]


def test_cli_dry_run(tmp_path):
    src = write_tiny_model(tmp_path / "bb.gguf", "llama", n_layer=2, dtype="f16", seed=4)
    out = tmp_path / "out.gguf"
    p = subprocess.run([sys.executable, "-m", "river_gguf.cli", "convert", str(src), "-o", str(out), "--dry-run",
                        "-t", "1", "--no-presets"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "predicted:" in p.stdout and "river: q4_k_m+imatrix" in p.stdout
    assert not out.exists() and sorted(os.listdir(tmp_path)) == ["bb.gguf"]
    p = subprocess.run([sys.executable, "-m", "river_gguf.cli", "convert", str(tmp_path / "missing.gguf"), "-o",
                        str(out), "--dry-run"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and p.stderr.startswith("error:") and "Traceback" not in p.stderr


def test_the_plan_counts_the_reference_rows_the_conversion_writes(tmp_path):
    # Oracle: the size of the reference rows' file the converter's pass writes.
    from river_gguf.convert import build

    src = write_tiny_model(tmp_path / "bb.gguf", "llama", n_layer=2, dtype="f16", seed=5)
    out = tmp_path / "out.gguf"
    plan = dry_run.plan_conversion(src, out, threshold=0.9, probe=False, calibration_tokens=256, n_threads=1)
    with build._CalibrationPass(str(src), str(tmp_path), 1, False, lambda line: None, imatrix=False, threshold=False,
                                presets=True, calibration_tokens=256, reference="F16") as calib:
        written = calib.reference.nbytes
    assert written > 0 and plan.reference_bytes == written
    # The peak beside the output: the river and the quantized backbone with the larger of the
    # reference rows (during the presets) and the output (while it is written).
    parts = plan.disk_parts
    assert parts["river"] > 0 and parts["backbone"] > 0
    assert plan.disk_bytes == parts["river"] + parts["backbone"] + max(written, parts["output"])
    assert any(line.startswith("disk:") and "reference rows" in line for line in plan.lines())
    # The converter's own check counts them the same way, bounding the items it will hold out.
    checked = build.disk_plan(str(src), build.open_reader(str(src)), "q4_k_m", "q8_0", None, True, True, 256, 1)
    assert checked["reference"] >= written and checked["river"] == parts["river"]
    assert checked["backbone"] == parts["backbone"] and checked["output"] == parts["output"]


class _Usage:
    def __init__(self, free):
        self.total, self.used, self.free = free, 0, free


def test_a_conversion_without_the_disk_says_so(tmp_path, monkeypatch):
    src = write_tiny_model(tmp_path / "bb.gguf", "llama", n_layer=2, dtype="f16", seed=3)
    monkeypatch.setattr(dry_run.shutil, "disk_usage", lambda p: _Usage(1 << 20))  # 1 MiB free
    plan = dry_run.plan_conversion(src, tmp_path / "out.gguf", threshold=0.9, probe=False, n_threads=1)
    assert not plan.fits_disk and "more disk" in plan.lines()[-1]
