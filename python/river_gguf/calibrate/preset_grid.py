"""Measuring the preset grid of a River GGUF on the calibration split (KL divergence from a
reference, the converter's F16 input or the file's own backbone, teacher-forced, each setting run
as it runs in use; and the cost model's cost of each setting) and storing the chosen presets in
the file. The stored format lives in river_gguf.presets, which the runtime reads; the grid and
the cost model in calibrate.cost_model."""
from __future__ import annotations

import time
from typing import List, Optional

from tqdm import tqdm

from ..gguf.meta import set_river_metadata
from ..measure import divergence
from ..measure.scoring import calibration_prepared, prepare
from ..measure.tails import river_tails
from ..options import EXIT_RULES, never_exit
from ..profile import predicted_mean_exit, similarity_profile
from ..presets import ANCHORS_KEY, DEFAULT_KEY, DEFAULT_PRESET, GRID_KEY, PRESET_KEY, complete, dump
from . import open_model
from .cost_model import (DYNAMIC_TAUS, backbone_layers_per_step, choose, grid, plan, setting_cost, setting_step, step_bytes,
                         tier_bounds, weight_bytes)


#: The share of the calibration items the dynamic settings are scored on, through decode (the
#: static ones are scored on all of them, batched): decode is what a calibration spends its time on.
#: A backbone the cost model already chose (cost_model.plan) is measured on the same share.
DYNAMIC_SHARE = 0.25
#: Items a KLD needs for its item-bootstrap interval: with fewer, the resamples are too few for a
#: "95%" to mean anything, and a row gets no interval.
MIN_INTERVAL_ITEMS = 10


def calibrate_presets(model, items=None, score_tokens: int = 64, progress: bool = True,
                      settings: Optional[List[dict]] = None, batched: bool = True, min_tokens: int = 1024,
                      prepared=None, reference=None, prune: bool = False, profile=None,
                      exit_rule: Optional[str] = None) -> dict:
    """Measure `settings` (default: grid()) on the calibration split and choose the presets.

    Quality is the KL divergence of each setting's next-token distribution from the reference's,
    teacher-forced, per scored token. The reference is `reference` (divergence.ReferenceRows,
    one block of rows per prepared item: the converter passes its input's, the F16) or, when
    None, the same file's backbone in one batched pass per item. With batched=True (the default)
    every static setting (the backbone, river-only with a tail, with or without the backbone's
    attention) runs each whole item, prompt included, as one batch in that setting: the prompt is
    prefilled as that setting prefills it in use (a river-only preset prefills with the river).
    The dynamic settings run through decode with exits live, on every fourth item
    (DYNAMIC_SHARE). batched=False scores everything through decode, on every item.

    prune=True measures only what cost_model.plan says can win a tier; the other settings stay in
    the rows with their cost and why they were not measured, and no KLD. profile: the backbone's
    similarity profile (profile.similarity_profile), from which plan predicts where a dynamic
    setting's tokens exit. exit_rule: the dynamic settings' rule (default: the model's), and the
    rule of `profile`; the default grid's taus are the rule's (cost_model.dynamic_taus).

    Each measured row keeps its KLD with an item-bootstrap interval (none on fewer than
    MIN_INTERVAL_ITEMS items), how it was scored and on how many tokens, and its per-item KLD
    sums ("item_kld", on the items listed in "items"), so cost_model.choose can compare two
    settings on the items both were scored on. Cost is the step's decode cost (step_bytes over
    weight_bytes(measure="cost")), against the tier bounds of tier_bounds; each row also records
    the bytes the step reads. items: {domain: [Item]}, or None for calibration items until
    min_tokens scored tokens; prepared: the (tokens, prefix) items themselves (reference's order).
    Returns {"presets", "rows", "anchors", "reference", ...}."""

    if prepared is None:
        prepared = (calibration_prepared(model, min_tokens, score_tokens) if items is None
                    else [p for its in items.values() for p in prepare(model, its, score_tokens)])
    if reference is not None and len(reference) != len(prepared):
        raise ValueError(f"the reference has {len(reference)} items, the calibration {len(prepared)}")
    rule = model.exit_options.exit_rule if exit_rule is None else exit_rule
    if settings is None:
        if profile is None and rule not in DYNAMIC_TAUS:  # its taus come from its profile
            profile = similarity_profile(model, exit_rule=rule)
        settings = grid(model.n_layer, exit_rule=rule, profile=profile)
    layers, head = weight_bytes(model, "cost")
    layers_b, head_b = weight_bytes(model, "bytes")
    L = model.n_layer
    anchors = tier_bounds(model, layers, head)
    exit_guess = None if profile is None else (lambda o: predicted_mean_exit(
        profile, o["threshold"], o.get("min_exit_layer", 0), o.get("tail", 0)))
    skip = plan(settings, layers, head, L, anchors["bounds"], exit_guess) if prune else [""] * len(settings)
    configs = {i: dict(exit_layer=None, **complete(opts)) for i, opts in enumerate(settings) if not skip[i]}
    static = {i for i, o in configs.items() if batched and divergence.is_static(o)}
    stride = round(1 / DYNAMIC_SHARE) if batched else 1
    # A backbone plan already chose is measured for its KLD only: on the dynamic settings' share.
    informative = {i for i in configs if prune and configs[i].get("mode") == "backbone"}
    every = {i: (1 if i in static and i not in informative else stride) for i in configs}
    own_backbone = reference is None
    label = reference.label if reference is not None else "backbone"
    runs = {i: divergence.DivergenceRun() for i in configs}
    ref_only = []  # per item, the reference scored against itself: its perplexity on any subset
    n_scored = lambda k: len(prepared[k][0]) - prepared[k][1]  # noqa: E731
    total = sum(n_scored(k) for k in range(len(prepared)) for i in configs if k % every[i] == 0)
    with tqdm(total=total, desc="presets", unit="tok", disable=not progress) as bar:
        for k, (toks, prefix) in enumerate(prepared):
            targets = toks[prefix:]
            ref = (reference[k] if not own_backbone
                   else divergence.reference_logits(model, toks, prefix, batched=batched, mode="backbone"))
            ref_only.append(divergence.DivergenceRun())
            ref_only[-1].add(divergence.compare(ref, ref, targets))
            want = [i for i in configs if k % every[i] == 0]
            shared = {}  # river-only tails of one family: one pass of their common river layers
            for idx in _river_only_families(configs, [i for i in want if i in static]):
                o = configs[idx[0]]
                rows = river_tails(model, toks[:len(toks) - 1], [configs[j]["tail"] for j in idx],
                                         river_attention=o["river_attention"], river_head=o.get("river_head", True),
                                         first_row=prefix - 1)
                shared.update(zip(idx, rows))
            for i in want:
                o = configs[i]
                t0 = time.perf_counter()
                if own_backbone and divergence.is_static(o) and o.get("mode") == "backbone":
                    logits, exits = ref, [L - 1] * (len(targets) - 1)  # the reference itself: KLD 0
                elif i in shared:
                    logits, exits = shared.pop(i), [-1] * (len(targets) - 1)
                else:
                    logits, exits = divergence.config_logits(model, toks, prefix, batched=i in static, **o)
                runs[i].add(divergence.compare(ref, logits, targets), exits)
                runs[i].seconds += time.perf_counter() - t0
                bar.update(len(targets))
    river_only_cost = step_bytes(layers, head, L, -1, 0, True)
    rows = []
    for i, opts in enumerate(settings):
        if skip[i]:
            guess = float("nan") if exit_guess is None or opts.get("mode") != "river" else exit_guess(opts)
            cost = setting_cost(opts, layers, head, L, guess)
            rows.append({"options": dict(opts), "cost": cost, "relative_cost": cost / river_only_cost,
                         "scored": "not measured", "why": skip[i]})
            continue
        r = runs[i]
        step = setting_step(opts, L, r.mean_exit_layer)
        mean_exit = float(step[0])
        cost = setting_cost(opts, layers, head, L, mean_exit)
        s = divergence.summarize(r)
        n_items = len(r.items)
        interval = n_items >= MIN_INTERVAL_ITEMS
        rows.append({"options": dict(opts), "kld": s["kld"], "kld_ci": s["kld_ci"] if interval else None,
                     "interval": (f"{divergence.CONFIDENCE:.0%} item bootstrap over {n_items} items"
                                  if interval else f"none: {n_items} items"),
                     "same_top": s["same_top"], "ppl": r.perplexity, "mean_exit_layer": mean_exit, "cost": cost,
                     "bytes": step_bytes(layers_b, head_b, L, *step),
                     "relative_cost": cost / river_only_cost,
                     "backbone_layers": backbone_layers_per_step(L, mean_exit, opts.get("tail", 0)),
                     "reference": label, "reference_ppl": divergence.merge(
                         [ref_only[k] for k in range(0, len(prepared), every[i])]).perplexity,
                     "scored": ("batched, own prefill" if i in static else "decode"),
                     "n_tokens": r.n_tokens, "items": list(range(0, len(prepared), every[i])),
                     "item_kld": divergence.item_klds(r)})
    chosen = choose(rows, anchors["bounds"])
    measured = [r for r in rows if "kld" in r]
    return {"presets": chosen, "rows": rows, "anchors": anchors, "reference": label,
            "reference_ppl": divergence.merge(ref_only).perplexity, "river_only_cost": river_only_cost,
            "backbone_cost": step_bytes(layers, head, L, L - 1, 0, False),
            "n_tokens": min((r["n_tokens"] for r in measured if r["items"] == list(range(len(prepared)))),
                            default=min(r["n_tokens"] for r in measured))}


#: What the presets' KLDs are measured from ("F16": the converter's input; "backbone": the file's own).
REFERENCE_KEY = "river.presets_reference"
#: What river.presets_grid keeps of each row.
GRID_FIELDS = ("options", "kld", "kld_ci", "interval", "same_top", "ppl", "cost", "bytes", "relative_cost",
               "mean_exit_layer", "reference", "scored", "why", "n_tokens", "items", "item_kld")


def _river_only_families(configs: dict, static: List[int]) -> List[List[int]]:
    """The static river-only settings among `static` grouped by family (the same head and
    attention), families of two or more: their tails share one pass of the river (measure.tails.river_tails)."""
    families: dict = {}
    for i in static:
        o = configs[i]
        if o.get("mode") == "river-only":
            families.setdefault((o["river_attention"], bool(o.get("river_head", True))), []).append(i)
    return [idx for idx in families.values() if len(idx) > 1]


def preset_metadata(res: dict, default: str = DEFAULT_PRESET) -> dict:
    """The river.* keys that store calibrated presets, and every measured setting (so the tiers
    can be chosen again without measuring)."""
    grid_rows = [{k: r[k] for k in GRID_FIELDS if k in r} for r in res["rows"]]
    return {PRESET_KEY: dump(res["presets"]), DEFAULT_KEY: default, GRID_KEY: dump(grid_rows),
            ANCHORS_KEY: dump(res["anchors"]), "river.presets_calibration_tokens": int(res["n_tokens"]),
            REFERENCE_KEY: res["reference"]}


def calibrate_presets_file(path: str, n_threads: int = 2, progress: bool = True, min_tokens: int = 1024,
                           score_tokens: int = 64) -> dict:
    """Measure the preset grid on the calibration split (at least min_tokens scored tokens per
    static setting) and store the presets in the file (atomic rewrite of its metadata). Returns
    the keys written."""
    # A threshold that never passes, whatever the file's rule: the grid sets its own, and the file needs no profile.
    m = open_model(path, n_ctx=1024, n_threads=n_threads, threshold=max(never_exit(r) for r in EXIT_RULES))
    res = calibrate_presets(m, score_tokens=score_tokens, progress=progress, min_tokens=min_tokens)
    del m  # release the mapping before the file is replaced
    return set_river_metadata(path, preset_metadata(res))
