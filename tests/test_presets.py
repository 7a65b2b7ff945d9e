"""Presets: named exit settings stored in a River GGUF, read back and applied; the default
converter path (imatrix river + measured presets) end to end on a tiny model."""
import json

import numpy as np
import pytest

from river_gguf import Model, presets
from river_gguf.convert.build import build_river_gguf
from river_gguf.gguf_meta import set_river_metadata
from river_gguf.testing import write_tiny_model


@pytest.fixture(scope="module")
def tiny_river(tmp_path_factory):
    d = tmp_path_factory.mktemp("presets")
    bb = write_tiny_model(d / "bb.gguf", "llama", n_layer=6, dtype="f16", seed=5)
    out = d / "bb.river.gguf"
    build_river_gguf(bb, out, river_type="q4_0", threshold=0.9, progress=False, imatrix=None, presets=False)
    return str(out)


STORED = {
    "fast": {"options": {"mode": "river-only", "tail": 1, "river_head": True}, "ppl": 9.0},
    "balanced": {"options": {"mode": "river", "threshold": 0.5, "min_exit_layer": 1, "tail": 2,
                             "river_head": False}, "ppl": 8.0},
    "quality": {"options": {"mode": "backbone"}, "ppl": 7.0},
}


def test_presets_read_back_and_applied(tiny_river, tmp_path):
    path = tmp_path / "with-presets.gguf"
    path.write_bytes(open(tiny_river, "rb").read())
    set_river_metadata(str(path), {presets.PRESET_KEY: presets.dump(STORED), presets.DEFAULT_KEY: "balanced"})
    m = Model(str(path), n_ctx=64, n_threads=1)
    assert m.presets == STORED and m.preset == "balanced"
    o = m.exit_options
    assert (o.mode, o.threshold, o.min_exit_layer, o.tail, o.river_head) == ("river", 0.5, 1, 2, False)
    toks = m.tokenize("a b c d e f g")
    # A per-call preset is the same as spelling out its options.
    a = m.score(toks, prefix=2, preset="fast")
    b = m.score(toks, prefix=2, mode="river-only", tail=1, river_head=True)
    assert np.array_equal(a.logprobs, b.logprobs)
    c = m.score(toks, prefix=2, preset="quality")
    d = m.score(toks, prefix=2, mode="backbone")
    assert np.array_equal(c.logprobs, d.logprobs) and not np.array_equal(a.logprobs, c.logprobs)
    # Explicit options override the preset, and the constructor picks another preset.
    assert Model(str(path), n_ctx=64, n_threads=1, preset="balanced", tail=0).exit_options.tail == 0
    fast = Model(str(path), n_ctx=64, n_threads=1, preset="fast")
    assert (fast.exit_options.mode, fast.exit_options.tail) == ("river-only", 1)
    with pytest.raises(ValueError, match="unknown preset 'turbo'"):
        Model(str(path), n_ctx=64, n_threads=1, preset="turbo")
    with pytest.raises(ValueError, match="stores no presets"):
        Model(tiny_river, n_ctx=64, n_threads=1, preset="fast")


def test_malformed_presets_refused(tiny_river, tmp_path):
    path = tmp_path / "bad.gguf"
    path.write_bytes(open(tiny_river, "rb").read())
    set_river_metadata(str(path), {presets.PRESET_KEY: json.dumps({"fast": {"options": {"warp": 9}}})})
    from river_gguf import GGUFFormatError

    with pytest.raises(GGUFFormatError, match="unknown options"):  # a damaged file, named as such
        Model(str(path), n_ctx=64, n_threads=1)


def test_choose_picks_best_quality_per_speed_tier():
    rows = [{"options": {"i": i}, "ppl": p, "relative_time": c} for i, (p, c) in
            enumerate([(10.0, 1.0), (9.0, 1.01), (8.5, 1.05), (8.0, 1.35), (7.5, 1.6), (7.0, 3.0)])]
    got = presets.choose(rows)
    assert [got[n]["options"]["i"] for n in ("fast", "balanced", "quality")] == [1, 3, 4]


def test_step_time_model_is_a_line_in_backbone_layers(tiny_river):
    m = Model(tiny_river, n_ctx=128, n_threads=1)
    t = presets.step_time_model(m, m.tokenize("a b c d e f"), tails=(0, 1, 2), n=8, rounds=1)
    rel = t["relative_time"]
    assert t["tails"] == [0, 1, 2] and len(t["seconds"]) == 3 and all(s > 0 for s in t["seconds"])
    assert t["a_s"] > 0 and t["b_s_per_layer"] >= 0
    assert rel(0) == pytest.approx(1.0)
    assert rel(2) - rel(1) == pytest.approx(rel(1) - rel(0))  # a straight line
    # least squares: the fitted line passes through the mean of the measured points
    assert t["a_s"] + t["b_s_per_layer"] * 1.0 == pytest.approx(float(np.mean(t["seconds"])), rel=1e-9) or \
        t["b_s_per_layer"] == 0


def test_backbone_layers_per_step():
    L = 30
    assert presets.backbone_layers_per_step(L, -1, 0) == 0  # river-only
    assert presets.backbone_layers_per_step(L, -1, 12) == 12  # river-only + tail
    assert presets.backbone_layers_per_step(L, 5.5, 4) == pytest.approx(6.5 + 4)  # dynamic exit + tail
    assert presets.backbone_layers_per_step(L, L - 1, 4) == L  # never exited: the whole backbone
    assert presets.backbone_layers_per_step(L, 27.0, 4) == L  # exit inside the tail: still L


def test_step_bytes_counts_each_layer_once():
    layers = [{"backbone": 10, "river": 3} for _ in range(4)]
    head = {"backbone": 100, "river": 40}
    assert presets.step_bytes(layers, head, 4, -1, 0, True) == 4 * 3 + 40
    assert presets.step_bytes(layers, head, 4, -1, 2, True) == 2 * 3 + 2 * 10 + 40
    assert presets.step_bytes(layers, head, 4, 3, 0, True) == 4 * 10 + 100  # never exited: backbone head
    assert presets.step_bytes(layers, head, 4, 0.5, 0, False) == pytest.approx(1 * 10 + 0.5 * 10 + 0.5 * 3 + 2 * 3 + 100)


def test_default_convert_makes_imatrix_river_and_presets(tmp_path):
    bb = write_tiny_model(tmp_path / "bb.gguf", "llama", n_layer=4, dtype="f16", seed=9)
    out = tmp_path / "m.river.gguf"
    meta = build_river_gguf(bb, out, threshold=0.9, progress=False)  # defaults: imatrix auto, presets on
    assert meta["river.imatrix"].startswith("collected") and meta["river.imatrix_tokens"] > 1000
    m = Model(str(out), n_ctx=128, n_threads=1)
    assert set(m.presets) == set(presets.NAMES) and m.preset == "balanced"
    for name, p in m.presets.items():
        assert p["relative_time"] <= p["tier"] + 1e-9 and np.isfinite(p["ppl"])
    assert m.exit_options.tail == m.presets["balanced"]["options"]["tail"]
    grid = json.loads(m.metadata[presets.GRID_KEY])  # every measured setting, for re-choosing tiers
    assert len(grid) == len(presets.grid(m.n_layer))
    assert presets.choose(grid)["fast"]["options"] == m.presets["fast"]["options"]


def test_static_settings_scored_in_one_pass_match_decode(tiny_river):
    # The batched shortcut for river-only settings computes what teacher-forced decoding does, up
    # to summation order (batched mat-mul and tiled attention kernels vs the single-token ones):
    # ~1e-4 relative on this random model's huge perplexity, far below the gaps between settings.
    from river_gguf.eval import report as evaluate
    from river_gguf.presets import _static_perplexity

    m = Model(tiny_river, n_ctx=128, n_threads=1)
    toks = m.tokenize("the quick brown fox jumps over the lazy dog " * 3)
    prepared = [(toks, 5)]
    for tail in (0, 2):
        opts = dict(mode="river-only", tail=tail, river_head=True, exit_layer=None)
        decoded = evaluate.score_items(m, prepared, **opts).perplexity
        assert _static_perplexity(m, prepared, opts) == pytest.approx(decoded, rel=1e-3)
