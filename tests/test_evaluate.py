"""Evaluation harness: data split, shuffle control, tau selection/calibration, metadata rewrite,
and a tiny end-to-end run of the eval (the --quick checks on even smaller settings)."""
import argparse
import json
import os

import numpy as np
import pytest

from river_gguf import eval_data, evaluate
from river_gguf.evaluate import Setup, Settings


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
    assert evaluate.select_tau(rows, 6.0, 0.02)["threshold"] == 0.99      # limit 6.12
    assert evaluate.select_tau(rows, 6.0, 0.03)["threshold"] == 0.98      # limit 6.18
    assert evaluate.select_tau(rows, 6.0, 0.06)["threshold"] == 0.97
    assert evaluate.select_tau(rows, 6.0, 0.5)["threshold"] == 0.96
    none = evaluate.select_tau(rows, 6.0, 0.001)
    assert not none["feasible"] and none["threshold"] > 1.0               # never exit
    # Not monotone in tau: the fastest within budget wins, whatever its tau.
    rows2 = rows + [{"tau": 0.975, "ppl": 6.1, "mean_exit_layer": 9.0}]
    assert evaluate.select_tau(rows2, 6.0, 0.02)["threshold"] == 0.975
    # Ties in depth: the faster measured speed.
    rows3 = [{"tau": 0.97, "ppl": 6.0, "mean_exit_layer": 5.0, "tok_s": 90.0},
             {"tau": 0.98, "ppl": 6.0, "mean_exit_layer": 5.0, "tok_s": 100.0}]
    assert evaluate.select_tau(rows3, 6.0, 0.0)["threshold"] == 0.98


def test_agreement():
    share, pre = evaluate.agreement([[1, 2, 3, 4], [5, 6]], [[1, 2, 9, 4], [5, 6, 7]])
    assert share == pytest.approx((3 + 2) / (4 + 3)) and pre == pytest.approx((2 + 2) / 2)


def test_parse_budget_and_cli_parsers():
    from river_gguf import cli, eval_cli

    assert eval_cli.parse_budget("2%") == pytest.approx(0.02)
    assert eval_cli.parse_budget("0.05") == pytest.approx(0.05)
    common = cli.Common(cli._parent(cli.add_model_args), cli._parent(cli.add_exit_args),
                        cli._parent(cli.add_sampling_args, 128, 0.0), cli._parent(cli.add_sampling_args, None, 0.2))
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="command")
    eval_cli.register_eval(sub, common)
    eval_cli.register_calibrate(sub, common)
    a = p.parse_args(["calibrate", "m.river.gguf", "--budget", "3%", "--write", "--taus", "0.97,0.98"])
    assert a.budget == pytest.approx(0.03) and a.write and a.taus == (0.97, 0.98) and a.model == "m.river.gguf"
    a = p.parse_args(["eval", "--quick", "--out", "d", "--text", "x.txt", "--text", "y.jsonl"])
    assert a.quick and a.text == ["x.txt", "y.jsonl"] and a.domains == "gsm8k,humaneval"


# ----- metadata rewrite ----------------------------------------------------------------
def test_set_river_metadata_roundtrip(tmp_path):
    import gguf
    from gguf import GGMLQuantizationType as QT

    from river_gguf.gguf_meta import set_river_metadata

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
    before = {t.name: bytes(t.data.tobytes()) for t in gguf.GGUFReader(str(path)).tensors}

    out = set_river_metadata(str(path), {"river.threshold": 0.975, "river.threshold_source": "calibrated",
                                         "river.calibration_budget": 0.02, "river.backbone_ppl": 6.5})
    r = gguf.GGUFReader(str(path))
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

    return Model(f16_path, river=q4_0_path, n_ctx=512, n_threads=2)


@pytest.fixture(scope="module")
def cal_items():
    return {d: eval_data.select(eval_data.load_domain(d), "calibration", 1) for d in eval_data.DOMAINS}


def test_forced_exits_reproduce_the_river_run(river_model, cal_items):
    # The shuffle control's scorer, fed the River run's own exit layers, must give the same logprobs.
    prep = evaluate.prepare(river_model, cal_items["gsm8k"], score_tokens=24)
    r = evaluate.score_items(river_model, prep, mode="river", threshold=0.975)
    f = evaluate.score_forced(river_model, prep, r.exits)
    np.testing.assert_array_equal(r.logprobs, f.logprobs)
    assert len(set(e for ex in r.exits for e in ex)) > 1  # a real mix of depths


def test_calibrate_within_budget(river_model, cal_items):
    taus = (0.96, 0.975, 0.99, 1.01)
    res = evaluate.calibrate(river_model, budget=0.02, taus=taus, items=cal_items, score_tokens=24, progress=False)
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


def test_eval_tiny_end_to_end(f16_path, q4_0_path, tmp_path):
    s = Settings(setups=[Setup("F16+Q4_0", "f16", "q4_0", taus=(0.975,), fixed_exits=(10,), shuffle_taus=(0.975,),
                               backbone_row=True)],
                 ladder=("q4_0",), score_items=1, score_tokens=40, gen_items=1, gen_tokens=8, prompt_tokens=48, n_ctx=512,
                 progress=False)
    rep = evaluate.run_eval(s)
    rows = {r["label"]: r for r in rep["rows"]}
    assert set(rows) == {"F16 backbone", "Q4_0 river-only", "tau=0.975", "exit@10", "shuffle(tau=0.975)#0",
                         "shuffle(tau=0.975)#1", "Q4_0"}
    for d in ("gsm8k", "humaneval"):
        assert rows["F16 backbone"]["domains"][d]["ppl"] < rows["Q4_0 river-only"]["domains"][d]["ppl"]
        assert rows["F16 backbone"]["domains"][d]["agreement"] == 1.0
        assert rows["F16 backbone"]["domains"][d]["mean_exit_layer"] == 29
        assert rows["exit@10"]["domains"][d]["mean_exit_layer"] == 10
        assert rows["shuffle(tau=0.975)#0"]["domains"][d]["histogram_preserved"]
        assert rows["Q4_0"]["domains"][d]["decode_tok_s"] > 0
        assert 1.0 < rows["tau=0.975"]["domains"][d]["ppl"] < 100.0
    assert not evaluate.sanity_failures(rep)
    paths = evaluate.write_outputs(rep, str(tmp_path / "out"))
    assert all(os.path.getsize(p) > 0 for p in paths.values())
    assert json.load(open(paths["json"]))["rows"]
