"""A second exit rule that ships: `update` (native/exit_rules/update.cpp) calibrates through
`river-gguf convert --exit-rule update`, is stored in the file (river.exit_rule) and chosen on
load; the native setting's fields and the rules' bounds reach Python from the module."""
import numpy as np
import pytest

from river_gguf import Model, _native
from river_gguf.cli import main
from river_gguf.options import EXIT_RULES, ExitOptions, max_score, never_exit
from river_gguf.measure.profile import default_threshold, similarity_profile
from river_gguf.eval.random_model import write_tiny_model


def test_rules_and_setting_come_from_the_module():
    assert EXIT_RULES == tuple(r[0] for r in _native.EXIT_RULES) and "update" in EXIT_RULES
    for name, _, bound, never in _native.EXIT_RULES:
        assert max_score(name) == bound and never_exit(name) == never > bound
    # ExitOptions' defaults are the native setting's, under Python's names.
    plain, d = ExitOptions(), _native.ExitSetting().as_dict()
    assert (plain.exit_rule, plain.threshold, plain.tail, plain.min_exit_layer, plain.river_head) == (
        d["rule"], d["threshold"], d["tail"], d["min_exit_layer"], d["river_head"])
    assert plain.river_attention == ("backbone" if d["backbone_attention"] else "river")
    assert plain.threshold == never_exit()  # the default never exits
    s = _native.ExitSetting(mode="river", rule="update", threshold=0.5, backbone_attention=True)
    assert s == _native.ExitSetting(mode=1, rule=EXIT_RULES.index("update"), threshold=0.5, backbone_attention=True)
    o = ExitOptions.from_setting(s)
    assert (o.mode, o.exit_rule, o.threshold, o.river_attention) == ("river", "update", 0.5, "backbone")
    assert o._setting_args()["rule"] == EXIT_RULES.index("update")
    with pytest.raises(ValueError, match="exit rule 'margin'"):
        _native.ExitSetting(rule="margin")


def test_convert_with_exit_rule_stores_it_and_load_chooses_it(tmp_path, capsys):
    bb = write_tiny_model(tmp_path / "bb.gguf", "llama", n_layer=4)
    out = tmp_path / "out.river.gguf"
    rc = main(["convert", str(bb), "-o", str(out), "--exit-rule", "update", "--river-type", "q4_0",
               "--backbone-type", "f16", "--imatrix", "none", "--no-presets", "--threads", "1", "--quiet"])
    assert rc == 0, capsys.readouterr().err
    m = Model(str(out), n_ctx=256, n_threads=1)
    assert m.metadata["river.exit_rule"] == "update"
    assert m.file_options.exit_rule == "update"
    opts = m.exit_options
    assert opts.mode == "river" and opts.exit_rule == "update"
    # tau is the 0.70 quantile of the update rule's mid-layer scores on the profile text (the
    # converter's batched profile of the same backbone), not cosine's.
    sims = similarity_profile(m, own_engine=False, exit_rule="update")
    want = round(float(np.quantile(sims[:, 1:-1], 0.70)), 4)
    assert opts.threshold == float(np.float32(want))
    cos_sims = similarity_profile(m, own_engine=False, exit_rule="cosine")
    assert abs(default_threshold(m, sims=cos_sims)["threshold"] - opts.threshold) > 1e-2
    assert (sims <= max_score("update") + 1e-6).all() and not np.allclose(sims, cos_sims, atol=1e-3)


def test_files_without_the_key_read_as_cosine(tiny):
    m = Model(tiny.river("llama"), n_ctx=64, n_threads=1)
    assert "river.exit_rule" not in m.metadata or m.metadata["river.exit_rule"] == "cosine"
    assert m.exit_options.exit_rule == "cosine" and m.file_options.exit_rule == "cosine"
