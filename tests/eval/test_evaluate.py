"""Evaluation harness: data split, shuffle control, tau selection/calibration, metadata rewrite,
and a tiny end-to-end run of the eval (the --quick checks on even smaller settings)."""
import argparse
import json
import os

import numpy as np
import pytest

from river_gguf.measure import data as eval_data

from river_gguf.calibrate import tau as tau_calibration
from river_gguf.eval import render
from river_gguf.eval import report as evaluate
from river_gguf.measure import scoring
from river_gguf.eval.report import Setup, Settings

from support import THREADS
from river_gguf.gguf.reader import GGUFReader


# ----- data ----------------------------------------------------------------------------
@pytest.mark.parametrize("domain,n,n_cal", [("gsm8k", 100, 20), ("humaneval", 164, 33)])
def test_split_is_disjoint_and_complete(domain, n, n_cal):
    items = eval_data.load_domain(domain)
    assert len(items) == n
    cal, ev = eval_data.select(items, "calibration"), eval_data.select(items, "evaluation")
    assert len(cal) == n_cal and len(ev) == n - n_cal
    assert not {it.id for it in cal} & {it.id for it in ev}
    assert not {it.prompt for it in cal} & {it.prompt for it in ev}
    assert {it.id for it in cal} | {it.id for it in ev} == {it.id for it in items}
    assert all(it.prompt and it.completion.strip() for it in items)


def test_user_files(tmp_path):
    txt = tmp_path / "notes.txt"
    txt.write_text("\n\n".join(f"Paragraph {i}. " + "word " * 120 for i in range(12)))
    items = eval_data.load_domain(str(txt))
    assert len(items) >= 2 and all(it.domain == "notes" for it in items)
    assert " ".join(it.prompt + it.completion for it in items).split() == txt.read_text().split()
    js = tmp_path / "d.jsonl"
    js.write_text(json.dumps({"prompt": "Q: 1+1?", "completion": " 2"}) + "\n" +
                  json.dumps({"text": "a b c d e f g h i j k l m n o p"}) + "\n")
    items = eval_data.load_domain(str(js))
    assert items[0].prompt == "Q: 1+1?" and items[0].completion == " 2"
    assert items[1].prompt + items[1].completion == "a b c d e f g h i j k l m n o p"
    with pytest.raises(ValueError):
        eval_data.load_domain("no-such-domain")


# ----- pure logic ----------------------------------------------------------------------
def test_shuffle_preserves_histogram_and_shapes():
    rng = np.random.default_rng(0)
    exits = [list(rng.integers(-1, 30, size=n)) for n in (5, 0, 17, 9)]
    a = evaluate.shuffle_exits(exits, 1)
    b = evaluate.shuffle_exits(exits, 2)
    assert [len(x) for x in a] == [len(x) for x in exits]
    assert evaluate.histogram(a) == evaluate.histogram(exits) == evaluate.histogram(b)
    assert a != b and a == evaluate.shuffle_exits(exits, 1)  # draws differ; a seed is reproducible


def test_select_tau_synthetic():
    rows = [{"tau": 0.96, "ppl": 7.0, "mean_exit_layer": 2.0},
            {"tau": 0.97, "ppl": 6.3, "mean_exit_layer": 5.0},
            {"tau": 0.98, "ppl": 6.15, "mean_exit_layer": 14.0},
            {"tau": 0.99, "ppl": 6.05, "mean_exit_layer": 27.0}]
    assert tau_calibration.select_tau(rows, 6.0, 0.02)["threshold"] == 0.99      # limit 6.12
    assert tau_calibration.select_tau(rows, 6.0, 0.03)["threshold"] == 0.98      # limit 6.18
    assert tau_calibration.select_tau(rows, 6.0, 0.06)["threshold"] == 0.97
    assert tau_calibration.select_tau(rows, 6.0, 0.5)["threshold"] == 0.96
    none = tau_calibration.select_tau(rows, 6.0, 0.001)
    assert not none["feasible"] and none["threshold"] > 1.0               # never exit
    # Not monotone in tau: the fastest within budget wins, whatever its tau.
    rows2 = rows + [{"tau": 0.975, "ppl": 6.1, "mean_exit_layer": 9.0}]
    assert tau_calibration.select_tau(rows2, 6.0, 0.02)["threshold"] == 0.975
    # Ties in depth: the faster measured speed.
    rows3 = [{"tau": 0.97, "ppl": 6.0, "mean_exit_layer": 5.0, "tok_s": 90.0},
             {"tau": 0.98, "ppl": 6.0, "mean_exit_layer": 5.0, "tok_s": 100.0}]
    assert tau_calibration.select_tau(rows3, 6.0, 0.0)["threshold"] == 0.98


def test_agreement():
    share, pre = evaluate.agreement([[1, 2, 3, 4], [5, 6]], [[1, 2, 9, 4], [5, 6, 7]])
    assert share == pytest.approx((3 + 2) / (4 + 3)) and pre == pytest.approx((2 + 2) / 2)


def test_frontier():
    pts = [(100, 5.0), (120, 5.5), (110, 5.6), (90, 4.8), (130, 6.0), (125, 6.1), (90, 4.9)]
    assert evaluate.frontier(pts) == [(90, 4.8), (100, 5.0), (120, 5.5), (130, 6.0)]
    assert evaluate.frontier([]) == []


def test_plan_full_settings():
    s = evaluate.full_settings("smollm2", plain_sweep="trim")
    rows = evaluate._plan(s, ("q8_0", "q4_0"), {"River GGUF": ["fast", "balanced", "quality"]})
    by = {(r.setup, r.label): r for r in rows}
    for name in ("fast", "balanced", "quality"):
        assert by[("River GGUF", f"preset {name}")].opts == {"preset": name}
    # Dynamic exit with a tail on the River GGUF: every option explicit, so the file's default
    # preset cannot leak into a sweep row.
    r = by[("River GGUF", "tau=0.98 tail=2")]
    assert r.opts == dict(mode="river", threshold=0.98, river_head=True, tail=2, min_exit_layer=0)
    assert {(x.tau, x.tail) for x in rows if x.setup == "River GGUF" and x.kind == "river"} == \
        {(t, k) for t in (0.97, 0.98, 0.99) for k in (2,)}
    assert [x.tail for x in rows if x.setup == "River GGUF" and x.kind == "river-only"] == [0, 2, 4, 8, 16]
    assert by[("F16+Q4_0", "exit@10")].opts["tail"] == 0
    # planned with placeholder types; run_eval labels them with the River GGUF's (river_types)
    assert [x.label for x in rows if x.kind == "control"] == \
        ["imatrix Q4_0"] + [f"imatrix Q4_0 + F16 tail {t}" for t in (8,)]
    assert evaluate.river_types({"river.type": "q4_k_m+imatrix", "river.backbone_type": "q8_0"}) == \
        ("imatrix Q4_K_M", "Q8_0")
    assert evaluate.control_label(4, "imatrix Q4_K_M", "Q8_0") == "imatrix Q4_K_M + Q8_0 tail 4"
    assert evaluate.river_types({"river.type": "q4_0"}) == ("Q4_0", "F16")
    assert [x.label for x in rows if x.kind == "ladder"] == ["Q8_0", "Q4_0"]
    assert all(x.engine == "llama.cpp" for x in rows if x.kind in ("ladder", "control"))
    assert all(x.engine == "river_gguf" for x in rows if x.kind not in ("ladder", "control"))
    # The plain sweep: left out by default, trimmed or full on request; fixed exits fit the model.
    assert len([x for x in rows if x.setup == "F16+Q4_0" and x.kind == "river"]) == 4
    assert not [x for x in evaluate._plan(evaluate.full_settings("smollm2"), ()) if x.setup == "F16+Q4_0"]
    qwen = evaluate.full_settings("qwen2.5-coder-0.5b")
    assert s.score_items is None and qwen.score_items is None  # the whole evaluation split
    assert qwen.score_tokens <= s.score_tokens and max(qwen.controls) < 23
    assert not [x for x in evaluate._plan(qwen, ()) if x.setup == "F16+Q4_0"]
    full_qwen = evaluate.full_settings("qwen2.5-coder-0.5b", plain_sweep="full")
    full = evaluate._plan(full_qwen, (), n_layer=24)  # the file's depth, which run_eval reads
    assert len([x for x in full if x.setup == "F16+Q4_0" and x.kind == "river"]) == len(evaluate.DEFAULT_TAUS)
    assert max(evaluate.DEFAULT_FIXED_EXITS) >= 23  # so the depth has exits to leave out
    assert [x.exit_layer for x in full if x.kind == "fixed"] == [k for k in evaluate.DEFAULT_FIXED_EXITS if k < 23]
    assert [x.exit_layer for x in evaluate._plan(full_qwen, ()) if x.kind == "fixed"] == \
        list(evaluate.DEFAULT_FIXED_EXITS)
    assert not [x for x in evaluate._plan(evaluate.full_settings("smollm2", plain_sweep="none"), ())
                if x.setup == "F16+Q4_0"]
    gemma = evaluate.full_settings("gemma3-270m")  # 18 layers: every tail leaves river layers
    assert max(gemma.controls) < 17 and max(t for s in gemma.setups for t in s.river_only_tails) < 17
    assert [x.kind for x in evaluate._plan(gemma, ())].count("preset") == 3
    with pytest.raises(ValueError):
        evaluate.full_settings("smollm2", plain_sweep="half")
    with pytest.raises(ValueError):
        evaluate.full_settings("no-such-model")
    assert evaluate.quick_settings("qwen2.5-coder-0.5b").model == "qwen2.5-coder-0.5b"


def _row(setup, kind, label, tok_s, kld, tail=None, preset=None, preset_options=None, tau=None):
    return {"setup": setup, "kind": kind, "label": label, "tail": tail, "preset": preset, "tau": tau,
            "preset_options": preset_options, "options": {}, "of": None,
            "engine": "llama.cpp" if kind in ("ladder", "control") else "river_gguf",
            "domains": {"d": {"kld": kld, "decode_tok_s": tok_s}}, "overall": {"kld": kld, "decode_tok_s": tok_s}}


def _synthetic_report(ladder=("Q8_0", "Q4_K_M", "Q4_0")):
    lad = {"Q8_0": (130.0, 0.005), "Q4_K_M": (140.0, 0.07), "Q4_0": (180.0, 0.30)}
    rows = [_row("ladder", "ladder", q, *lad[q]) for q in ladder]
    rows += [_row("static", "control", "imatrix Q4_0", 200.0, 0.20, tail=0),
             _row("static", "control", "imatrix Q4_0 + F16 tail 2", 180.0, 0.15, tail=2),
             _row("static", "control", "imatrix Q4_0 + F16 tail 4", 160.0, 0.10, tail=4)]
    dyn = {"mode": "river", "threshold": 0.98, "tail": 2}
    rows += [
        _row("River GGUF", "preset", "preset fast", 185.0, 0.15, tail=2, preset="fast",
             preset_options={"mode": "river-only", "tail": 2}),                      # static setting
        _row("River GGUF", "preset", "preset balanced", 150.0, 0.06, tail=2, preset="balanced",
             preset_options=dyn),                                                   # dynamic, wins
        _row("River GGUF", "river", "tau=0.97 tail=2", 170.0, 0.17, tail=2, tau=0.97),  # loses
        _row("River GGUF", "river-only", "river-only", 190.0, 0.20, tail=0),
        _row("River GGUF", "river-only", "river-only tail=2", 170.0, 0.15, tail=2),
    ]
    # Paired intervals of preset - ladder KLD (run_eval computes them from the items).
    paired = {"fast": {"Q4_0": {"kld": -0.15, "kld_ci": [-0.2, -0.1]}, "Q4_K_M": {"kld": 0.08, "kld_ci": [0.05, 0.1]}},
              "balanced": {"Q4_K_M": {"kld": -0.01, "kld_ci": [-0.03, 0.01]}}}
    return {"rows": rows, "domains": {"d": {}}, "settings": {"shuffle_seed": 1, "shuffle_draws": 2},
            "setups": [{"name": "River GGUF", "backbone": evaluate.RIVER_GGUF, "river": None}],
            "model": "Tiny", "threads": 2, "speed_check": None, "paired": paired}


def test_analyse_targets_and_dynamic_vs_static(tmp_path):
    rep = _synthetic_report()
    a = evaluate.analyse(rep)
    rep["analysis"] = a
    t = {x["ref"]: x for x in a["targets"]}
    # Q4_0: fast runs at 185 >= 180 with KLD 0.15 <= 0.30, and the interval supports it.
    c = {x["preset"]: x for x in t["Q4_0"]["presets"]}
    assert t["Q4_0"]["met"] and t["Q4_0"]["met_by"] == ["fast"] and c["fast"]["close_supported"]
    assert c["fast"]["speed_ratio"] == pytest.approx(185 / 180)
    # Q4_K_M: balanced 150 >= 140 and 0.06 <= 0.07, but its interval reaches above 0: not supported.
    c = {x["preset"]: x for x in t["Q4_K_M"]["presets"]}
    assert t["Q4_K_M"]["met_by"] == ["balanced"] and not c["balanced"]["close_supported"]
    # Q8_0 (0.005): nothing is that close.
    assert t["Q8_0"]["met"] is False and t["Q8_0"]["bar_cleared_by"] == []
    # Other rows that clear a bar: a setting some preset could have been.
    assert t["Q4_0"]["bar_cleared_by"] == ["imatrix Q4_0 (llama.cpp)", "imatrix Q4_0 + F16 tail 2 (llama.cpp)",
                                           "River GGUF: river-only"]  # river-only tail=2 is slower
    p = {e["preset"]: e for e in a["presets"]}
    assert p["fast"]["speed_ratio"]["Q4_K_M"] == pytest.approx(185 / 140)
    assert p["fast"]["kld_delta"]["Q8_0"] == pytest.approx(0.145)
    assert p["balanced"]["dominates"] == ["Q4_K_M"] and p["balanced"]["dominated_by"] == []
    assert p["fast"]["dominates"] == ["Q4_0", "imatrix Q4_0 + F16 tail 2"]
    # Dynamic vs the static hybrids in llama.cpp: at 150 tok/s the static curve is outside (slowest 160,
    # KLD 0.10), balanced is lower -> undecided; at 170 the static curve gives 0.125, so tau=0.97 loses by 0.045.
    v = a["dynamic_vs_static"]["River GGUF"]["llama.cpp"]
    rows = {c["label"]: c for c in v["rows"]}
    assert rows["tau=0.97 tail=2"]["static_kld_at_speed"] == pytest.approx(0.125)
    assert rows["tau=0.97 tail=2"]["delta_kld"] == pytest.approx(0.045) and rows["tau=0.97 tail=2"]["wins"] is False
    assert not rows["preset fast"]["dynamic"] and rows["preset balanced"]["dynamic"]
    assert rows["preset balanced"]["wins"] is None and "slower than every static point" in rows["preset balanced"]["outside"]
    assert v["summary"] == {"compared": 1, "wins": 0, "decided": 1, "decided_wins": 0, "best_label": "tau=0.97 tail=2",
                            "best_delta_kld": pytest.approx(0.045), "best_tok_s": 170.0,
                            "mean_delta_kld": pytest.approx(0.045)}
    # Against the same static settings on river_gguf (river-only rows): 170 tok/s -> 0.15, so +0.02.
    e = {c["label"]: c for c in a["dynamic_vs_static"]["River GGUF"]["river_gguf"]["rows"]}
    assert e["tau=0.97 tail=2"]["delta_kld"] == pytest.approx(0.02)
    cons = {c["control"]: c for c in a["consistency"]}
    assert cons["imatrix Q4_0"]["same_kld"] and cons["imatrix Q4_0 + F16 tail 2"]["same_kld"]
    md = render.markdown(rep)
    assert ("a preset at least as fast as Q4_K_M and at least as close to F16 (KLD) (140.0 tok/s, KLD 0.0700): "
            "**met by balanced**") in md
    assert "closer, within the interval's noise" in md and "closer, supported by the interval" in md
    assert "| tau=0.97 tail=2 | 170.0 | 0.1700 | 0.1250 | +0.0450 | no |" in md
    render.pareto_plot(rep, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 10_000

    # A slower fast preset misses Q4_0; a model without Q4_K_M cannot be judged against it.
    rep2 = _synthetic_report()
    next(r for r in rep2["rows"] if r["label"] == "preset fast")["overall"]["decode_tok_s"] = 175.0
    t2 = {x["ref"]: x for x in evaluate.analyse(rep2)["targets"]}
    c2 = {x["preset"]: x for x in t2["Q4_0"]["presets"]}
    assert t2["Q4_0"]["met"] is False and not c2["fast"]["fast_enough"] and c2["fast"]["close_enough"]
    rep3 = _synthetic_report(ladder=("Q8_0", "Q4_0"))
    rep3["analysis"] = evaluate.analyse(rep3)
    t3 = {x["ref"]: x for x in rep3["analysis"]["targets"]}
    assert t3["Q4_K_M"]["met"] is None and "Q4_K_M not in this model's ladder" in t3["Q4_K_M"]["why"]
    assert "**n/a**" in render.markdown(rep3)
    # Slower than every static point and worse than one of them: lost, not undecided.
    rep4 = _synthetic_report()
    next(r for r in rep4["rows"] if r["label"] == "preset balanced")["overall"]["kld"] = 0.15
    c4 = {c["label"]: c for c in evaluate.analyse(rep4)["dynamic_vs_static"]["River GGUF"]["llama.cpp"]["rows"]}
    assert c4["preset balanced"]["wins"] is False and c4["preset balanced"]["delta_kld_vs_best_faster"] == pytest.approx(0.05)


def test_parse_budget_and_cli_parsers():
    from river_gguf.cli import common as cli
    from river_gguf.cli import evaluate as eval_cli

    assert eval_cli.parse_budget("2%") == pytest.approx(0.02)
    assert eval_cli.parse_budget("0.05") == pytest.approx(0.05)
    common = cli.common_parents()
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="command")
    eval_cli.register_eval(sub, common)
    eval_cli.register_calibrate(sub, common)
    a = p.parse_args(["calibrate", "m.river.gguf", "--budget", "3%", "--write", "--taus", "0.97,0.98"])
    assert a.budget == pytest.approx(0.03) and a.write and a.taus == (0.97, 0.98) and a.model == "m.river.gguf"
    a = p.parse_args(["eval", "--quick", "--out", "d", "--text", "x.txt", "--text", "y.jsonl"])
    assert a.quick and a.text == ["x.txt", "y.jsonl"] and a.domains == "gsm8k,humaneval"
    assert a.model == "smollm2"
    assert p.parse_args(["eval", "--model", "qwen2.5-coder-0.5b"]).model == "qwen2.5-coder-0.5b"
    with pytest.raises(SystemExit):
        p.parse_args(["eval", "--model", "llama-7b"])


# ----- metadata rewrite ----------------------------------------------------------------
def test_set_river_metadata_roundtrip(tmp_path):
    import gguf
    from gguf import GGMLQuantizationType as QT

    from river_gguf.gguf.meta import set_river_metadata

    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("llama.block_count", 2)
    w.add_float32("river.threshold", 0.9)
    w.add_string("river.threshold_source", "profile")
    f32 = np.arange(64, dtype=np.float32).reshape(2, 32)
    q = gguf.quants.quantize(np.linspace(-1, 1, 64, dtype=np.float32).reshape(2, 32), QT.Q8_0)
    w.add_tensor("a.weight", f32)
    w.add_tensor("b.weight", q, raw_dtype=QT.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    before = {t.name: bytes(t.data.tobytes()) for t in GGUFReader(str(path)).tensors}

    out = set_river_metadata(str(path), {"river.threshold": 0.975, "river.threshold_source": "calibrated",
                                         "river.calibration_budget": 0.02, "river.backbone_ppl": 6.5})
    r = GGUFReader(str(path))
    assert r.fields["river.threshold"].contents() == pytest.approx(0.975, abs=1e-6)
    assert r.fields["river.threshold_source"].contents() == "calibrated"
    assert r.fields["river.calibration_budget"].contents() == pytest.approx(0.02, abs=1e-7)
    assert r.fields["llama.block_count"].contents() == 2
    assert {t.name: bytes(t.data.tobytes()) for t in r.tensors} == before
    assert {t.name: t.tensor_type for t in r.tensors} == {"a.weight": QT.F32, "b.weight": QT.Q8_0}
    assert out["river.threshold"] == pytest.approx(0.975, abs=1e-6)
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


# ----- on the model (SmolLM2 F16 backbone + Q4_0 river) --------------------------------
@pytest.fixture(scope="module")
def river_model(f16_path, q4_0_path):
    from river_gguf import Model

    # Every call on it names its exit setting, so a threshold given here only spares the load
    # the profile two plain files would otherwise get (256 backbone decode steps).
    return Model(f16_path, river=q4_0_path, n_ctx=512, n_threads=THREADS, threshold=0.975)


@pytest.fixture(scope="module")
def cal_items():
    return {d: eval_data.select(eval_data.load_domain(d), "calibration", 1) for d in eval_data.DOMAINS}


def test_forced_exits_reproduce_the_river_run(river_model, cal_items):
    # The shuffle control's scorer, fed the River run's own exit layers, must give the same logprobs.
    prep = evaluate.prepare(river_model, cal_items["gsm8k"], score_tokens=24)
    r = scoring.score_items(river_model, prep, mode="river", threshold=0.975)
    f = evaluate.score_forced(river_model, river_model, prep, r.exits)
    np.testing.assert_allclose(-f.pooled("nll"), r.logprobs, rtol=0, atol=1e-9)
    assert f.exits == r.exits
    assert len(set(e for ex in r.exits for e in ex)) > 1  # a real mix of depths


def test_calibrate_within_budget(river_model, cal_items):
    taus = (0.96, 0.975, 0.99, 1.01)
    res = tau_calibration.calibrate(river_model, budget=0.02, taus=taus, items=cal_items, score_tokens=16, progress=False)
    assert res["feasible"]  # tau 1.01 never exits: exactly the backbone, always within budget
    assert res["calibration_ppl"] <= res["backbone_ppl"] * 1.02
    by_tau = {r["tau"]: r for r in res["rows"]}
    assert by_tau[1.01]["ppl"] == pytest.approx(res["backbone_ppl"], rel=1e-12)
    chosen = by_tau[res["threshold"]]
    assert all(r["mean_exit_layer"] >= chosen["mean_exit_layer"] for r in res["rows"]
               if r["ppl"] <= res["backbone_ppl"] * 1.02)
    assert set(res["items"]) == {"gsm8k", "humaneval"}
    ev_ids = {it.id for d in eval_data.DOMAINS for it in eval_data.select(eval_data.load_domain(d), "evaluation")}
    assert not ev_ids & {i for ids in res["items"].values() for i in ids}


def test_eval_tiny_end_to_end(f16_path, q4_0_path, tmp_path, monkeypatch):
    # Every row names its exit setting, so the pair's default tau goes unused: the run's Models get
    # a threshold, which spares the load its profile (256 backbone decode steps, half this test).
    # test_eval_quick_cli runs the same report with the profile.
    load = evaluate.Model
    monkeypatch.setattr(evaluate, "Model", lambda path, river=None, **kw: load(
        path, river=river, **kw, **({"threshold": 0.975} if river else {})))
    s = Settings(setups=[Setup("F16+Q4_0", "f16", "q4_0", taus=(0.975,), fixed_exits=(10,), shuffle_taus=(0.975,),
                               backbone_row=True)],
                 ladder=("q4_0",), score_items=1, score_tokens=16, gen_items=1, gen_tokens=4, prompt_tokens=32, n_ctx=256,
                 progress=False)
    rep = evaluate.run_eval(s)
    rows = {r["label"]: r for r in rep["rows"]}
    assert set(rows) == {"F16 backbone", "Q4_0 river-only", "tau=0.975", "exit@10", "shuffle(tau=0.975)#0",
                         "shuffle(tau=0.975)#1", "Q4_0"}
    for d in ("gsm8k", "humaneval"):
        # The reference is the F16 backbone: its own row is exactly 0 from it; the river is not.
        assert rows["F16 backbone"]["domains"][d]["kld"] == 0.0 and rows["F16 backbone"]["domains"][d]["same_top"] == 1
        assert rows["Q4_0 river-only"]["domains"][d]["kld"] > 0 and rows["Q4_0"]["domains"][d]["kld"] > 0
        assert rows["F16 backbone"]["domains"][d]["agreement"] == 1.0
        assert rows["F16 backbone"]["domains"][d]["mean_exit_layer"] == 29
        assert rows["exit@10"]["domains"][d]["mean_exit_layer"] == 10
        assert rows["shuffle(tau=0.975)#0"]["domains"][d]["histogram_preserved"]
        assert rows["Q4_0"]["domains"][d]["decode_tok_s"] > 0
        assert 1.0 < rows["tau=0.975"]["domains"][d]["ppl"] < 100.0
    assert not evaluate.sanity_failures(rep)
    paths = render.write_outputs(rep, str(tmp_path / "out"))
    assert all(os.path.getsize(p) > 0 for p in paths.values())
    assert json.load(open(paths["json"]))["rows"]


@pytest.fixture(scope="module")
def small_river_gguf(river_gguf_path, tmp_path_factory):
    """The suite's SmolLM2 River GGUF (no imatrix, no preset calibration) with hand-written
    presets: one dynamic preset with a tail, one static river-only + tail."""
    import shutil

    from river_gguf import presets
    from river_gguf.gguf.meta import set_river_metadata

    path = tmp_path_factory.mktemp("rg") / "smollm2.river.gguf"
    shutil.copy(river_gguf_path, path)
    stored = {"fast": {"options": {"mode": "river-only", "tail": 2, "river_head": True}, "ppl": 5.0},
              "balanced": {"options": {"mode": "river", "threshold": 0.98, "min_exit_layer": 0, "tail": 2,
                                       "river_head": True}, "ppl": 4.5}}
    set_river_metadata(str(path), {presets.PRESET_KEY: presets.dump(stored), presets.DEFAULT_KEY: "balanced"})
    return str(path)


def test_control_path_is_the_static_tail_hybrid(small_river_gguf):

    p2 = evaluate.control_path("smollm2", 2, small_river_gguf)
    p0 = evaluate.control_path("smollm2", 0, small_river_gguf)
    assert os.path.dirname(p2) == os.path.dirname(small_river_gguf) and p0 != p2
    mtime = os.stat(p2).st_mtime_ns
    assert evaluate.control_path("smollm2", 2, small_river_gguf) == p2 and os.stat(p2).st_mtime_ns == mtime  # cached
    types = {t.name: t.tensor_type.name for t in GGUFReader(p2).tensors}
    assert not [n for n in types if n.startswith("river.")]
    assert types["blk.29.ffn_down.weight"] == types["blk.28.attn_q.weight"] == "F16"  # the F16 tail
    assert types["blk.27.ffn_down.weight"] == types["blk.0.attn_q.weight"] == "Q4_0"  # the river
    assert {t.name: t.tensor_type.name for t in GGUFReader(p0).tensors}["blk.29.ffn_down.weight"] == "Q4_0"


def test_eval_river_gguf_presets_and_controls(small_river_gguf, monkeypatch):
    # The default River GGUF is taken from the fixture instead of being built (minutes).
    monkeypatch.setattr(evaluate, "river_gguf_path", lambda model="smollm2": small_river_gguf)
    s = Settings(setups=[Setup("River GGUF", evaluate.RIVER_GGUF, None, taus=(0.98,), tails=(2,),
                               river_only_tails=(0, 2), presets=True, river_head=True)],
                 controls=(0, 2), ladder=("q8_0",), score_items=1, score_tokens=12, gen_items=1, gen_tokens=4,
                 prompt_tokens=32, n_ctx=256, progress=False)
    rep = evaluate.run_eval(s)
    rows = {r["label"]: r for r in rep["rows"]}
    river, backbone = evaluate.river_types(rep["river_gguf"]["metadata"])
    control0, control2 = evaluate.control_label(0, river, backbone), evaluate.control_label(2, river, backbone)
    assert set(rows) == {"preset fast", "preset balanced", "river-only", "river-only tail=2", "tau=0.98 tail=2",
                         control0, control2, "Q8_0"}
    assert rep["river_gguf"]["file"] == os.path.basename(small_river_gguf)
    assert rows["preset balanced"]["preset_options"]["tail"] == 2 and rows["preset balanced"]["tau"] == 0.98
    # A preset is exactly its options: preset balanced == the explicit tau=0.98 tail=2 row; preset
    # fast == river-only tail=2; and river-only (+ tail) on river_gguf == its hybrid file.
    for d in ("gsm8k", "humaneval"):
        for key in ("kld", "ppl", "same_top"):
            assert rows["preset balanced"]["domains"][d][key] == rows["tau=0.98 tail=2"]["domains"][d][key]
            assert rows["preset fast"]["domains"][d][key] == rows["river-only tail=2"]["domains"][d][key]
        assert rows["river-only tail=2"]["domains"][d]["kld"] != rows["river-only"]["domains"][d]["kld"]
        assert rows["preset fast"]["domains"][d]["kld"] > 0 and 0 < rows["preset fast"]["domains"][d]["same_top"] <= 1
        assert rows[control0]["domains"][d]["decode_tok_s"] > 0
        assert rows[control0]["domains"][d]["engine"] == "llama.cpp"
        assert rows["preset fast"]["domains"][d]["engine"] == "river_gguf"
    a = rep["analysis"]
    assert [c["same_kld"] for c in a["consistency"]] == [True, True]
    t = {x["ref"]: x for x in a["targets"]}
    assert t["Q4_0"]["met"] is None and t["Q4_K_M"]["met"] is None  # not in this run's ladder
    assert [c["preset"] for c in t["Q8_0"]["presets"]] == ["fast", "balanced"]
    assert set(rep["paired"]["fast"]) == {"Q8_0"} and len(rep["paired"]["fast"]["Q8_0"]["kld_ci"]) == 2
    assert {e["preset"] for e in a["presets"]} == {"fast", "balanced"}
    assert set(a["dynamic_vs_static"]["River GGUF"]) == {"llama.cpp", "river_gguf"}
