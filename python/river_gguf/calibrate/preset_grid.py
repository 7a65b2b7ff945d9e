"""Measuring the preset grid of a River GGUF on the calibration split (KL divergence from its
backbone, teacher-forced through the decode path, and the cost model's cost of each setting) and
storing the chosen presets in the file. The stored format, the grid and the cost model live in
river_gguf.presets, which the runtime reads."""
from __future__ import annotations

from typing import List, Optional

from tqdm import tqdm

from ..gguf.meta import set_river_metadata
from ..measure import divergence
from ..measure.scoring import calibration_prepared, prepare
from ..presets import ANCHORS_KEY, DEFAULT_KEY, DEFAULT_PRESET, GRID_KEY, PRESET_KEY, complete, dump
from . import open_model
from .cost_model import (EXIT_TEST_COST, backbone_layers_per_step, choose, grid, setting_step, step_bytes, tier_bounds,
                         weight_bytes)


#: The share of the calibration items the dynamic settings are scored on, through decode (the
#: static ones are scored on all of them, batched): decode is what a conversion spends its time on.
DYNAMIC_SHARE = 0.25


def calibrate_presets(model, items=None, score_tokens: int = 64, progress: bool = True,
                      settings: Optional[List[dict]] = None, batched: bool = True, min_tokens: int = 1024) -> dict:
    """Measure `settings` (default: grid()) on the calibration split and choose the presets.

    Quality is the KL divergence of each setting's next-token distribution from the backbone's
    (the same file in backbone mode), teacher-forced. With batched=True (the default) every
    static setting (the backbone, river-only with a tail, with or without the backbone's
    attention) is scored at prefill speed (divergence.score_batched: one backbone pass over each
    prompt, then the completion as one batch per setting, against the backbone's batch), and the
    dynamic settings through decode with exits live, against the backbone's decode, on every
    fourth item (DYNAMIC_SHARE). batched=False scores everything through decode, on every item.
    Each row keeps its KLD's item-bootstrap interval, how it was scored and on how many tokens.
    Each row also keeps its per-item KLD sums ("item_kld", on the items listed in "items"), so
    cost_model.choose can compare two settings on the items both were scored on. Cost is the step's
    decode cost (step_bytes over weight_bytes(measure="cost")), against the tier bounds of
    tier_bounds; each row also records the bytes the step reads. items: {domain: [Item]}, or
    None for calibration items until min_tokens scored tokens.
    Returns {"presets", "rows", "anchors", "backbone_ppl", ...}."""

    prepared = (calibration_prepared(model, min_tokens, score_tokens) if items is None
                else [p for its in items.values() for p in prepare(model, its, score_tokens)])
    settings = grid(model.n_layer) if settings is None else settings
    layers, head = weight_bytes(model, "cost")
    layers_b, head_b = weight_bytes(model, "bytes")
    L = model.n_layer
    configs = {i: dict(exit_layer=None, **complete(opts)) for i, opts in enumerate(settings)}
    static = {i: o for i, o in configs.items() if batched and divergence.is_static(o)}
    dynamic = {i: o for i, o in configs.items() if i not in static}
    stride = round(1 / DYNAMIC_SHARE) if batched else 1
    sub = prepared[::stride]
    n_tok = lambda ps: sum(len(t) - p for t, p in ps)  # noqa: E731
    with tqdm(total=n_tok(prepared) * len(static) + n_tok(sub) * (len(dynamic) + 1), desc="presets", unit="tok",
              disable=not progress) as bar:
        runs = divergence.score_batched(model, static, prepared, dict(mode="backbone"), bar=bar) if static else {}
        decoded = {i: (model, o) for i, o in dynamic.items()}
        decoded["backbone"] = (model, dict(mode="backbone", exit_layer=None))
        runs.update(divergence.score_configs(model, decoded, sub, bar=bar))
    decoded_backbone = runs.pop("backbone")
    # The backbone's own perplexity, on the items and in the way most settings were scored.
    bb = next((i for i, o in configs.items() if o.get("mode") == "backbone"), None)
    base = runs[bb] if bb is not None and bb in static else decoded_backbone
    river_only_cost = step_bytes(layers, head, L, -1, 0, True)
    rows = []
    for i, opts in enumerate(settings):
        r = runs[i]
        step = setting_step(opts, L, r.mean_exit_layer)
        mean_exit = float(step[0])
        cost = step_bytes(layers, head, L, *step)
        if opts.get("mode") == "river" and not divergence.is_static(configs[i]):  # the layers the exit tests
            cost += EXIT_TEST_COST * (min(mean_exit, L - 1 - opts.get("tail", 0)) + 1)
        s = divergence.summarize(r)
        rows.append({"options": dict(opts), "kld": s["kld"], "kld_ci": s["kld_ci"], "same_top": s["same_top"],
                     "ppl": r.perplexity, "mean_exit_layer": mean_exit, "cost": cost,
                     "bytes": step_bytes(layers_b, head_b, L, *step),
                     "relative_cost": cost / river_only_cost,
                     "backbone_layers": backbone_layers_per_step(L, mean_exit, opts.get("tail", 0)),
                     "backbone_ppl": base.perplexity, "scored": "batched" if i in static else "decode",
                     "n_tokens": r.n_tokens, "items": list(range(0, len(prepared), 1 if i in static else stride)),
                     "item_kld": divergence.item_klds(r)})
    anchors = tier_bounds(model, layers, head)
    chosen = choose(rows, anchors["bounds"])
    return {"presets": chosen, "rows": rows, "anchors": anchors, "backbone_ppl": base.perplexity,
            "river_only_cost": river_only_cost, "backbone_cost": step_bytes(layers, head, L, L - 1, 0, False),
            "n_tokens": min(r["n_tokens"] for r in rows if r["scored"] == "batched" or not batched)}


def preset_metadata(res: dict, default: str = DEFAULT_PRESET) -> dict:
    """The river.* keys that store calibrated presets, and every measured setting (so the tiers
    can be chosen again without measuring)."""
    grid_rows = [{k: r[k] for k in ("options", "kld", "kld_ci", "same_top", "ppl", "cost", "bytes", "relative_cost",
                                    "mean_exit_layer", "scored", "n_tokens", "items", "item_kld")} for r in res["rows"]]
    return {PRESET_KEY: dump(res["presets"]), DEFAULT_KEY: default, GRID_KEY: dump(grid_rows),
            ANCHORS_KEY: dump(res["anchors"]), "river.presets_calibration_tokens": int(res["n_tokens"])}


def calibrate_presets_file(path: str, n_threads: int = 2, progress: bool = True, min_tokens: int = 1024,
                           score_tokens: int = 64) -> dict:
    """Measure the preset grid on the calibration split (at least min_tokens scored tokens per
    static setting) and store the presets in the file (atomic rewrite of its metadata). Returns
    the keys written."""
    m = open_model(path, n_ctx=1024, n_threads=n_threads, threshold=2.0)
    res = calibrate_presets(m, score_tokens=score_tokens, progress=progress, min_tokens=min_tokens)
    del m  # release the mapping before the file is replaced
    return set_river_metadata(path, preset_metadata(res))
