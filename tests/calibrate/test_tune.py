"""`river-gguf tune`: the presets chosen again from speeds timed on this machine; and the
converter's calibration budget (--calibration-tokens)."""
import hashlib
import json
import pathlib

import pytest

from river_gguf import Model, presets
from river_gguf.calibrate import cost_model
from river_gguf.calibrate import tune as tune_mod
from river_gguf.convert import build
from river_gguf.eval.random_model import write_tiny_model
from river_gguf.gguf.reader import GGUFReader


@pytest.fixture(scope="module")
def tuned_pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("tune")
    bb = write_tiny_model(d / "bb.gguf", "llama", n_layer=4, dtype="f16", seed=11)
    out = d / "m.river.gguf"
    meta = build.build_river_gguf(bb, out, threshold=0.9, progress=False, calibration_tokens=32, n_threads=1)
    return str(out), meta


def _tensor_digest(path):
    r = GGUFReader(path)
    h = hashlib.sha256()
    for t in r.tensors:
        h.update(t.name.encode())
        h.update(bytes(t.data))
    return h.hexdigest()


def test_calibration_tokens_bound_the_preset_scoring(tuned_pair):
    path, meta = tuned_pair
    # 32 tokens a static setting: items of at most 16 scored tokens until they hold 32.
    assert 32 <= meta["river.presets_calibration_tokens"] < 32 + 16
    assert build.preset_score_tokens(32) == 16 and build.preset_score_tokens(128) == 64
    assert build.preset_score_tokens(1024) == 128
    with pytest.raises(ValueError, match="calibration_tokens"):
        build.build_river_gguf(path, str(pathlib.Path(path).with_name("x.gguf")), calibration_tokens=4,
                               progress=False, replace_river=True)


def test_default_calibration_is_768_tokens_at_every_size():
    # Static settings are scored at prefill speed, so an 8B gets what SmolLM2 gets.
    for size in (270_000_000, 1e9, 16_000_000_000):
        assert build.calibration_token_budget(size) == 768


def test_tune_rechooses_from_timed_grid_and_changes_no_tensor(tuned_pair, tmp_path):
    path, _ = tuned_pair
    copy = tmp_path / "t.river.gguf"
    copy.write_bytes(pathlib.Path(path).read_bytes())
    before = _tensor_digest(str(copy))
    grid = json.loads(Model(str(copy), n_ctx=64, n_threads=1).metadata[presets.GRID_KEY])
    res = tune_mod.tune(str(copy), n_threads=1, tokens=8, rounds=1, progress=False)
    m = Model(str(copy), n_ctx=64, n_threads=1)
    assert _tensor_digest(str(copy)) == before  # metadata only
    assert json.loads(m.metadata[presets.GRID_KEY]) == grid  # the measured KLDs are kept
    anchors = json.loads(m.metadata[presets.ANCHORS_KEY])
    assert anchors["measure"] == "timed" and set(anchors["seconds_per_step"]) == {"q4_0", "q4_k_m", "q8_0"}
    rows = presets.parse_grid(m.metadata[presets.GRID_KEY])
    options = [r["options"] for r in rows]
    assert set(m.presets) == set(presets.NAMES)
    for name, p in m.presets.items():
        if p.setting.options.mode == "lossless":  # only where it was predicted to beat the backbone
            assert res["lossless"]["pays"] and p.measured["kld"] == 0.0
            assert p.setting.options.draft_max == res["lossless"]["draft_max"]
        else:
            assert p.setting in options and p.measured["kld"] == rows[options.index(p.setting)]["kld"]
    # Lossless mode is priced from timed costs and the grid's acceptance, and said so.
    lossless = res["lossless"]
    assert set(lossless["costs"]) == {"step", "draft", "verify", "context"} and 0 <= lossless["acceptance"] <= 1
    assert lossless["costs"]["context"] > 0  # the positions the costs were timed after
    assert lossless["line"].startswith("lossless") and str(lossless["draft_max"]) in lossless["line"]
    # The stored choice is cost_model.choose on the timed rows and bounds: a pure function of them.
    again = cost_model.choose(res["rows"], anchors["bounds"])
    assert {n: p.setting for n, p in again.items()} == {n: p.setting for n, p in m.presets.items()}
    assert json.loads(m.metadata[tune_mod.TUNED_KEY])["rounds"] == 1


def test_tune_refuses_a_file_without_a_grid(tmp_path):
    bb = write_tiny_model(tmp_path / "bb.gguf", "llama", n_layer=2, dtype="f16", seed=3)
    out = tmp_path / "m.river.gguf"
    build.build_river_gguf(bb, out, threshold=0.9, progress=False, presets=False, imatrix=None, n_threads=1)
    with pytest.raises(ValueError, match="no measured preset grid"):
        tune_mod.tune(str(out), n_threads=1, tokens=8, rounds=1, progress=False)
    with pytest.raises(ValueError, match="rounds"):
        tune_mod.tune(str(out), rounds=0, progress=False)


def test_tune_cli_dry_run_writes_nothing(tuned_pair, tmp_path, capsys):
    from river_gguf import cli

    path, _ = tuned_pair
    copy = tmp_path / "t.river.gguf"
    copy.write_bytes(pathlib.Path(path).read_bytes())
    before = copy.read_bytes()
    assert cli.main(["tune", str(copy), "-t", "1", "--tokens", "8", "--rounds", "1", "--dry-run", "-q"]) == 0
    out = capsys.readouterr().out
    assert "llama.cpp Q8_0" in out and "preset balanced" in out and "not written" in out
    assert copy.read_bytes() == before
    assert cli.main(["tune", str(tmp_path / "missing.gguf"), "-q"]) == 2


def test_tune_all_measures_the_whole_grid_against_its_reference(tuned_pair, tmp_path):
    """tune --all measures every setting of the grid, the ones the conversion left out included,
    and times them all; given the F16 (--reference) every row is measured against it and says so,
    and the grid stored afterwards is that one (the file's tensors untouched)."""
    path, meta = tuned_pair
    f16 = str(pathlib.Path(path).with_name(meta["river.backbone_file"]))
    copy = tmp_path / "t.river.gguf"
    copy.write_bytes(pathlib.Path(path).read_bytes())
    before = _tensor_digest(str(copy))
    stored = json.loads(Model(str(copy), n_ctx=64, n_threads=1).metadata[presets.GRID_KEY])
    assert any("kld" not in r for r in stored)  # the conversion left settings out
    res = tune_mod.tune(str(copy), n_threads=1, tokens=8, rounds=1, progress=False, reference=f16,
                        calibration_tokens=32)
    timed = [r for r in res["rows"] if r["options"].options.mode != "lossless"]
    assert len(timed) == len(stored) and all(r["reference"] == "F16" and "seconds_per_step" in r for r in timed)
    n_layer = Model(str(copy), n_ctx=64, n_threads=1).n_layer
    assert [r["options"] for r in timed] == cost_model.grid(n_layer)  # every setting of the grid, in its order
    m = Model(str(copy), n_ctx=64, n_threads=1)
    grid = json.loads(m.metadata[presets.GRID_KEY])
    assert all("kld" in r and r["reference"] == "F16" for r in grid) and res["reference"] == "F16"
    assert _tensor_digest(str(copy)) == before
    with pytest.raises(FileNotFoundError):
        tune_mod.tune(str(copy), n_threads=1, tokens=8, rounds=1, progress=False, reference=str(tmp_path / "no.gguf"))


def test_tune_all_against_the_files_backbone(tuned_pair, tmp_path, monkeypatch):
    """`tune --all` without a reference: every setting of the grid measured against the file's
    own backbone (the backbone's row at KLD 0), timed, and stored with that label; the command
    line's --all asks for it."""
    from river_gguf.cli import tune_cmd

    path, _ = tuned_pair
    copy = tmp_path / "t.river.gguf"
    copy.write_bytes(pathlib.Path(path).read_bytes())
    res = tune_mod.tune(str(copy), n_threads=1, tokens=8, rounds=1, progress=False, measure=True,
                        calibration_tokens=32)
    timed = [r for r in res["rows"] if r["options"].options.mode != "lossless"]
    m = Model(str(copy), n_ctx=64, n_threads=1)
    assert [r["options"] for r in timed] == cost_model.grid(m.n_layer)
    assert all(r["reference"] == "backbone" and r["seconds_per_step"] > 0 for r in timed)
    assert next(r for r in timed if r["options"].options.mode == "backbone")["kld"] == 0.0
    stored = presets.parse_grid(m.metadata[presets.GRID_KEY])
    assert [r["options"] for r in stored] == cost_model.grid(m.n_layer)
    assert all(r.get("kld") is not None and r["reference"] == "backbone" for r in stored)
    assert json.loads(m.metadata[tune_mod.TUNED_KEY])["measured"] is True
    # The command line: --all measures, --reference measures against the file given.
    asked = []
    monkeypatch.setattr(tune_cmd, "tune", lambda *a, **k: asked.append(k) or res)
    from river_gguf import cli

    assert cli.main(["tune", str(copy), "--all", "-q", "--dry-run"]) == 0
    assert cli.main(["tune", str(copy), "--reference", "f16.gguf", "-q", "--dry-run"]) == 0
    assert [(k["measure"], k["reference"]) for k in asked] == [(True, None), (False, "f16.gguf")]
