"""The presets a pruned, searched calibration chooses on Qwen2.5-Coder-0.5B (24 layers, untied
head) against those of the full, unpruned sweep of the grid on the same items: the cost model's
plan and the tail search must not hide a winner. tests/calibrate/test_presets.py checks the same
on SmolLM2."""
from river_gguf import Model
from river_gguf.calibrate import cost_model, preset_grid
from river_gguf.eval import model_zoo
from river_gguf.options import never_exit

from conftest import QWEN
from support import search_replayed_on_full_sweep


def test_the_search_chooses_the_presets_of_the_full_sweep_on_qwen(qwen_f16):
    """The F16 backbone with its importance-matrix Q4_0 river (the river of the conversion's
    costliest row, where many tails fit a tier) as a separate file, both cached. The search is
    replayed on the sweep's own rows: its decisions are a function of the rows it asks for, so
    the presets it reaches are those a pruned conversion reaches on these items."""
    river = model_zoo.derived(QWEN, "q4_0-imatrix")
    m = Model(qwen_f16, river=river, n_ctx=1024, n_threads=2, threshold=never_exit("cosine"))
    prepared, profile, full, settings, _ = search_replayed_on_full_sweep(m)
    assert len(prepared) >= preset_grid.MIN_INTERVAL_ITEMS
    assert settings == cost_model.grid(m.n_layer, profile=profile) and all("kld" in r for r in full["rows"])
