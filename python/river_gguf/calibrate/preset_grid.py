"""Measuring the preset grid of a River GGUF on the calibration split (KL divergence from a
reference, the converter's F16 input or the file's own backbone, teacher-forced, each setting run
as it runs in use; and the cost model's cost of each setting) and storing the chosen presets in
the file. The stored format lives in river_gguf.presets, which the runtime reads; the grid and
the cost model in calibrate.cost_model."""
from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
from tqdm import tqdm

from ..gguf.meta import set_river_metadata
from ..measure import divergence
from ..measure.scoring import PRESET_CALIBRATION_TOKENS, PRESET_SCORE_TOKENS, calibration_prepared, prepare
from ..measure.tails import river_tails
from ..options import EXIT_RULES, never_exit
from ..measure.profile import predicted_mean_exit, similarity_profile
from ..presets import ANCHORS_KEY, DEFAULT_KEY, DEFAULT_PRESET, GRID_KEY, PRESET_KEY, Setting, dump
from . import open_model
from .cost_model import (DYNAMIC_TAUS, SCREEN, SEARCHED, backbone_layers_per_step, choose, grid, plan, screen_tiers,
                         search, setting_cost, setting_step, step_bytes, tail_families, tier_bounds, weight_bytes)


#: The share of the calibration items the dynamic settings are scored on, through decode (the
#: static ones, the backbone included, are scored on all of them, batched): decode is what a
#: calibration spends its time on.
DYNAMIC_SHARE = 0.25
#: Items a KLD needs for its item-bootstrap interval: with fewer, the resamples are too few for a
#: "95%" to mean anything, and a row gets no interval.
MIN_INTERVAL_ITEMS = 10
#: A pruned calibration screens a tail on every SCREEN_STRIDE-th item (items 0, 3, 6, ...; the
#: domains alternate, so both are in it) before it measures the tail on the rest.
SCREEN_STRIDE = 3


def screen_items(n_items: int) -> List[int]:
    """The items a screened setting is measured on, of n_items prepared ones."""
    return list(range(0, n_items, SCREEN_STRIDE))


def calibrate_presets(model, items=None, score_tokens: int = PRESET_SCORE_TOKENS, progress: bool = True,
                      settings: Optional[List[Setting]] = None, batched: bool = True,
                      min_tokens: int = PRESET_CALIBRATION_TOKENS,
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

    prune=True measures only what can be a tier's pick: cost_model.plan leaves out what fits no
    tier it could win, and the river-only tails in play are searched (cost_model.search_next:
    each family walked from its deepest tail within a tier's bound towards cheaper ones until one
    is separated from the tier's best, in rounds over the items; where the measured tails'
    KLD does not fall as the tail deepens, the whole family within the bounds is measured). The
    settings left out stay in the rows with their cost and why they were not measured, and no
    KLD. profile: the backbone's similarity profile (measure.profile.similarity_profile), from which plan
    predicts where a dynamic setting's tokens exit. exit_rule: the dynamic settings' rule
    (default: the model's), and the rule of `profile`; the default grid's taus are the rule's
    (cost_model.dynamic_taus).

    Each measured row keeps its KLD with an item-bootstrap interval (none on fewer than
    MIN_INTERVAL_ITEMS items), how it was scored and on how many tokens, and its per-item KLD
    sums ("item_kld", on the items listed in "items"), so cost_model.choose can compare two
    settings on the items both were scored on. Cost is the step's decode cost (step_bytes over
    weight_bytes(measure="cost")), against the tier bounds of tier_bounds; each row also records
    the bytes the step reads. items: {domain: [Item]}, or None for calibration items until
    min_tokens scored tokens; prepared: the (tokens, prefix) items themselves (reference's order).
    Returns {"presets" (presets.Preset by name), "rows" ({"options": the Setting, its numbers...}),
    "anchors", "reference", "search", ...}."""

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
    costs = _SettingCosts(model, settings, profile)
    with _Scorer(model, prepared, reference, batched, progress) as scorer:
        def measure(indices: List[int], screen: Sequence[int] = ()) -> Dict[int, dict]:
            scorer.measure({i: settings[i] for i in list(indices) + list(screen)}, screen=screen)
            return {i: costs.comparable(i, settings[i], scorer) for i in scorer.measured()}

        if prune:
            skip, search_res = _plan_and_search(settings, costs, measure)
        else:
            measure(list(range(len(settings))))
            skip, search_res = [""] * len(settings), {"rounds": 0, "fallback": []}
        rows = [costs.row(i, opts, scorer, skip[i]) for i, opts in enumerate(settings)]
        reference_ppl = scorer.reference_run().perplexity
    chosen = choose(rows, costs.bounds)
    measured = [r for r in rows if "kld" in r]
    return {"presets": chosen, "rows": rows, "anchors": costs.anchors, "reference": scorer.label,
            "reference_ppl": reference_ppl, "river_only_cost": costs.river_only, "search": search_res,
            "backbone_cost": step_bytes(costs.layers, costs.head, costs.n_layer, costs.n_layer - 1, 0, False),
            "n_tokens": min((r["n_tokens"] for r in measured if r["items"] == list(range(len(prepared)))),
                            default=min(r["n_tokens"] for r in measured))}


def plan_and_search(model, settings: List[Setting], measure: Callable[..., Dict[int, dict]],
                    profile=None) -> tuple:
    """What calibrate_presets(prune=True) measures of `settings` on `model`, with `measure` doing
    the measuring: cost_model.plan's settings, then cost_model.search's rounds over the
    river-only tails. measure(indices, screen=()) measures `indices` on every item and `screen`
    on the screen items (screen_items) and returns every row measured so far by setting index
    (choose's "kld", "relative_cost", "items", "item_kld"; "screened" where a row holds the screen
    items alone). profile: the backbone's similarity profile, which predicts the dynamic settings'
    exits. Returns (per setting "" or why it was not measured on every item, {"rounds",
    "fallback", "screened"})."""
    return _plan_and_search(settings, _SettingCosts(model, settings, profile), measure)


def _plan_and_search(settings: List[Setting], costs: "_SettingCosts", measure) -> tuple:
    skip = plan(settings, costs.layers, costs.head, costs.n_layer, costs.bounds, costs.exit_guess, screen=True)
    screen = [i for i, why in enumerate(skip) if why == SCREEN]
    measure([i for i, why in enumerate(skip) if not why], screen=screen)
    families = [[i for i in f if skip[i] in ("", SEARCHED, SCREEN)] for f in tail_families(settings)]
    families = [f for f in families if any(skip[i] in (SEARCHED, SCREEN) for i in f)]
    tiers = screen_tiers(costs.layers, costs.head, costs.n_layer, costs.bounds)
    res = search(families, [costs.static_relative(o) for o in settings], costs.bounds, measure, tiers)
    why = ("the search of its family stopped above it, at a tail separated from the tier's best (95% paired "
           "item bootstrap), and the family's measured KLDs do not rise beyond the items' noise as its tail deepens")
    rows = measure([])
    screened = ("screened on the screen items alone: separated there from the best setting of the tier it was "
                "searched for (95% paired item bootstrap), or its family's search stopped above it")
    skip = [screened if i in rows and rows[i].get("screened") else
            why if w in (SEARCHED, SCREEN) and i not in rows else "" if w in (SEARCHED, SCREEN) else w
            for i, w in enumerate(skip)]
    return skip, {"rounds": res["rounds"], "fallback": [_family_name(settings[i]) for i in res["fallback"]],
                  "screened": sorted(i for i, r in rows.items() if r.get("screened"))}


def replayed_measure(rows: List[dict], asked: set) -> Callable[..., Dict[int, dict]]:
    """A plan_and_search measure that measures nothing: it gives a full sweep's rows (by setting
    index, each with "items" and "item_kld"), a screened setting's restricted to screen_items, and
    adds what it was asked for to `asked` (the search's decisions are a function of the rows it
    asks for, so replaying a sweep's rows shows what a pruned calibration would measure)."""
    screened: set = set()

    def measure(indices: List[int], screen: Sequence[int] = ()) -> Dict[int, dict]:
        screened.difference_update(indices)
        screened.update(i for i in screen if i not in asked)
        asked.update(indices)
        asked.update(screen)
        return {i: (_on_items(rows[i], screen_items(len(rows[i]["items"]))) if i in screened else rows[i])
                for i in asked}

    return measure


def _on_items(row: dict, keep: List[int]) -> dict:
    """A measured row as measured on the items `keep` alone (positions in its items)."""
    items = [row["items"][k] for k in keep]
    per = [row["item_kld"][k] for k in keep]
    return dict(row, items=items, item_kld=per, kld=sum(x for _, x in per) / max(sum(n for n, _ in per), 1),
                screened=True)


def _family_name(setting: Setting) -> str:
    return f"river-only ({setting.options.river_attention} attention)"


class _SettingCosts:
    """The cost model's view of a model's settings: each one's cost, the tier bounds, and the
    rows calibrate_presets stores."""

    def __init__(self, model, settings: List[Setting], profile):
        self.layers, self.head = weight_bytes(model, "cost")
        self.layers_b, self.head_b = weight_bytes(model, "bytes")
        self.n_layer = L = model.n_layer
        self.anchors = tier_bounds(model, self.layers, self.head)
        self.bounds = self.anchors["bounds"]
        self.river_only = step_bytes(self.layers, self.head, L, -1, 0, True)
        self.exit_guess = None if profile is None else (lambda s: predicted_mean_exit(
            profile, s.options.threshold, s.options.min_exit_layer, s.options.tail))

    def static_relative(self, setting: Setting) -> float:
        """A setting's relative cost known before it runs (a dynamic one's least possible)."""
        return setting_cost(setting, self.layers, self.head, self.n_layer) / self.river_only

    def comparable(self, i: int, setting: Setting, scorer: "_Scorer") -> dict:
        """What choose and the search compare of a measured setting."""
        run = scorer.run(i)
        cost = setting_cost(setting, self.layers, self.head, self.n_layer, run.mean_exit_layer)
        row = {"kld": divergence.summarize(run)["kld"], "relative_cost": cost / self.river_only,
               "items": scorer.items(i), "item_kld": divergence.item_klds(run)}
        if scorer.screened(i):
            row["screened"] = True
        return row

    def row(self, i: int, setting: Setting, scorer: "_Scorer", why: str) -> dict:
        L = self.n_layer
        if i not in scorer.measured() or scorer.screened(i):
            guess = float("nan") if self.exit_guess is None or not setting.is_dynamic else self.exit_guess(setting)
            cost = setting_cost(setting, self.layers, self.head, L, guess)
            out = {"options": setting, "cost": cost, "relative_cost": cost / self.river_only,
                   "scored": "not measured", "why": why}
            if i in scorer.measured():  # screened: what the screen found, no KLD to choose by
                out.update(scored="screened", screen_kld=divergence.summarize(scorer.run(i))["kld"],
                           screen_items=scorer.items(i))
            return out
        r = scorer.run(i)
        step = setting_step(setting, L, r.mean_exit_layer)
        mean_exit = float(step[0])
        cost = setting_cost(setting, self.layers, self.head, L, mean_exit)
        s = divergence.summarize(r)
        n_items = len(r.items)
        interval = n_items >= MIN_INTERVAL_ITEMS
        return {"options": setting, "kld": s["kld"], "kld_ci": s["kld_ci"] if interval else None,
                "interval": (f"{divergence.CONFIDENCE:.0%} item bootstrap over {n_items} items"
                             if interval else f"none: {n_items} items, too few for an interval"),
                "same_top": s["same_top"], "ppl": r.perplexity, "mean_exit_layer": mean_exit, "cost": cost,
                "bytes": step_bytes(self.layers_b, self.head_b, L, *step),
                "relative_cost": cost / self.river_only,
                "backbone_layers": backbone_layers_per_step(L, mean_exit, setting.options.tail),
                "reference": scorer.label, "reference_ppl": scorer.reference_run(scorer.items(i)).perplexity,
                "scored": ("batched, own prefill" if scorer.batched_setting(i) else "decode"),
                "n_tokens": r.n_tokens, "items": scorer.items(i), "item_kld": divergence.item_klds(r)}


class _Scorer:
    """Scores settings against the reference on the prepared items, in as many rounds as asked
    (measure), each setting's per-item divergence kept by item. The file's own backbone as the
    reference (reference None) is computed again in each round that visits an item (a pruned
    calibration's later rounds; nothing is kept on disk or in memory between them). Static
    settings run batched on every item (river-only tails of one family in one pass of their
    common river layers, measure.tails.river_tails), dynamic ones by decode on every 1/DYNAMIC_SHARE-th."""

    def __init__(self, model, prepared, reference, batched: bool, progress: bool):
        self.model, self.prepared, self.batched = model, prepared, batched
        self.own = reference is None
        self.reference = reference
        self.label = "backbone" if reference is None else reference.label
        self.stride = round(1 / DYNAMIC_SHARE) if batched else 1
        self._ref_only: Dict[int, divergence.ItemDivergence] = {}
        self._results: Dict[int, Dict[int, tuple]] = {}
        self._static: set = set()
        # Per (river attention, river head, item): the river's hidden state at each branch a
        # family's pass made ({layer: [tokens, n_embd]}), where a later round of that family starts.
        self._branches: Dict[tuple, Dict[int, np.ndarray]] = {}
        self._bar = tqdm(total=0, desc="presets", unit="tok", disable=not progress)

    def __enter__(self) -> "_Scorer":
        return self

    def __exit__(self, *exc) -> None:
        self._bar.close()

    def batched_setting(self, i: int) -> bool:
        return i in self._static

    def measured(self) -> List[int]:
        return sorted(self._results)

    def items(self, i: int) -> List[int]:
        return sorted(self._results[i])

    def run(self, i: int) -> divergence.DivergenceRun:
        r = divergence.DivergenceRun()
        for k in self.items(i):
            d, exits, secs = self._results[i][k]
            r.add(d, exits)
            r.seconds += secs
        return r

    def reference_run(self, items=None) -> divergence.DivergenceRun:
        """The reference scored against itself (its perplexity) on `items` (default: all)."""
        r = divergence.DivergenceRun()
        for k in (sorted(self._ref_only) if items is None else items):
            r.add(self._ref_only[k])
        return r

    def _reference(self, k: int, toks, prefix: int):
        return (divergence.reference_logits(self.model, toks, prefix, batched=self.batched, mode="backbone")
                if self.own else self.reference[k])

    def screened(self, i: int) -> bool:
        """Whether a measured setting lacks items it is scored on (every item for a static one,
        every 1/DYNAMIC_SHARE-th for a dynamic one): measured on the screen items only."""
        every = 1 if i in self._static else self.stride
        return i in self._results and any(k not in self._results[i] for k in range(0, len(self.prepared), every))

    def measure(self, settings: Dict[int, Setting], screen: Sequence[int] = ()) -> None:
        """Score `settings` ({index: setting}) on their items not scored yet: a static one on
        every item, or (an index in `screen`) on screen_items; a dynamic one on every
        1/DYNAMIC_SHARE-th."""
        configs = {i: dict(exit_layer=None, **s.call_options()) for i, s in settings.items()}
        static = {i for i, o in configs.items() if self.batched and divergence.is_static(o)}
        self._static |= static
        every = {i: (1 if i in static else self.stride) for i in configs}
        on_screen = set(screen_items(len(self.prepared)))
        asked = lambda i, k: (k % every[i] == 0 and (i not in screen or k in on_screen)  # noqa: E731
                              and k not in self._results.get(i, {}))
        n_scored = lambda k: len(self.prepared[k][0]) - self.prepared[k][1]  # noqa: E731
        self._bar.total += sum(n_scored(k) for k in range(len(self.prepared)) for i in configs if asked(i, k))
        for k, (toks, prefix) in enumerate(self.prepared):
            want = [i for i in configs if asked(i, k)]
            if not want and k in self._ref_only:
                continue
            ref = self._reference(k, toks, prefix)
            got = self._logits(configs, want, static, k, ref)
            # One native pass over the reference's rows for every setting of the item, and on the
            # item's first visit the reference itself (its perplexity).
            first = k not in self._ref_only
            found = divergence.compare_many(ref, [logits for logits, _, _ in got.values()] + ([ref] if first else []),
                                            toks[prefix:])
            if first:
                self._ref_only[k] = found.pop()
            for (i, (_, exits, secs)), d in zip(got.items(), found):
                self._results.setdefault(i, {})[k] = (d, exits, secs)
                self._bar.update(len(toks) - prefix)

    def _logits(self, configs: dict, want: List[int], static: set, k: int, ref) -> dict:
        """Each wanted setting's logits on item k: (logits, exit layers, seconds)."""
        out = {}
        toks, prefix = self.prepared[k]
        n = len(toks) - prefix - 1
        for idx in _river_only_families(configs, [i for i in want if i in static]):
            o = configs[idx[0]]
            tails = [configs[j]["tail"] for j in idx]
            head = bool(o.get("river_head", True))
            # A family's later round goes on from the deepest branch an earlier pass over the item
            # kept at or before its own earliest one: its river layers before it are not run again.
            kept = self._branches.setdefault((o["river_attention"], head, k), {})
            usable = [layer for layer in kept if layer <= self.model.n_layer - max(tails)]
            start = (max(usable), kept[max(usable)]) if usable else None
            t0 = time.perf_counter()
            rows, branches = river_tails(self.model, toks[:len(toks) - 1], tails, river_attention=o["river_attention"],
                                         river_head=head, first_row=prefix - 1, start=start, keep=True)
            kept.update(branches)
            secs = (time.perf_counter() - t0) / len(idx)
            out.update({j: (r, [-1] * n, secs) for j, r in zip(idx, rows)})
        for i in want:
            if i in out:
                continue
            o = configs[i]
            t0 = time.perf_counter()
            if self.own and i in static and o.get("mode") == "backbone":
                logits, exits = ref, [self.model.n_layer - 1] * n  # the reference itself: KLD 0
            else:
                logits, exits = divergence.config_logits(self.model, toks, prefix, batched=i in static, **o)
            out[i] = (logits, exits, time.perf_counter() - t0)
        return out


#: What the presets' KLDs are measured from ("F16": the converter's input; "backbone": the file's own).
REFERENCE_KEY = "river.presets_reference"
#: What river.presets_grid keeps of each row.
GRID_FIELDS = ("options", "kld", "kld_ci", "interval", "same_top", "ppl", "cost", "bytes", "relative_cost",
               "mean_exit_layer", "reference", "scored", "why", "n_tokens", "items", "item_kld", "screen_kld",
               "screen_items")


#: Weight types of an unquantized input (a reference named by its type, "F16").
FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


def reference_label(tensors) -> str:
    """What a reference is, by its weight matrices' most common type: "F16" (or F32, BF16), or
    "input (Q4_K)" for a quantized one. tensors: a GGUF reader's tensors (river.* ones aside)."""
    types = [t.tensor_type.name for t in tensors if len(t.shape) >= 2 and not t.name.startswith("river.")]
    common = max(set(types), key=types.count) if types else "F16"
    return common if common in FLOAT_TYPES else f"input ({common})"


def _river_only_families(configs: dict, static: List[int]) -> List[List[int]]:
    """The static river-only settings among `static` grouped by family (the same head and
    attention): their tails share one pass of the river (measure.tails.river_tails), and a
    family's later round goes on from a branch an earlier pass kept."""
    families: dict = {}
    for i in static:
        o = configs[i]
        if o.get("mode") == "river-only":
            families.setdefault((o["river_attention"], bool(o.get("river_head", True))), []).append(i)
    return list(families.values())


def preset_metadata(res: dict, default: str = DEFAULT_PRESET) -> dict:
    """The river.* keys that store calibrated presets, and every measured setting (so the tiers
    can be chosen again without measuring)."""
    grid_rows = [{k: r[k] for k in GRID_FIELDS if k in r} for r in res["rows"]]
    return {PRESET_KEY: dump(res["presets"]), DEFAULT_KEY: default, GRID_KEY: dump(grid_rows),
            ANCHORS_KEY: dump(res["anchors"]), "river.presets_calibration_tokens": int(res["n_tokens"]),
            REFERENCE_KEY: res["reference"]}


def calibrate_presets_file(path: str, n_threads: int = 2, progress: bool = True,
                           min_tokens: int = PRESET_CALIBRATION_TOKENS,
                           score_tokens: int = PRESET_SCORE_TOKENS) -> dict:
    """Measure the preset grid on the calibration split (at least min_tokens scored tokens per
    static setting) and store the presets in the file (atomic rewrite of its metadata). Returns
    the keys written."""
    # A threshold that never passes, whatever the file's rule: the grid sets its own, and the file needs no profile.
    m = open_model(path, n_ctx=1024, n_threads=n_threads, threshold=max(never_exit(r) for r in EXIT_RULES))
    res = calibrate_presets(m, score_tokens=score_tokens, progress=progress, min_tokens=min_tokens)
    del m  # release the mapping before the file is replaced
    return set_river_metadata(path, preset_metadata(res))
