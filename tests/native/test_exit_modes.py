"""The exit-mode codes have one table (native/engine.h kExitModes); Python reads it from there."""
from river_gguf import _native
from river_gguf.options import EXIT_MODES, MODES, ExitOptions


def test_one_table():
    assert _native.EXIT_MODES == {"backbone": 0, "river": 1, "river-only": 2, "fixed": 3}
    assert EXIT_MODES == _native.EXIT_MODES
    # Every mode but lossless is the engine's; lossless runs the engine's backbone and draft.
    assert set(MODES) - {"lossless"} <= set(EXIT_MODES)


def test_engine_args_use_the_table():
    def mode(prompt=False, **kw):
        return ExitOptions(**kw).engine_args(prompt)["mode"]

    assert mode() == EXIT_MODES["backbone"]
    assert mode(mode="river") == EXIT_MODES["river"]
    assert mode(prompt=True, mode="river") == EXIT_MODES["backbone"]  # prompts never exit by default
    assert mode(prompt=True, mode="river", prefill="river") == EXIT_MODES["river"]
    assert mode(mode="river-only") == EXIT_MODES["river-only"]
    # Lossless: prompts and verify batches are the backbone's, drafts the river's.
    assert mode(mode="lossless") == mode(prompt=True, mode="lossless") == EXIT_MODES["backbone"]
    assert ExitOptions(mode="lossless").draft_args()["mode"] == EXIT_MODES["river-only"]
    assert ExitOptions(mode="lossless", draft_mode="river").draft_args()["mode"] == EXIT_MODES["river"]
    assert mode(mode="river", exit_layer=3) == EXIT_MODES["fixed"]
