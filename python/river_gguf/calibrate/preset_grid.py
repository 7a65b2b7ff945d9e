"""Measuring the preset grid of a River GGUF on the calibration split (KL divergence from its
backbone, teacher-forced through the decode path, and the cost model's cost of each setting) and
storing the chosen presets in the file. The stored format, the grid and the cost model live in
river_gguf.presets, which the runtime reads."""
from __future__ import annotations

from typing import List, Optional

from tqdm import tqdm

from ..gguf.meta import set_river_metadata
from ..measure import divergence
from ..measure.scoring import calibration_items, prepare
from ..presets import (ANCHORS_KEY, DEFAULT_KEY, DEFAULT_PRESET, EXIT_TEST_COST, GRID_KEY, PRESET_KEY,
                       backbone_layers_per_step, choose, complete, dump, grid, setting_step, step_bytes, tier_bounds,
                       weight_bytes)
from . import open_model


def calibrate_presets(model, items=None, score_tokens: int = 64, progress: bool = True,
                      settings: Optional[List[dict]] = None) -> dict:
    """Measure `settings` (default: grid()) on the calibration split and choose the presets.

    Quality is the KL divergence of each setting's next-token distribution from the backbone's
    (the same file in backbone mode), both teacher-forced through the decode path with exits live
    (a batched pass is a different computation for quantized weights: measure/divergence.py). Cost
    is the step's decode cost (step_bytes over weight_bytes(measure="cost")), against the tier
    bounds of tier_bounds; each row also records the bytes the step reads.
    Returns {"presets", "rows", "anchors", "backbone_ppl", ...}."""

    items = calibration_items() if items is None else items
    prepared = [p for its in items.values() for p in prepare(model, its, score_tokens)]
    settings = grid(model.n_layer) if settings is None else settings
    layers, head = weight_bytes(model, "cost")
    layers_b, head_b = weight_bytes(model, "bytes")
    L = model.n_layer
    n_tok = sum(len(t) - p for t, p in prepared)
    configs = {i: (model, dict(exit_layer=None, **complete(opts))) for i, opts in enumerate(settings)}
    configs["backbone"] = (model, dict(mode="backbone", exit_layer=None))
    with tqdm(total=n_tok * len(configs), desc="presets", unit="tok", disable=not progress) as bar:
        runs = divergence.score_configs(model, configs, prepared, bar=bar)
    base = runs.pop("backbone")
    river_only_cost = step_bytes(layers, head, L, -1, 0, True)
    rows = []
    for i, opts in enumerate(settings):
        r = runs[i]
        static = divergence.is_static(configs[i][1])
        step = setting_step(opts, L, r.mean_exit_layer)
        mean_exit = float(step[0])
        cost = step_bytes(layers, head, L, *step)
        if opts.get("mode") == "river" and not static:  # the layers the exit tests
            cost += EXIT_TEST_COST * (min(mean_exit, L - 1 - opts.get("tail", 0)) + 1)
        s = divergence.summarize(r)
        rows.append({"options": dict(opts), "kld": s["kld"], "kld_ci": s["kld_ci"], "same_top": s["same_top"],
                     "ppl": r.perplexity, "mean_exit_layer": mean_exit, "cost": cost,
                     "bytes": step_bytes(layers_b, head_b, L, *step),
                     "relative_cost": cost / river_only_cost,
                     "backbone_layers": backbone_layers_per_step(L, mean_exit, opts.get("tail", 0)),
                     "backbone_ppl": base.perplexity})
    anchors = tier_bounds(model, layers, head)
    chosen = choose(rows, anchors["bounds"])
    return {"presets": chosen, "rows": rows, "anchors": anchors, "backbone_ppl": base.perplexity,
            "river_only_cost": river_only_cost, "backbone_cost": step_bytes(layers, head, L, L - 1, 0, False),
            "n_tokens": base.n_tokens, "items": {d: [it.id for it in its] for d, its in items.items()}}


def preset_metadata(res: dict, default: str = DEFAULT_PRESET) -> dict:
    """The river.* keys that store calibrated presets, and every measured setting (so the tiers
    can be chosen again without measuring)."""
    grid_rows = [{k: r[k] for k in ("options", "kld", "same_top", "ppl", "cost", "bytes", "relative_cost",
                                    "mean_exit_layer")} for r in res["rows"]]
    return {PRESET_KEY: dump(res["presets"]), DEFAULT_KEY: default, GRID_KEY: dump(grid_rows),
            ANCHORS_KEY: dump(res["anchors"]), "river.presets_calibration_tokens": int(res["n_tokens"])}


def calibrate_presets_file(path: str, n_threads: int = 2, progress: bool = True, items_per_domain: int = 8,
                           score_tokens: int = 64) -> dict:
    """Measure the preset grid on the calibration split and store the presets in the file
    (atomic rewrite of its metadata). Returns the keys written."""
    m = open_model(path, n_ctx=1024, n_threads=n_threads, threshold=2.0)
    items = calibration_items(per_domain=items_per_domain)
    res = calibrate_presets(m, items=items, score_tokens=score_tokens, progress=progress)
    del m  # release the mapping before the file is replaced
    return set_river_metadata(path, preset_metadata(res))
