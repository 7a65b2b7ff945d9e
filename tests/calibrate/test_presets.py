"""Presets: named exit settings stored in a River GGUF, read back and applied; the default
converter path (imatrix river + measured presets) end to end on a tiny model."""
import json

import numpy as np
import pytest

from river_gguf import Model, presets
from river_gguf.options import ExitOptions
from river_gguf.calibrate import cost_model, preset_grid
from river_gguf.convert.build import DEFAULT_BACKBONE_TYPE, build_river_gguf
from river_gguf.gguf.meta import set_river_metadata
from river_gguf.eval.random_model import write_tiny_model
from river_gguf.gguf.reader import GGUFReader
from river_gguf.measure.teacher import score


@pytest.fixture(scope="module")
def tiny_river(tiny):
    return tiny.river("llama", dict(n_layer=6, dtype="f16", seed=5), backbone_type=DEFAULT_BACKBONE_TYPE)


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
    assert {n: p.to_json() for n, p in m.presets.items()} == STORED and m.preset == "balanced"
    assert m.presets["balanced"].setting.options == ExitOptions(mode="river", threshold=0.5, min_exit_layer=1,
                                                                tail=2, river_head=False)
    o = m.exit_options
    assert (o.mode, o.threshold, o.min_exit_layer, o.tail, o.river_head) == ("river", 0.5, 1, 2, False)
    toks = m.tokenize("a b c d e f g")
    # A per-call preset is the same as spelling out its options.
    a = score(m, toks, prefix=2, preset="fast")
    b = score(m, toks, prefix=2, mode="river-only", tail=1, river_head=True)
    assert np.array_equal(a.logprobs, b.logprobs)
    c = score(m, toks, prefix=2, preset="quality")
    d = score(m, toks, prefix=2, mode="backbone")
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


BOUNDS = {"fast": 1.05, "balanced": 1.4, "quality": 2.0}


def _tail(i: int) -> presets.Setting:
    """Row i's setting (a river-only tail of i layers: one setting per row)."""
    return presets.Setting.of(mode="river-only", tail=i)


def _rows():
    return [{"options": _tail(i), "kld": k, "relative_cost": c} for i, (k, c) in
            enumerate([(0.30, 1.0), (0.25, 1.01), (0.22, 1.05), (0.10, 1.35), (0.05, 1.6), (0.0, 3.0)])]


def test_choose_picks_lowest_kld_per_byte_tier():
    got = cost_model.choose(_rows(), BOUNDS)
    assert [got[n].setting.options.tail for n in ("fast", "balanced", "quality")] == [2, 3, 4]
    assert not any("same_as" in p.measured for p in got.values())
    assert got["balanced"].measured["tier"] == 1.4


def test_preset_choice_is_deterministic_for_a_fixed_grid():
    """The same measurements give the same presets, byte for byte; ties go to the cheaper row,
    then to the one listed first."""
    rows = _rows() + [{"options": _tail(9), "kld": 0.10, "relative_cost": 1.2}]  # ties row 3, cheaper
    a = presets.dump(cost_model.choose(rows, BOUNDS))
    assert all(presets.dump(cost_model.choose([dict(r) for r in rows], BOUNDS)) == a for _ in range(3))
    assert cost_model.choose(rows, BOUNDS)["balanced"].setting == _tail(9)
    # A higher tier that finds nothing better says so instead of silently repeating a setting.
    flat = [{"options": _tail(0), "kld": 0.1, "relative_cost": 1.0},
            {"options": _tail(1), "kld": 0.2, "relative_cost": 1.3}]
    got = cost_model.choose(flat, BOUNDS)["quality"]
    assert got.setting == _tail(0) and got.measured["same_as"] == "fast" and got.measured["why"]
    # No row within a tier: the cheapest.
    cheapest = cost_model.choose([{"options": _tail(0), "kld": 0.0, "relative_cost": 5.0}], BOUNDS)["fast"]
    assert cheapest.measured["relative_cost"] == 5.0


# As a converter and `tune` wrote them before presets were read into ExitOptions: compact JSON,
# keys sorted, each setting naming only some fields.
OLD_PRESETS = (
    '{"balanced":{"cost":1.0,"kld":0.05,"options":{"min_exit_layer":0,"mode":"river","river_head":true,"tail":2,'
    '"threshold":0.98},"relative_cost":1.3,"tier":1.4},"fast":{"options":{"mode":"river-only","river_attention":'
    '"backbone","river_head":true,"tail":4},"relative_cost":1.0,"tier":1.05},"quality":{"kld":0.0,"options":'
    '{"draft_max":4,"mode":"lossless"},"same_as":"balanced","why":"cheaper"}}')
OLD_GRID = ('[{"kld":0.0,"options":{"mode":"backbone","river_head":false,"tail":0}},{"kld":0.2,"options":'
            '{"exit_rule":"cosine","min_exit_layer":0,"mode":"river","river_head":true,"tail":0,"threshold":0.97}}]')


def test_stored_presets_are_exit_options_and_old_files_read_and_write_alike():
    """A stored preset and grid row read into a Setting: an ExitOptions whose unnamed fields take
    ExitOptions' defaults, and the fields it names. Written back, the JSON is the same, byte for
    byte, so files written before still load and a re-chosen file keeps its keys."""
    got = presets.parse({presets.PRESET_KEY: OLD_PRESETS})
    assert got["balanced"].setting.options == ExitOptions(mode="river", threshold=0.98, tail=2, river_head=True)
    assert got["fast"].setting.options.river_attention == "backbone" and got["fast"].setting.options.threshold == \
        ExitOptions().threshold
    assert got["quality"].setting.options == ExitOptions(mode="lossless", draft_max=4)
    assert got["quality"].setting.names == ("mode", "draft_max") and got["quality"].measured["same_as"] == "balanced"
    assert presets.dump(got) == OLD_PRESETS
    rows = presets.parse_grid(OLD_GRID)
    assert [r["options"].options.mode for r in rows] == ["backbone", "river"] and rows[1]["kld"] == 0.2
    assert presets.dump(rows) == OLD_GRID
    # What a preset sets over a Model's defaults is what it names; run whole, the rule and tail too.
    assert got["quality"].setting.named() == {"mode": "lossless", "draft_max": 4}
    assert got["quality"].setting.call_options() == {"exit_rule": "cosine", "tail": 0, "min_exit_layer": 0,
                                                      "river_attention": "river", "mode": "lossless", "draft_max": 4}
    with pytest.raises(ValueError, match="unknown"):
        presets.parse_grid('[{"options":{"warp":9}}]')
    with pytest.raises(ValueError, match="JSON object"):
        presets.parse_grid('[{"options":[1]}]')


def test_anchor_bytes_match_llama_cpp_files(f16_path, derived):
    """static_step_bytes applies llama.cpp's type choice: the bytes it predicts per decode step
    are those of the files llama.cpp's quantizer makes from the same F16 (SmolLM2, whose 576-wide
    rows send Q4_K/Q6_K to their Q5_0/Q8_0 fallbacks)."""
    shapes = {t.name: tuple(int(x) for x in t.shape) for t in GGUFReader(f16_path).tensors}
    for kind in ("q4_0", "q4_k_m", "q8_0"):
        r = GGUFReader(derived(kind))
        sizes = {t.name: int(t.n_bytes) for t in r.tensors}
        head = "output.weight" if "output.weight" in sizes else "token_embd.weight"
        real = sum(n for name, n in sizes.items() if name.startswith("blk.") and name.endswith(".weight")
                   and len(shapes[name]) == 2) + sizes[head]
        assert cost_model.static_step_bytes(shapes, 30, kind) == pytest.approx(real, rel=1e-9), kind


def test_anchor_costs_match_llama_cpp_files(f16_path, derived):
    """The cost measure of the anchors is that of the files llama.cpp makes: each weight's type
    cost and one mat-mul node per weight (llama.cpp joins nothing)."""
    shapes = {t.name: tuple(int(x) for x in t.shape) for t in GGUFReader(f16_path).tensors}
    for kind in ("q4_0", "q4_k_m", "q8_0"):
        r = GGUFReader(derived(kind))
        names = {t.name for t in r.tensors}
        head = "output.weight" if "output.weight" in names else "token_embd.weight"
        real = sum(cost_model.type_cost(t.tensor_type.name, int(np.prod(shapes[t.name]))) + cost_model.NODE_COST
                   for t in r.tensors if (t.name.startswith("blk.") and t.name.endswith(".weight")
                                          and len(shapes[t.name]) == 2) or t.name == head)
        assert cost_model.static_step_bytes(shapes, 30, kind, "cost") == pytest.approx(real, rel=1e-9), kind
    # Cost orders the anchors as their speed does: Q4_0 < Q4_K_M < Q8_0 < F16-like.
    c = {k: cost_model.static_step_bytes(shapes, 30, k, "cost") for k in ("q4_0", "q4_k_m", "q8_0")}
    assert c["q4_0"] < c["q4_k_m"] < c["q8_0"]


def test_layer_nodes_join_only_weights_of_one_type():
    q8 = {k: "Q8_0" for k in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}
    assert cost_model._layer_nodes(q8) == 4  # QKV, output, gate+up, down
    mixed = dict(q8, attn_q="Q5_0", attn_k="Q5_0")  # llama.cpp's Q4_K_M on 576-wide rows: attn_v stays Q8_0
    assert cost_model._layer_nodes(mixed) == 6
    assert cost_model._layer_nodes(mixed, cost_model.ATTENTION_KINDS) == 4
    assert cost_model._layer_nodes(q8, cost_model.ATTENTION_KINDS) == 2
    assert cost_model.type_cost("Q8_0", 10) == 10 and cost_model.type_cost("Q4_0", 100) == pytest.approx(65)
    assert cost_model.type_cost("Q2_K", 85) == pytest.approx(8 * 84 / 256 / 8.5 * 85)  # unlisted: by bits


def test_backbone_layers_per_step():
    L = 30
    assert cost_model.backbone_layers_per_step(L, -1, 0) == 0  # river-only
    assert cost_model.backbone_layers_per_step(L, -1, 12) == 12  # river-only + tail
    assert cost_model.backbone_layers_per_step(L, 5.5, 4) == pytest.approx(6.5 + 4)  # dynamic exit + tail
    assert cost_model.backbone_layers_per_step(L, L - 1, 4) == L  # never exited: the whole backbone
    assert cost_model.backbone_layers_per_step(L, 27.0, 4) == L  # exit inside the tail: still L


def test_step_bytes_counts_each_layer_once():
    layers = [{"backbone": 10, "river": 3} for _ in range(4)]
    head = {"backbone": 100, "river": 40}
    assert cost_model.step_bytes(layers, head, 4, -1, 0, True) == 4 * 3 + 40
    assert cost_model.step_bytes(layers, head, 4, -1, 2, True) == 2 * 3 + 2 * 10 + 40
    assert cost_model.step_bytes(layers, head, 4, 3, 0, True) == 4 * 10 + 100  # never exited: backbone head
    assert cost_model.step_bytes(layers, head, 4, 0.5, 0, False) == pytest.approx(1 * 10 + 0.5 * 10 + 0.5 * 3 + 2 * 3 + 100)
    # With the backbone's attention, a river layer reads its FFN and the backbone's attention.
    mixed = [dict(l, backbone_attention=4, river_attention=1) for l in layers]
    assert cost_model.step_bytes(mixed, head, 4, -1, 0, True, "backbone") == 4 * (3 - 1 + 4) + 40
    assert cost_model.step_bytes(mixed, head, 4, -1, 1, True, "backbone") == 3 * 6 + 10 + 40


def test_default_convert_makes_imatrix_river_and_presets(tmp_path):
    bb = write_tiny_model(tmp_path / "bb.gguf", "llama", n_layer=4, dtype="f16", seed=9)
    out = tmp_path / "m.river.gguf"
    meta = build_river_gguf(bb, out, threshold=0.9, progress=False)  # defaults: imatrix auto, presets on
    assert meta["river.imatrix"].startswith("collected") and meta["river.imatrix_tokens"] > 1000
    m = Model(str(out), n_ctx=128, n_threads=1)
    assert set(m.presets) == set(presets.NAMES) and m.preset == "balanced"
    for name, preset in m.presets.items():
        p = preset.measured
        # Within its tier, or the file says why not (no setting of this file is that cheap).
        assert p["relative_cost"] <= p["tier"] + 1e-9 or "fits" in p["why"], (name, p)
        assert np.isfinite(p["ppl"]) and p["kld"] >= 0
    assert m.exit_options.tail == m.presets["balanced"].setting.options.tail
    grid = json.loads(m.metadata[presets.GRID_KEY])  # every measured setting, for re-choosing tiers
    anchors = json.loads(m.metadata[presets.ANCHORS_KEY])
    assert len(grid) == len(cost_model.grid(m.n_layer))
    # Each row is measured against the F16 input, as it runs in use, or says why the cost model
    # left it out; only measured rows are chosen.
    assert m.metadata["river.presets_reference"] == "F16"
    for r in grid:
        if r["scored"] == "not measured":
            assert "kld" not in r and r["why"], r
        else:
            assert r["reference"] == "F16" and r["scored"] in ("batched, own prefill", "decode"), r
            assert (r["kld_ci"] is None) == r["interval"].startswith("none"), r
    rows = presets.parse_grid(m.metadata[presets.GRID_KEY])
    assert [r["options"] for r in rows] == cost_model.grid(m.n_layer)  # the grid's settings, read back whole
    assert {p.setting for p in m.presets.values()} <= {r["options"] for r in rows if "kld" in r}
    cheapest = min(grid, key=lambda r: r["relative_cost"])
    assert "kld" in cheapest  # what a tier no setting fits takes, and lossless mode's acceptance
    again = cost_model.choose(rows, anchors["bounds"])
    assert {n: p.setting for n, p in again.items()} == {n: p.setting for n, p in m.presets.items()}
    # Tiers rise with the anchors' bytes: Q4_0 < Q4_K_M < Q8_0.
    b = anchors["bounds"]
    assert b["fast"] < b["balanced"] < b["quality"]
    # A second conversion of the same input stores the same presets, byte for byte.
    out2 = tmp_path / "m2.river.gguf"
    build_river_gguf(bb, out2, threshold=0.9, progress=False)
    m2 = Model(str(out2), n_ctx=128, n_threads=1)
    for key in (presets.PRESET_KEY, presets.GRID_KEY, presets.ANCHORS_KEY):
        assert m2.metadata[key] == m.metadata[key], key
    assert out2.read_bytes() == out.read_bytes()  # and the whole file


def _costs(n_layer, backbone=10.0, river=6.0, head=40.0):
    """Per-layer and head costs in millions of Q8_0 elements (the exit test's cost is 0.85)."""
    layers = [dict(backbone=backbone * 1e6, river=river * 1e6, backbone_attention=4e6, river_attention=2e6)
              for _ in range(n_layer)]
    return layers, {"backbone": head * 1e6, "river": head * 1e6}


def test_plan_measures_only_what_can_win_a_tier():
    L = 8
    layers, head = _costs(L)
    settings = cost_model.grid(L)
    ro = cost_model.step_bytes(layers, head, L, -1, 0, True)
    bb = cost_model.setting_cost(settings[0], layers, head, L) / ro
    tails = {o.options.tail: cost_model.setting_cost(o, layers, head, L) / ro for o in settings
             if o.options.mode == "river-only" and "river_attention" not in o.names}
    bounds = {"fast": 0.9, "balanced": (tails[1] + tails[2]) / 2, "quality": bb + 0.01}
    why = cost_model.plan(settings, layers, head, L, bounds)
    measured = [o for o, w in zip(settings, why) if not w]
    rel = lambda o: cost_model.setting_cost(o, layers, head, L) / ro  # noqa: E731
    # The backbone and the cheapest setting are measured; fast fits nothing (the cheapest). So are
    # the first two tails of each walk of the search (a family's deepest within a tier's bound,
    # then its cheapest there), which its first two rounds would ask whatever the plan's rows hold.
    base = [settings[0], presets.Setting.of(mode="river-only", tail=0, river_head=True)]
    families = [[settings[i] for i in f] for f in cost_model.tail_families(settings)]

    def firsts(bounds):  # each walk's deepest and cheapest tail; a walk within base alone asks nothing
        return [o for f in families for b in bounds.values() for inside in [[o for o in f if rel(o) <= b]]
                if any(o not in base for o in inside) for o in (inside[-1], inside[0])]

    # balanced: tail 1 (and tail 0); quality: each family's deepest and cheapest (tail 0, with
    # and without the backbone's attention)
    assert len({o for o in firsts(bounds) if o not in base}) == 4
    assert measured == base + [o for o in settings if o in firsts(bounds) and o not in base]
    # Every other river-only tail within some tier's bound (quality's, which the backbone also
    # fits) is left to the search, whose walk compares it with the tier's best; the dynamic
    # settings within quality's bound only are the backbone's (the river's layers cost less).
    searched = [o for o, w in zip(settings, why) if w == cost_model.SEARCHED]
    in_quality = [o for o in settings[1:] if o.options.mode == "river-only" and rel(o) <= bounds["quality"]]
    assert searched == [o for o in in_quality if o not in measured] and len(searched) > 3
    # A walk within tail 0 alone (fast's bound) asks nothing: the other walks' first tails are
    # still measured with the plan.
    narrow = dict(bounds, fast=rel(base[1]))
    assert [o for o, w in zip(settings, cost_model.plan(settings, layers, head, L, narrow)) if not w] == \
        base + [o for o in settings if o in firsts(narrow) and o not in base]
    assert all(w for o, w in zip(settings, why) if o not in measured and o not in searched)
    assert all("backbone takes" in w for o, w in zip(settings, why) if o.is_dynamic
               and cost_model.setting_cost(o, layers, head, L) / ro <= bounds["quality"])
    # A dynamic setting whose least possible cost fits is measured, unless a prediction of its
    # exits (with the margin) puts it out.
    wide = dict(bounds, balanced=1.3)  # below the backbone (1.36x), above every dynamic least cost
    dyn = [i for i, o in enumerate(settings) if o.is_dynamic]
    assert all(not cost_model.plan(settings, layers, head, L, wide)[i] for i in dyn)
    late = cost_model.plan(settings, layers, head, L, dict(bounds, balanced=tails[2]), lambda o: L - 2.0)
    assert all(late[i] for i in dyn) and any("predicted" in late[i] for i in dyn)
    # With a river as costly as the backbone nothing is decided by structure: every tier is open.
    same = _costs(L, river=10.0)
    assert set(cost_model.plan(settings, *same, L, {"fast": 0.5, "balanced": 0.6, "quality": 5.0})) <= \
        {"", cost_model.SEARCHED}


def test_the_plans_tails_are_those_the_search_would_ask_first(monkeypatch):
    """The tails plan measures for the search (each walk's deepest and cheapest within a tier's
    bound, in the plan's pass) are what the search alone would ask in its first two rounds: with
    them in the plan, the calibration measures the same settings, and picks the same presets, in
    fewer rounds."""
    L = 8
    layers, head = _costs(L)
    settings = cost_model.grid(L)
    ro = cost_model.step_bytes(layers, head, L, -1, 0, True)
    costs = [cost_model.setting_cost(o, layers, head, L) / ro for o in settings]
    tails = {o.options.tail: c for o, c in zip(settings, costs) if o.options.mode == "river-only"
             and "river_attention" not in o.names}
    n_items = 12

    def row(i):  # KLD falls as the tail deepens; the backbone's attention halves it; item noise
        o = settings[i].options
        k = 0.01 if o.mode == "backbone" else 0.2 / (1 + o.tail) / (2 if o.river_attention == "backbone" else 1)
        per = [[64, 64 * k * (1 + 0.2 * ((j * (i + 3)) % 5 - 2))] for j in range(n_items)]
        return {"options": settings[i], "relative_cost": costs[i], "items": list(range(n_items)),
                "item_kld": per, "kld": sum(x for _, x in per) / sum(n for n, _ in per)}

    def calibrate(bounds):
        why = cost_model.plan(settings, layers, head, L, bounds)
        asked, rounds = set(), []

        def measure(idx):
            if idx:
                rounds.append(sorted(idx))
            asked.update(idx)
            return {i: row(i) for i in asked}

        measure([i for i, w in enumerate(why) if not w])
        families = [[i for i in f if why[i] in ("", cost_model.SEARCHED)] for f in cost_model.tail_families(settings)]
        cost_model.search([f for f in families if any(why[i] == cost_model.SEARCHED for i in f)], costs, bounds,
                          measure)
        chosen = cost_model.choose([row(i) for i in sorted(asked)], bounds)
        return sorted(asked), rounds, {n: p.setting for n, p in chosen.items()}

    for bounds in ({"fast": 0.9, "balanced": (tails[1] + tails[2]) / 2, "quality": costs[0] + 0.01},
                   {"fast": tails[0], "balanced": tails[3], "quality": tails[6] + 1e-6},
                   {"fast": 0.9, "balanced": 0.95, "quality": tails[4]}):
        planned = calibrate(bounds)
        with monkeypatch.context() as mp:  # the plan without the search's first tails
            mp.setattr(cost_model, "_first_walks_measured", lambda settings, why, costs, bounds, screened=(): why)
            searched = calibrate(bounds)
        assert planned[0] == searched[0] and planned[2] == searched[2], bounds
        assert len(planned[1]) < len(searched[1]), bounds  # the plan's pass took the search's first rounds


def _family_rows(klds, costs, noise=0.0, n_items=16):
    """Rows of one family of tails: per item 64 tokens, KLD sums around klds[t] with item noise
    (alternating signs, the same pattern for every tail, so paired differences are clean)."""
    out = {}
    for i, (k, c) in enumerate(zip(klds, costs)):
        per = [[64, 64 * k * (1 + (0.3 if j % 2 else -0.3) * (j % 5) / 4) + noise * ((j * (i + 3)) % 7 - 3)]
               for j in range(n_items)]
        out[i] = {"options": _tail(i), "relative_cost": c, "items": list(range(n_items)),
                  "item_kld": per, "kld": sum(x for _, x in per) / sum(n for n, _ in per)}
    return out


def _searched(table, bounds):
    family = sorted(table)
    costs = [table[i]["relative_cost"] for i in family]
    asked = []

    def measure(idx):
        asked.extend(idx)
        return {i: table[i] for i in set(asked)}

    res = cost_model.search([family], costs, bounds, measure)
    return res, sorted(set(asked))


def test_the_tail_search_measures_what_can_be_picked_and_picks_as_the_sweep():
    """The search walks each tier's tails from the deepest within its bound towards cheaper ones
    and stops at the first separated from the tier's best: the presets it picks are the full
    sweep's, with fewer tails measured; where the measured KLDs do not fall as the tail deepens,
    the whole family is measured (and the pick is the sweep's again)."""
    bounds = {"fast": 1.01, "balanced": 1.5, "quality": 2.0}
    costs = [1.0, 1.02, 1.05, 1.1, 1.2, 1.3, 1.45, 1.9]
    for noise, balanced, walked in ((0.2, 6, [5, 6]), (0.4, 5, [4, 5, 6]), (0.8, 4, [3, 4, 5, 6])):
        falling = _family_rows([0.30, 0.25, 0.21, 0.16, 0.10, 0.06, 0.055, 0.01], costs, noise)
        res, asked = _searched(falling, bounds)
        full = cost_model.choose(list(falling.values()), bounds)
        part = cost_model.choose([falling[i] for i in asked], bounds)
        assert {n: p.setting for n, p in part.items()} == {n: p.setting for n, p in full.items()}
        assert full["balanced"].setting.options.tail == balanced and not res["fallback"]
        # fast: the one tail in its bound; quality: tail 7, and tail 6 is separated from it;
        # balanced: from tail 6 down to the first separated from the tier's best. More item
        # noise ties more tails, so the walk goes further and the pick is cheaper.
        assert asked == [0] + walked + [7], noise
    # A flat family (every tail as close as the deepest: a river that rebuilds its source's grid):
    # after the deepest in each bound, the cheapest, which ties, ends the walk; tail 6's KLD above
    # tail 0's is within the items' noise, no break of the order (no fallback).
    flat = _family_rows([0.0107, 0.0106, 0.0105, 0.0104, 0.0103, 0.0102, 0.0108, 0.0100], costs)
    for i, row in flat.items():  # item noise that sums to 0 for each tail, a pattern of its own
        row["item_kld"] = [[n, x + 0.4 * (1 if (j + i) % 4 < 2 else -1)] for j, (n, x) in enumerate(row["item_kld"])]
    res, asked = _searched(flat, bounds)
    full = cost_model.choose(list(flat.values()), bounds)
    part = cost_model.choose([flat[i] for i in asked], bounds)
    assert {n: p.setting for n, p in part.items()} == {n: p.setting for n, p in full.items()}
    assert asked == [0, 6, 7] and full["balanced"].setting.options.tail == 0 and not res["fallback"]
    # A family whose KLD rises somewhere below the stop: the walk cannot see it, but the check
    # on the measured tails can when one of them breaks the order; then all are measured.
    bumpy = _family_rows([0.30, 0.25, 0.21, 0.16, 0.10, 0.06, 0.055, 0.01], costs)
    bumpy[0] = _family_rows([0.05] * 8, costs)[0]  # the cheapest tail (always measured) is close
    res, asked = _searched(bumpy, bounds)
    assert res["fallback"] == [0] and asked == sorted(bumpy)


def test_tails_only_the_backbones_tier_asks_are_screened_first():
    """In a tier the backbone takes (screen_tiers), the search measures a tail only that tier's
    walk asks on the screen items first (every third item), and on the rest only where the screen
    does not separate it from the tier's best: a tail far from the backbone stays screened (its
    row says so, and choose never takes it), one the screen cannot tell from the backbone is
    measured on every item, and either way the presets are the full sweep's."""
    from river_gguf.calibrate import preset_grid

    bounds = {"fast": 1.01, "balanced": 1.5, "quality": 2.0}
    costs = [1.0, 1.02, 1.05, 1.1, 1.2, 1.3, 1.45, 1.9, 1.95]
    for deepest, kept in ((0.05, False), (0.0101, True)):
        table = _family_rows([0.30, 0.25, 0.21, 0.16, 0.10, 0.06, 0.055, deepest, 0.01], costs, 0.2)
        table[8]["options"] = presets.Setting.of(mode="backbone", tail=0, river_head=False)
        rows = [table[i] for i in range(9)]
        asked = set()
        measure = preset_grid.replayed_measure(rows, asked)
        measure([0, 8])  # the plan's: plain river-only and the backbone
        res = cost_model.search([list(range(8))], costs, bounds, measure, screen_tiers=("quality",))
        got = measure([])
        assert res["screened"] == [7] and got[7].get("screened", False) is not kept
        assert preset_grid.screen_items(16) == [0, 3, 6, 9, 12, 15] == got[7]["items"] or kept
        measured = [rows[i] for i in sorted(asked) if not got[i].get("screened")]
        full = cost_model.choose(rows, bounds)
        part = cost_model.choose(measured, bounds)
        assert {n: p.setting for n, p in part.items()} == {n: p.setting for n, p in full.items()}
        assert full["quality"].setting == (rows[7] if kept else rows[8])["options"]
        # Without the screen the same tails are asked, tail 7 on every item.
        plain = set()
        measure = preset_grid.replayed_measure(rows, plain)
        measure([0, 8])
        cost_model.search([list(range(8))], costs, bounds, measure)
        assert plain == asked


def test_static_settings_scored_in_one_pass_match_decode(tiny_river):
    # The batched shortcut for river-only settings computes what teacher-forced decoding does, up
    # to summation order (batched mat-mul and tiled attention kernels vs the single-token ones).
    from river_gguf.measure import divergence

    m = Model(tiny_river, n_ctx=128, n_threads=1)
    toks = m.tokenize("the quick brown fox jumps over the lazy dog " * 3)
    for tail in (0, 2):
        cfg = {"x": (m, dict(mode="river-only", tail=tail, river_head=True))}
        b = divergence.score_configs(m, cfg, [(toks, 5)], batched_static=True)["x"]
        d = divergence.score_configs(m, cfg, [(toks, 5)], batched_static=False)["x"]
        assert b.perplexity == pytest.approx(d.perplexity, rel=1e-3)
        np.testing.assert_allclose(b.items[0].kld, d.items[0].kld, rtol=1e-2, atol=1e-4)


def test_measured_settings_are_whole_whatever_the_default_preset(tiny_river, tmp_path):
    """A grid row or report row leaves out what it does not set; it must mean the plain value
    there, not the default preset's (here: a tail and the backbone's attention), or a 'river-only'
    row silently measures another setting."""
    import dataclasses
    import shutil

    from river_gguf.eval import report

    path = tmp_path / "p.river.gguf"
    shutil.copy(tiny_river, path)
    stored = {"balanced": {"options": {"mode": "river-only", "tail": 2, "river_attention": "backbone",
                                       "river_head": True}}}
    set_river_metadata(str(path), {presets.PRESET_KEY: presets.dump(stored), presets.DEFAULT_KEY: "balanced"})
    m = Model(str(path), n_ctx=128, n_threads=1)
    assert m.exit_options.river_attention == "backbone" and m.exit_options.tail == 2
    row = {"mode": "river-only", "river_head": True}
    o = m.options(**presets.Setting.of(**row).call_options())
    assert (o.tail, o.river_attention) == (0, "river")
    assert report._resolved_options(m, row)["river_attention"] == "river"
    assert report._resolved_options(m, row)["tail"] == 0
    assert report._resolved_options(m, {"preset": "balanced"})["tail"] == 2
    plain = Model(tiny_river, n_ctx=128, n_threads=1)  # no presets: its defaults are the plain ones
    toks = plain.tokenize("the river runs to the sea and the sea")
    a = score(m, toks, **presets.Setting.of(**row).call_options()).logprobs
    b = score(plain, toks, **row).logprobs
    assert np.array_equal(a, b)
    assert dataclasses.asdict(plain.options(**row))["river_attention"] == "river"


def test_an_explicit_exit_setting_keeps_no_preset_field(tiny_river, tmp_path):
    """logits(t, mode="river", exit_layer=k) on a file whose default preset has a tail and the
    backbone's attention is the forced exit at k and nothing else (it used to keep the tail);
    options that are not an exit setting still adjust the preset."""
    import shutil

    path = tmp_path / "p.river.gguf"
    shutil.copy(tiny_river, path)
    stored = {"balanced": {"options": {"mode": "river-only", "tail": 2, "river_attention": "backbone"}}}
    set_river_metadata(str(path), {presets.PRESET_KEY: presets.dump(stored), presets.DEFAULT_KEY: "balanced"})
    m = Model(str(path), n_ctx=128, n_threads=1)
    plain = Model(tiny_river, n_ctx=128, n_threads=1)
    for asked in ({"mode": "river", "exit_layer": 1}, {"exit_layer": 0}, {"mode": "river-only"}):
        o = m.options(**asked)
        assert (o.tail, o.river_attention) == (0, "river"), asked
        assert o == plain.options(**asked)
    assert m.options(threshold=0.5).tail == 2  # not an exit setting: the preset stays
    assert m.options(mode="river-only", tail=2).tail == 2  # what is asked is kept
    toks = plain.tokenize("the river runs to the sea and the sea")
    assert np.array_equal(m.logits(toks, mode="river", exit_layer=1), plain.logits(toks, mode="river", exit_layer=1))
    assert not np.array_equal(m.logits(toks, mode="river-only"), m.logits(toks))  # the preset differs


def test_a_tier_takes_a_closer_setting_only_where_the_difference_separates():
    from river_gguf.calibrate.cost_model import choose, not_closer

    items = list(range(12))
    # Per item (scored tokens, summed KLD): b is 20% further than a on every item (separated);
    # c is as close as a but with item-to-item noise larger than the difference (not separated).
    a = [[64, 1.0 + 0.1 * (i % 3)] for i in items]
    b = [[64, 1.2 * x] for _, x in a]
    c = [[64, x + (0.3 if i % 2 else -0.28)] for i, (_, x) in enumerate(a)]

    def row(kl, cost, name):
        k = sum(x for _, x in kl) / sum(n for n, _ in kl)
        return {"options": _tail(name), "kld": k, "relative_cost": cost,
                "items": items, "item_kld": kl}

    ra, rb, rc = row(a, 1.05, 1), row(b, 1.00, 2), row(c, 1.01, 3)
    assert not not_closer(ra, rb) and not_closer(ra, rc)
    assert rc["kld"] > ra["kld"]
    bounds = {"fast": 1.0, "balanced": 1.02, "quality": 1.1}
    picked = choose([ra, rb, rc], bounds)
    assert picked["fast"].setting == rb["options"]       # the only one that fits
    assert picked["balanced"].setting == rc["options"]   # b is separated from c; c is the closest that fits
    assert picked["quality"].setting == rc["options"]    # a is closer, but not separably: the cheaper c
    # Without the noise, a separates from c and the quality tier takes it.
    rc2 = row([[64, x * 1.3] for _, x in a], 1.01, 3)
    assert choose([ra, rb, rc2], bounds)["quality"].setting == ra["options"]


def test_the_search_chooses_the_presets_of_the_full_sweep_on_smollm2(river_gguf_path):
    """The presets chosen with the cost model's pruning and the tail search are those of the
    full, unpruned sweep of the grid on the same items, on SmolLM2 (F16 backbone, Q4_0 river:
    many tails fit a tier, so the search has tails to leave out), with the dynamic settings'
    exits predicted from the backbone's profile as the converter predicts them. The search is
    replayed on the sweep's own rows (its decisions are a function of the rows it asks for)."""
    from river_gguf.options import never_exit
    from support import THREADS, search_replayed_on_full_sweep

    m = Model(river_gguf_path, n_ctx=1024, n_threads=THREADS, threshold=never_exit("cosine"))
    prepared, _, full, settings, asked = search_replayed_on_full_sweep(m)
    # It left settings out (asserted above), after searching: tails past 0 were measured (the walks'
    # first tails with the plan's settings, where no walk starts at one the plan measures; the rest in rounds).
    assert any(settings[i].options.mode == "river-only" and settings[i].options.tail > 0 for i in asked)
    assert len({p.setting for p in full["presets"].values()}) > 1  # a real choice
    backbone = next(r for r in full["rows"] if r["options"].options.mode == "backbone")
    assert backbone["items"] == list(range(len(prepared))) and backbone["kld_ci"] is not None  # every item


def test_the_screened_search_chooses_the_full_sweeps_presets_and_measures_as_replayed(derived):
    """With the converter's default parts on SmolLM2 (a Q8_0 backbone, a Q4_K_M river beside it:
    the quality tier is the backbone's, so its walks' tails are screened first): the search replayed on the
    full sweep's rows picks the sweep's presets, and a pruned calibration of the same items
    measures what the replay asked, screens what it screened (on screen_items alone, its rows
    without a KLD to choose by), and gives each setting the sweep's KLD."""
    from river_gguf.options import never_exit
    from support import THREADS, search_replayed_on_full_sweep

    m = Model(derived("q8_0"), river=derived("q4_k_m"), n_ctx=1024, n_threads=THREADS, threshold=never_exit("cosine"))
    prepared, profile, full, settings, measured = search_replayed_on_full_sweep(m)
    pruned = preset_grid.calibrate_presets(m, prepared=prepared, score_tokens=8, progress=False, profile=profile,
                                           prune=True)
    screened = [i for i, r in enumerate(pruned["rows"]) if r["scored"] == "screened"]
    assert screened and pruned["search"]["screened"] == screened
    assert {i for i, r in enumerate(pruned["rows"]) if "kld" in r} == measured
    for i in screened:
        row = pruned["rows"][i]
        assert row["screen_items"] == preset_grid.screen_items(len(prepared)) and "kld" not in row
    for i in measured:
        assert pruned["rows"][i]["kld"] == full["rows"][i]["kld"], settings[i]
    assert {n: p.setting for n, p in pruned["presets"].items()} == {n: p.setting for n, p in full["presets"].items()}


def test_a_rules_tau_grid_is_its_own_and_stays_below_its_max_score():
    """A rule without hand-placed taus takes quantiles of its profile, but never one at its
    max_score: that threshold never passes, the backbone's setting again. Its dynamic settings
    name the rule, in their JSON too."""
    from river_gguf.options import max_score

    top = max_score("update")
    sims = np.full((20, 6), 0.5)
    sims[:, 1:-1] = np.linspace(0.6, 0.9, 20)[:, None]
    sims[17:, 1:-1] = top  # the top 15% of mid-layer scores at the bound
    assert np.quantile(sims[:, 1:-1], cost_model.DYNAMIC_QUANTILES[-1]) == top
    taus = cost_model.dynamic_taus("update", sims)
    assert taus and all(t < top for t in taus) and len(taus) == len(cost_model.DYNAMIC_QUANTILES) - 1
    dynamic = [s for s in cost_model.grid(6, exit_rule="update", profile=sims) if s.is_dynamic]
    assert dynamic and {s.options.threshold for s in dynamic} == set(taus)
    assert all(s.options.exit_rule == "update" and json.loads(presets.dump(s))["exit_rule"] == "update"
               for s in dynamic)
    with pytest.raises(ValueError, match="needs its profile"):
        cost_model.dynamic_taus("update")
