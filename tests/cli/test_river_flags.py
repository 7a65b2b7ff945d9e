"""RiverOptions' exit fields and their command-line flags are generated from ExitOptions (and one
table of flags), so every field of the exit setting is an option of Model, Llama and the CLI."""
import argparse
from dataclasses import dataclass, fields

from river_gguf.cli.common import add_exit_args, river_options
from river_gguf.options import EXIT_FIELDS, EXIT_FLAGS, ExitOptions, RiverOptions, river_options_class

# A value of each exit field's type, as text on the command line and as RiverOptions holds it.
SAMPLE = {"mode": ("river", "river"), "exit_rule": ("cosine", "cosine"), "threshold": ("0.5", 0.5),
          "min_exit_layer": ("2", 2), "exit_layer": ("3", 3), "prefill": ("river", "river"), "tail": ("1", 1),
          "river_attention": ("backbone", "backbone"), "draft_max": ("6", 6), "draft_p_min": ("0.25", 0.25),
          "draft_mode": ("river", "river")}


def test_every_exit_field_is_an_option_with_a_flag():
    assert set(EXIT_FIELDS) == {"preset"} | {f.name for f in fields(ExitOptions)}
    assert set(EXIT_FLAGS) <= set(EXIT_FIELDS)  # the table names no field that is gone
    p = argparse.ArgumentParser()
    add_exit_args(p)
    for name in EXIT_FIELDS:
        if name in ("river_head", "ngram_draft", "adaptive_draft"):  # --flag / --no-flag
            flag = "--" + name.replace("_", "-")
            assert getattr(river_options(p.parse_args([flag])), name) is True
            no = river_options(p.parse_args(["--no-" + flag[2:]]))
            assert getattr(no, name) is False and no.exit_overrides() == {name: False}
            continue
        if name == "preset":
            args = p.parse_args(["--preset", "fast"])
            assert river_options(args).preset == "fast"
            continue
        text, value = SAMPLE[name]
        flag = next(f for f in fields(RiverOptions) if f.name == name).metadata["flags"][0]
        got = river_options(p.parse_args([flag, text]))
        assert getattr(got, name) == value and got.exit_overrides() == {name: value}


def test_a_new_exit_field_gets_an_option_and_a_flag():
    @dataclass(frozen=True)
    class Wider(ExitOptions):
        margin: float = 0.0       # not in EXIT_FLAGS
        clamp: bool = False

    cls = river_options_class(Wider)
    by_name = {f.name: f for f in fields(cls)}
    assert [f.name for f in fields(cls)][:2] == ["river", "preset"]
    m = by_name["margin"].metadata
    assert m["exit"] and m["river_only"] and m["flags"] == ("--margin",) and m["argparse"]["type"] is float
    assert by_name["clamp"].metadata["bool_flag"] and by_name["clamp"].metadata["flags"] == ("--clamp",)
    opts = cls.of(margin=0.5)
    assert opts.margin == 0.5 and opts.exit_overrides() == {"margin": 0.5}
    # The class everyone uses is the one generated from ExitOptions itself.
    assert [f.name for f in fields(RiverOptions)] == [f.name for f in fields(river_options_class())]
