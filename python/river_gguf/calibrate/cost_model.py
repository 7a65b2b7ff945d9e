"""The decode cost model and the choice of presets: which measured settings become the tiers.

Each tier is anchored on the static llama.cpp quant of the same backbone that the preset has to
match, by the decode cost of one step:

- ``fast``: the setting closest to the backbone (lowest KL divergence) that costs no more per
  step than llama.cpp's Q4_0 of this backbone;
- ``balanced``: the same within Q4_K_M's cost;
- ``quality``: the same within Q8_0's cost.

A step's cost is the weight elements it multiplies, each weighted by its type's cost per element
(``TYPE_COST``, a table fitted once from llama.cpp's own decode timings with
``benchmarks/type_costs.py`` and stored here), plus a fixed cost per mat-mul node
(``NODE_COST``: river_gguf joins Q/K/V and gate/up of one type, llama.cpp joins nothing) and per
layer the dynamic exit tests (``EXIT_TEST_COST``). Bytes alone are the wrong measure: on the
small models and few cores this project runs, decode is bound by the dot-product kernels, and a
Q5_0 element costs nearly as much as a Q8_0 one though it is a third smaller. The anchors
(``static_step_bytes`` with ``measure="cost"``) apply llama.cpp's per-tensor type choice for Q4_0,
Q4_K_M and Q8_0, fallbacks for rows that are not a multiple of 256 included. Cost is a pure
function of the tensors' types and shapes, and KL divergence from the backbone is a deterministic
computation on fixed calibration text, so the same input gives the same presets, byte for byte, on
any run. At equal cost river_gguf's step is no slower than llama.cpp's (it joins Q/K/V and
gate/up); ``river-gguf tune FILE`` re-chooses the tiers from speeds timed on the user's own
machine. The stored format is river_gguf.presets.
"""
from __future__ import annotations

import functools
import os
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from .._loader import native
from ..gguf.reader import GGUFReader
from ..gguf.river_index import river_tensors
from ..measure.profile import rule_taus
from ..options import EXIT_RULES, max_score
from ..presets import Preset, Setting

# Each tier and the llama.cpp quant whose bytes per decode step bound it.
TIERS = (("fast", "q4_0"), ("balanced", "q4_k_m"), ("quality", "q8_0"))

# The decode cost model, in units of one Q8_0 weight element's product. Fitted once from stock
# llama.cpp's decode of SmolLM2-135M's static ladder and mixes on 2 threads of an AVX-512 server
# (benchmarks/type_costs.py; BENCHMARKS.md has the runs) and rounded to 0.05, the size of its
# noise; types not listed cost in proportion to their bits per element (Q8_0's 8.5 = 1.0).
TYPE_COST = {"F32": 3.0, "F16": 1.5, "BF16": 1.5, "Q8_0": 1.0, "Q6_K": 0.95, "Q5_K": 0.9, "Q5_0": 0.85,
             "Q5_1": 0.9, "Q4_K": 0.85, "Q4_0": 0.65, "Q4_1": 0.7, "IQ4_NL": 0.8, "IQ4_XS": 0.8}
# Each mat-mul node costs a fixed amount besides its elements (thread sync, activation
# quantization). River's joins of Q/K/V and gate/up of one type save nodes; measured on SmolLM2
# (in two runs): the river-only step with the backbone's Q8_0 attention (Q/K/V joined,
# 2 nodes fewer a layer, 3% more element cost) runs exactly as fast as the plain Q4_K_M river
# (attn_v Q8_0 cannot join its Q5_0 attn_q/attn_k) in two runs, and the joined Q8_0 backbone runs
# 1.00-1.06x llama.cpp's Q8_0 (90 nodes fewer): about 5 us a node, 0.05M Q8_0 elements.
NODE_COST = 50_000.0
# Each backbone layer the dynamic exit tests (the similarity node and the graph split that stops
# at an exit): tau 0.97 with the backbone's attention ran 4-6% slower than river-only with it, for
# ~7 tested layers a step, in two runs on SmolLM2: 80-120 us a tested layer, 0.85M Q8_0 elements.
EXIT_TEST_COST = 850_000.0


def type_cost(type_name: str, n_elements: int) -> float:
    """Cost of one product with a weight of `n_elements` elements of ggml type `type_name`."""
    c = TYPE_COST.get(type_name)
    if c is None:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
        c = 8.0 * size / block / 8.5
    return c * n_elements


def step_bytes(layer_bytes: List[dict], head_bytes: dict, n_layer: int, exit_layer: float, tail: int,
               river_head: bool, river_attention: str = "river") -> float:
    """Weight bytes one decode step reads: backbone layers 0..exit_layer, river layers up to
    the tail, backbone tail, and the head. exit_layer may be a mean (fractional); -1 = river-only.
    layer_bytes[l] = {"backbone": bytes, "river": bytes} (and, for river_attention="backbone",
    "backbone_attention" / "river_attention": the bytes of each side's attention group, which a
    river layer then reads from the backbone); head_bytes = {"backbone": .., "river": ..}."""
    river_last = n_layer - 1 - tail
    total = 0.0
    for l in range(n_layer):
        lb = layer_bytes[l]
        river = lb["river"]
        if river_attention == "backbone":
            river = river - lb["river_attention"] + lb["backbone_attention"]
        if l > river_last:
            total += lb["backbone"]
        else:
            # share of this layer run by the backbone, for a fractional mean exit layer
            share = min(max(exit_layer - l + 1, 0.0), 1.0)
            total += share * lb["backbone"] + (1 - share) * river
    exited = exit_layer < river_last
    total += head_bytes["river" if (river_head and exited) else "backbone"]
    return total


def choose(rows: List[dict], bounds: Dict[str, float]) -> Dict[str, Preset]:
    """Pick the presets from measured rows ({"options": a presets.Setting, "kld", "relative_cost",
    ...}): per tier,
    the lowest KLD among rows whose relative cost is within bounds[tier] (ties: the cheaper, then
    the row listed first); a tier no row fits gets the cheapest row. A pure function of its
    inputs: the same rows and bounds give the same presets. Rows without a KLD (settings plan
    left unmeasured) are never chosen. A tier whose pick equals a lower
    tier's is marked same_as, with the reason.

    A setting is closer than another only where the difference separates from 0: among the rows
    not separated from the closest one (not_closer), the tier takes the cheapest."""
    out: Dict[str, dict] = {}
    rows = [r for r in rows if r.get("kld") is not None]  # rows the cost model left unmeasured cannot win
    order = {id(r): i for i, r in enumerate(rows)}
    for name, _ in TIERS:
        tier = float(bounds[name])
        ok = [r for r in rows if r["relative_cost"] <= tier + 1e-12]
        if ok:
            best = min(ok, key=lambda r: (r["kld"], r["relative_cost"], order[id(r)]))
            # Closer only where the intervals separate: a cheaper setting whose KLD interval
            # reaches the closest one's is as close as this calibration can tell, and is kept.
            tied = [r for r in ok if r is best or not_closer(best, r)]
            pick = min(tied, key=lambda r: (r["relative_cost"], r["kld"], order[id(r)]))
        else:
            pick = min(rows, key=lambda r: (r["relative_cost"], order[id(r)]))
        entry = dict(pick, tier=tier)
        same = [n for n, p in out.items() if p["options"] == pick["options"]]
        if same:
            entry["same_as"] = same[0]
            entry["why"] = (f"no measured setting within {tier:.2f}x river-only's cost is closer to the backbone "
                            f"than {same[0]}'s" if ok else f"no measured setting fits {tier:.2f}x river-only's cost")
        elif not ok:
            entry["why"] = f"no measured setting fits {tier:.2f}x river-only's cost: the cheapest is {pick['relative_cost']:.2f}x"
        out[name] = entry
    return {name: Preset.of_row(entry) for name, entry in out.items()}


def setting_cost(setting: Setting, layers: List[dict], head: dict, n_layer: int,
                 mean_exit_layer: float = float("nan")) -> float:
    """A setting's decode cost per step (step_bytes with measure="cost" layers and head). A
    dynamic setting's depends on its mean exit layer; without one (NaN), its least possible cost:
    every token leaving at its min_exit_layer, after one exit test."""
    dynamic = setting.is_dynamic
    if dynamic and not np.isfinite(mean_exit_layer):
        mean_exit_layer = float(setting.options.min_exit_layer)
    step = setting_step(setting, n_layer, mean_exit_layer)
    cost = step_bytes(layers, head, n_layer, *step)
    if dynamic:  # the layers the exit tests
        cost += EXIT_TEST_COST * (min(float(step[0]), n_layer - 1 - setting.options.tail) + 1)
    return cost


#: How far above a tier's bound a dynamic setting's predicted cost may be and still be measured: its
#: mean exit layer is predicted from backbone decode (measure.profile.predicted_mean_exit), not measured.
#: benchmarks/convert_cost.py --margin measures how far the measured cost of each dynamic setting
#: lies above its prediction on a model (the largest ratio is what this has to cover): 1.002 on
#: SmolLM2's and 1.000 on Qwen2.5-Coder-0.5B's default files (BENCHMARKS.md).
PREDICTION_MARGIN = 1.03
#: plan's mark of a setting the search decides (search_next): a tail of a family whose KLD falls
#: as its tail deepens, measured only where it could be the tier's pick.
SEARCHED = "searched"
#: plan's mark of a tail measured in the plan's pass on the screen items only (screen=True): a
#: walk's first tail in a tier the backbone takes, and in no other tier's walk. The search
#: measures it on the other items only where the screen does not separate it from the tier's best.
SCREEN = "screen"


def plan(settings: List[Setting], layers: List[dict], head: dict, n_layer: int, bounds: Dict[str, float],
         mean_exit: Optional[Callable[[Setting], float]] = None, screen: bool = False) -> List[str]:
    """Which settings a calibration has to measure for choose to pick the tiers, from costs alone
    (known from types and shapes before anything runs). Per setting, "" (measure it), SEARCHED
    (a tail the search decides: search_next) or why not.

    - The backbone, the cheapest setting and plain river-only are always measured: the backbone
      is what a tier within its cost compares the river's settings with, the cheapest what a
      tier no setting fits takes, river-only the step `tune` times every cost against and the
      acceptance that prices lossless mode.
    - The static river-only tails of a family (tail_families) within any tier's bound are left to
      the search, which measures a family from its deepest tail in a tier's bound towards cheaper
      ones until one is separated from the tier's best. Where the search's first two rounds
      depend on no measurement (_first_walks_measured), the tails they would ask, each walk's
      deepest and then the family's cheapest within the tier's bound, are measured here (""), in
      the same pass as the rest. With screen=True, such a tail that only the walks of tiers the
      backbone takes ask (screen_tiers) is marked SCREEN instead: measured in that pass on the
      screen items alone.
    - A tier whose bound admits the backbone takes the backbone, without a measurement to decide
      it, when every river layer costs less than the backbone's and the river head no more (the
      river is the lower-precision copy), as far as the dynamic settings go: they are measured
      only within the other tiers' bounds, their cost predicted from mean_exit(options) (their
      mean exit layer, e.g. from the backbone's similarity profile), with PREDICTION_MARGIN to
      spare; without a prediction, their least possible cost is used.
    Everything else fits no tier it could win and is left out."""
    river_only = step_bytes(layers, head, n_layer, -1, 0, True)
    def predicted(o: Setting) -> float:
        if not o.is_dynamic or mean_exit is None:
            return setting_cost(o, layers, head, n_layer) / river_only
        return setting_cost(o, layers, head, n_layer, mean_exit(o)) / river_only / PREDICTION_MARGIN

    costs = [predicted(o) for o in settings]
    backbone = next((i for i, o in enumerate(settings) if o.options.mode == "backbone"), None)
    decided = list(screen_tiers(layers, head, n_layer, bounds)) if backbone is not None else []
    open_bounds = [float(bounds[name]) for name, _ in TIERS if name not in decided]
    cheapest = min(range(len(settings)), key=lambda i: costs[i]) if settings else None
    base = next((i for i, o in enumerate(settings) if o.plain_river_only), None)
    top = max(open_bounds, default=float("-inf"))
    top_any = max((float(b) for b in bounds.values()), default=float("-inf"))
    searched = {i for family in tail_families(settings) for i in family}
    why = []
    for i, c in enumerate(costs):
        if i in (cheapest, backbone, base):
            why.append("")
        elif i in searched and c <= top_any + 1e-12:
            why.append(SEARCHED)
        elif i not in searched and c <= top + 1e-12:
            why.append("")
        elif i not in searched and decided and c <= max(float(bounds[n]) for n in decided) + 1e-12:
            why.append(f"within {'/'.join(decided)}'s cost, which the backbone takes: every other setting runs layers "
                       "in the lower-precision river")
        else:
            dynamic = settings[i].is_dynamic
            what = (f"is predicted to cost {c * PREDICTION_MARGIN:.3f}x" if dynamic and mean_exit is not None
                    else f"costs at least {c:.3f}x" if dynamic else f"costs {c:.3f}x")
            limit = top_any if i in searched else top
            why.append(f"{what} river-only's step, more than any tier it could win allows"
                       + (f" ({limit:.3f}x)" if limit > float("-inf") else ""))
    return _first_walks_measured(settings, why, costs, bounds, tuple(decided) if screen else ())


def screen_tiers(layers: List[dict], head: dict, n_layer: int, bounds: Dict[str, float]) -> Tuple[str, ...]:
    """The tiers the backbone takes (plan): those whose bound admits the backbone's cost where
    every river layer costs less than the backbone's and the river head no more. In such a tier
    the backbone is the best a river setting is compared with, and a river tail is usually far
    from it: the search screens the tails only these tiers ask for on a few items first."""
    river_only = step_bytes(layers, head, n_layer, -1, 0, True)
    backbone = step_bytes(layers, head, n_layer, n_layer - 1, 0, False) / river_only
    lower = all(lb["river"] < lb["backbone"] for lb in layers) and head["river"] <= head["backbone"]
    return tuple(name for name, _ in TIERS if lower and backbone <= float(bounds[name]) + 1e-12)


def _first_walks_measured(settings: List[Setting], why: List[str], costs: List[float],
                          bounds: Dict[str, float], screened: Tuple[str, ...] = ()) -> List[str]:
    """plan's marks with the search's first two rounds measured with the plan's settings, where
    those rounds depend on no measurement. A walk of search_next (per family and tier) that
    starts at a tail the plan leaves to the search asks that tail first, and one whose tails
    within the bound the plan measures all asks nothing, whatever the plan's rows hold; when every
    walk is one of the two, measuring those first tails now measures the same settings on the
    same items, in one pass of the river layers each family shares (measure.tails.river_tails:
    the same logits, bit for bit) instead of one pass more. Once a walk's deepest tail is
    measured, search_next asks the family's cheapest tail within the bound next (when the bound
    holds two or more), again whatever the rows hold, so that tail joins the same pass: asked in
    a round of its own it would run the family's shared river layers once more for one tail. A
    walk that starts at a measured tail with a searched one below it depends on that tail's row:
    then the marks stay as they are. A first tail that only the walks of the `screened` tiers ask
    is marked SCREEN (the search screens what those tiers ask)."""
    families = [[i for i in f if why[i] in ("", SEARCHED)] for f in tail_families(settings)]
    first: Dict[int, set] = {}
    for family in (f for f in families if any(why[i] == SEARCHED for i in f)):
        for name, _ in TIERS:
            inside = [i for i in family if costs[i] <= float(bounds[name]) + 1e-12]
            if not any(why[i] == SEARCHED for i in inside):
                continue
            if why[inside[-1]] != SEARCHED:
                return why
            first.setdefault(inside[-1], set()).add(name)
            first.setdefault(inside[0], set()).add(name)  # search_next's next ask once the deepest is measured
    screen = {i for i, tiers in first.items() if screened and tiers <= set(screened) and why[i] == SEARCHED}
    return [SCREEN if i in screen else "" if i in first else w for i, w in enumerate(why)]


def tail_families(settings: List[Setting]) -> List[List[int]]:
    """The static river-only settings grouped by family (the same attention and head), each
    family's indices in order of tail, shallowest first: a deeper tail runs more of the last
    layers in the backbone, so it costs more and is expected to come closer to the backbone."""
    families: Dict[tuple, List[int]] = {}
    for i, s in enumerate(settings):
        o = s.options
        if o.mode == "river-only" and o.exit_layer is None:
            families.setdefault((o.river_attention, bool(o.river_head)), []).append(i)
    return [sorted(idx, key=lambda i: settings[i].options.tail) for idx in families.values()]


def search_next(family: List[int], costs: List[float], rows: Dict[int, dict], bounds: Dict[str, float]) -> List[int]:
    """The tails of one family (tail_families) to measure next. Per tier, the search walks the
    family from its deepest tail within the tier's bound towards cheaper ones: a measured tail
    not separated from the tier's best (not_closer with the lowest-KLD measured row within the
    bound) could be the tier's pick, or a cheaper one could, so the walk goes on; the first tail
    separated from the best ends it, and the cheaper tails, further from the backbone still
    where the family's KLD falls as its tail deepens (monotone_family, which the caller checks),
    cannot be picked. The first unmeasured tail on a walk is measured next, after the deepest the
    cheapest: where it is not separated from the tier's best it is the tier's pick among the
    family, so the walk ends there (a river that rebuilds its source's grid ties every tail).
    A screened row (measured on the screen items only, "screened") is never a tier's best; one
    the paired test on its items does not separate from the best is asked for again, to be
    measured on every item. costs: every setting's relative cost (by index); rows: measured rows
    by setting index ("kld", "relative_cost" and, for the paired test, "items" / "item_kld")."""
    return sorted(_walk_asks(family, costs, rows, bounds))


def _walk_asks(family: List[int], costs: List[float], rows: Dict[int, dict],
               bounds: Dict[str, float]) -> Dict[int, set]:
    """search_next's asks, each with the tiers whose walks ask it."""
    want: Dict[int, set] = {}
    for name, _ in TIERS:
        bound = float(bounds[name]) + 1e-12
        inside = [r for r in rows.values() if r["relative_cost"] <= bound and not r.get("screened")]
        best = min(inside, key=lambda r: r["kld"]) if inside else None
        tied = lambda i: best is not None and (rows[i] is best or not_closer(best, rows[i]))  # noqa: E731
        tails = [i for i in family if costs[i] <= bound]
        if len(tails) > 1 and tails[-1] in rows:
            cheapest = tails[0]
            if cheapest not in rows:
                want.setdefault(cheapest, set()).add(name)
                continue
            if tied(cheapest):
                if rows[cheapest].get("screened"):
                    want.setdefault(cheapest, set()).add(name)
                continue
        for i in reversed(tails):
            if i not in rows:
                want.setdefault(i, set()).add(name)
                break
            if best is not None and not tied(i):
                break
            if rows[i].get("screened"):
                want.setdefault(i, set()).add(name)
                break
    return want


def monotone_family(family: List[int], rows: Dict[int, dict]) -> bool:
    """Whether the family's measured tails come closer to the backbone as the tail deepens, as far
    as calibration can tell: no measured tail is separated (not_closer, the paired item bootstrap)
    as further from the backbone than a shallower one. What the search assumes of the tails it
    leaves unmeasured, checked on those it measured (screened ones on their items); a rise within
    the items' noise (a river that rebuilds its source's grid puts every tail within it) is no break."""
    measured = [rows[i] for i in family if i in rows]
    return all((deep["kld"] <= shallow["kld"] and deep.get("items") == shallow.get("items"))
               or not_closer(shallow, deep) for k, shallow in enumerate(measured) for deep in measured[k + 1:])


def search(families: List[List[int]], costs: List[float], bounds: Dict[str, float],
           measure: Callable[..., Dict[int, dict]], screen_tiers: Tuple[str, ...] = ()) -> dict:
    """Measure the tails of `families` that could be a tier's pick, in rounds: each round
    measures, per family, the next tail of every tier's walk (search_next); once no walk wants
    more, a family whose measured KLDs do not fall as its tail deepens (monotone_family) is
    measured whole. measure(indices, screen=()) measures `indices` on every item and `screen` on
    the screen items, and returns every measured row so far, by setting index (what choose
    compares: "kld", "relative_cost", "items", "item_kld"; "screened" for a row of the screen
    items alone), measure([]) included. A tail that only the walks of `screen_tiers` ask is
    screened first (the tiers the backbone takes, screen_tiers()); the walk measures it on every
    item only where the screen does not separate it from the tier's best. Returns {"rounds",
    "fallback": the families (their first index) measured whole, "screened": the tails screened}."""
    rows = measure([])
    rounds, fallback, screened = 0, [], []
    while True:
        asks: Dict[int, set] = {}
        for f in families:
            for i, tiers in _walk_asks(f, costs, rows, bounds).items():
                asks.setdefault(i, set()).update(tiers)
        if not asks:
            grown = [f for f in families if not monotone_family(f, rows)
                     and any(i not in rows or rows[i].get("screened") for i in f)]
            if not grown:
                return {"rounds": rounds, "fallback": fallback, "screened": sorted(screened)}
            fallback += [f[0] for f in grown]
            asks = {i: set() for f in grown for i in f if i not in rows or rows[i].get("screened")}
        screen = sorted(i for i, tiers in asks.items()
                        if i not in rows and tiers and tiers <= set(screen_tiers))
        screened += screen
        full = sorted(i for i in asks if i not in screen)
        rows = measure(full, screen=screen) if screen else measure(full)
        rounds += 1


#: The paired bootstrap of not_closer: its draws, seed and level.
PAIRED_DRAWS, PAIRED_SEED, PAIRED_LEVEL = 2000, 20261204, 0.95


def not_closer(best: dict, other: dict) -> bool:
    """Whether calibration cannot tell `best` closer to the backbone than `other`: the 95%
    interval of KLD(other) - KLD(best), from resampling the items both were scored on (rows'
    "items" and "item_kld": per item, scored tokens and summed KLD), reaches 0. Rows without
    per-item sums compare their intervals ("kld_ci") instead: overlapping means not closer. A
    deterministic function of the rows (a fixed seed)."""
    if "item_kld" in best and "item_kld" in other:
        b = dict(zip(best["items"], best["item_kld"]))
        o = dict(zip(other["items"], other["item_kld"]))
        common = sorted(set(b) & set(o))
        if not common:
            return True
        nb = np.array([b[i] for i in common], dtype=np.float64)
        no = np.array([o[i] for i in common], dtype=np.float64)
        idx = np.random.default_rng(PAIRED_SEED).integers(0, len(common), size=(PAIRED_DRAWS, len(common)))
        d = no[idx, 1].sum(axis=1) / no[idx, 0].sum(axis=1) - nb[idx, 1].sum(axis=1) / nb[idx, 0].sum(axis=1)
        return bool(np.quantile(d, (1 - PAIRED_LEVEL) / 2) <= 0.0)
    a, c = other.get("kld_ci"), best.get("kld_ci")
    return bool(a and c) and a[0] <= c[1]


# ----- measuring the settings ----------------------------------------------------------
def _measure(t, measure: str) -> float:
    if measure == "bytes":
        return int(t.n_bytes)
    n = int(np.prod([int(x) for x in t.shape]))
    return type_cost(t.tensor_type.name, n) if len(t.shape) > 1 and int(t.shape[1]) > 1 else 0.0


# The weights river_gguf joins into one mat-mul when they share a type, and a layer's attention
# group: the tensor kinds river_attention="backbone" takes from the backbone (native weights.h).
_JOINS = native.WEIGHT_JOINS
ATTENTION_KINDS = native.ATTENTION_TENSORS


def _layer_nodes(types: Dict[str, str], kinds=None) -> int:
    """Mat-mul nodes of one layer in river_gguf's engine: `types` maps a weight's kind
    (attn_q, ...) to its type; joined groups of one type are one node. kinds: count only these."""
    present = {k: t for k, t in types.items() if kinds is None or k in kinds}
    nodes = len(present)
    for group in _JOINS:
        ts = [present.get(k) for k in group]
        if all(t is not None for t in ts) and len(set(ts)) == 1:
            nodes -= len(group) - 1
    return nodes


@functools.lru_cache(maxsize=2)
def _reader_of(path: str, stamp: tuple):
    return GGUFReader(path)


def _reader(path: str):
    """gguf's reader of `path`, parsed once while the file stays the same (parsing a 150k-token
    vocabulary takes seconds, and a calibration reads the file's tensors three times)."""
    st = os.stat(path)
    return _reader_of(os.fspath(path), (st.st_ino, st.st_size, st.st_mtime_ns))


def weight_bytes(model, measure: str = "bytes") -> tuple:
    """(layer_bytes, head_bytes) of a loaded Model's files: per layer, the bytes of the
    backbone's and the river's tensors; the head each side uses (the river's is its
    river.output/river.token_embd, the backbone's its output or tied token_embd).
    measure="cost" gives each weight matrix's decode cost (type_cost) instead of its bytes
    (1-D tensors cost nothing: they are alike on every side)."""

    if measure not in ("bytes", "cost"):
        raise ValueError(f"measure must be 'bytes' or 'cost', got {measure!r}")
    bb = _reader(model.model_path)
    bb_ts = [(t.name, t) for t in bb.tensors]
    if model.river_path:
        rv_ts = [(t.name, t) for t in _reader(model.river_path).tensors]
    else:
        rv_ts = [(t.name[len("river."):], t) for t in river_tensors(bb)]
    return tensor_costs(bb_ts, rv_ts, model.n_layer, measure)


class TensorInfo(NamedTuple):
    """What the cost model reads of a tensor (a gguf reader's tensors have the same fields)."""
    shape: tuple                          # ne0 first
    tensor_type: GGMLQuantizationType
    n_bytes: int


def tensor_costs(bb_ts: List[tuple], rv_ts: List[tuple], n_layer: int, measure: str = "bytes") -> tuple:
    """weight_bytes of two tensor lists, (plain name, tensor) pairs of the backbone's and the
    river's (reader tensors or TensorInfo): a file not written yet can be costed from its types."""
    bb_sizes = {n: _measure(t, measure) for n, t in bb_ts}
    rv_sizes = {n: _measure(t, measure) for n, t in rv_ts}
    matrix = lambda n, t: n.startswith("blk.") and n.endswith(".weight") and len(t.shape) > 1  # noqa: E731
    bb_types = {n: t.tensor_type.name for n, t in bb_ts if matrix(n, t)}
    rv_types = {n: t.tensor_type.name for n, t in rv_ts if matrix(n, t)}
    L = n_layer

    def layer(sizes, l, kinds=None):
        p = f"blk.{l}."
        return sum(n for name, n in sizes.items() if name.startswith(p)
                   and (kinds is None or name[len(p):].split(".")[0] in kinds))

    layers = [{"backbone": layer(bb_sizes, l), "river": layer(rv_sizes, l),
               "backbone_attention": layer(bb_sizes, l, ATTENTION_KINDS),
               "river_attention": layer(rv_sizes, l, ATTENTION_KINDS)} for l in range(L)]
    head = {"backbone": bb_sizes.get("output.weight", bb_sizes.get("token_embd.weight", 0)),
            "river": rv_sizes.get("output.weight", rv_sizes.get("token_embd.weight", 0))}
    if measure == "cost":  # and each side's mat-mul nodes (the head is one)
        for side, types in (("backbone", bb_types), ("river", rv_types)):
            for l in range(L):
                t = {n.split(".")[2]: ty for n, ty in types.items() if n.startswith(f"blk.{l}.")}
                layers[l][side] += NODE_COST * _layer_nodes(t)
                layers[l][f"{side}_attention"] += NODE_COST * _layer_nodes(t, ATTENTION_KINDS)
            head[side] += NODE_COST
    return layers, head


# The grid the calibrator measures: static river-only with a backbone tail, and the dynamic
# exit with a tail; then the same with the backbone's attention in the river layers (precision by
# tensor kind). The dynamic settings' taus are the rule's (dynamic_taus).
STATIC_TAILS = (0, 1, 2, 3, 4, 6, 8, 10, 12, 16)
DYNAMIC_TAILS = (2, 4)
ATTENTION_TAILS = (0, 2, 4, 8)
#: Hand-placed taus of the dynamic settings, by rule: cosine's dense where SmolLM2's and
#: Qwen2.5's mid-layer similarities live. A rule without an entry takes DYNAMIC_QUANTILES of its
#: profile (measure.profile.rule_taus): cosine's 0.97-0.99 sit near those quantiles on SmolLM2.
DYNAMIC_TAUS = {"cosine": (0.97, 0.98, 0.99)}
DYNAMIC_QUANTILES = (0.7, 0.8, 0.9)


def dynamic_taus(exit_rule: str = EXIT_RULES[0], profile=None) -> Tuple[float, ...]:
    """The dynamic settings' taus for `exit_rule`: its hand-placed ones, else quantiles of its
    profile (the rule's scores, measure.profile.similarity_profile), which such a rule needs;
    below the rule's max_score, as a tau at or above it never exits (the backbone's setting)."""
    if exit_rule in DYNAMIC_TAUS:
        taus = DYNAMIC_TAUS[exit_rule]
    elif profile is None:
        raise ValueError(f"exit rule {exit_rule!r} has no hand-placed taus: its grid needs its profile")
    else:
        taus = rule_taus(profile, DYNAMIC_QUANTILES)
    return tuple(t for t in taus if t < max_score(exit_rule))


def grid(n_layer: int, river_head: bool = True, exit_rule: str = EXIT_RULES[0], profile=None) -> List[Setting]:
    """The settings the calibrator measures; the dynamic ones exit by `exit_rule` at its taus
    (dynamic_taus: profile is that rule's profile, needed for a rule without hand-placed taus)."""
    taus = dynamic_taus(exit_rule, profile)
    rule = {} if exit_rule == EXIT_RULES[0] else {"exit_rule": exit_rule}
    # The backbone alone is a candidate too: with a Q8_0 backbone it is llama.cpp's Q8_0 at its
    # own cost, and no setting with river layers in it comes closer to F16 at that cost.
    rows = [Setting.of(mode="backbone", tail=0, river_head=False)]
    rows += [Setting.of(mode="river-only", tail=t, river_head=river_head) for t in STATIC_TAILS if t < n_layer]
    rows += [Setting.of(mode="river", **rule, threshold=tau, min_exit_layer=0, tail=t, river_head=river_head)
             for t in DYNAMIC_TAILS for tau in taus if t < n_layer - 1]
    rows += [Setting.of(mode="river-only", tail=t, river_head=river_head, river_attention="backbone")
             for t in ATTENTION_TAILS if t < n_layer]
    rows += [Setting.of(mode="river", **rule, threshold=tau, min_exit_layer=0, tail=0, river_head=river_head,
                        river_attention="backbone") for tau in taus if n_layer > 1]
    return rows


def setting_step(setting: Setting, n_layer: int, mean_exit_layer: float) -> tuple:
    """step_bytes's (exit_layer, tail, river_head, river_attention) for a setting: the backbone
    alone reads every backbone layer and its own head; river-only exits before layer 0; the
    dynamic exit at its measured mean exit layer."""
    o = setting.options
    if o.mode == "backbone":
        return (n_layer - 1, 0, False, "river")
    exit_layer = -1.0 if o.mode == "river-only" else mean_exit_layer
    return (exit_layer, o.tail, o.river_head, o.river_attention)


def backbone_layers_per_step(n_layer: int, mean_exit_layer: float, tail: int) -> float:
    """Backbone layers one decode step runs: layers 0..exit (a mean for the dynamic exit; -1 for
    river-only) and the tail; the rest run in the river."""
    river_last = n_layer - 1 - tail
    return min(float(n_layer), min(mean_exit_layer + 1.0, river_last + 1.0) + tail)


# ----- the static quants the tiers are anchored on ----------------------------------------
_ATTN_V, _FFN_DOWN = "attn_v", "ffn_down"
_ATTN_QKV = "attn_qkv"
_LAYER_WEIGHTS = ("attn_q", "attn_k", "attn_v", _ATTN_QKV, "attn_output", "ffn_gate", "ffn_up", "ffn_down")
_K_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}  # rows not a multiple of 256


def _more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers, and every third between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _llama_cpp_type(kind: str, role: str, layer: int, n_layer: int, row: int) -> str:
    """The type llama.cpp's quantizer gives a weight in a `kind` file (q4_0, q4_k_m, q8_0):
    role is a layer weight name or "output" (the head, or the tied embedding used as head)."""
    if kind == "q8_0":
        t = "Q8_0"
    elif role == "output":
        t = "Q6_K"
    elif kind == "q4_0":
        t = "Q4_0"
    elif kind == "q4_k_m":
        if role == _ATTN_QKV:
            t = "Q5_K"  # llama.cpp gives a joined Q/K/V (phi3) Q5_K in Q4_K_M
        else:
            t = "Q6_K" if role in (_ATTN_V, _FFN_DOWN) and _more_bits(layer, n_layer) else "Q4_K"
    else:
        raise ValueError(f"no anchor recipe for {kind!r}")
    if t in _K_FALLBACK and row % 256 != 0:
        t = _K_FALLBACK[t]
    return t


def _type_bytes(type_name: str, n_elements: int) -> float:
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    return n_elements / block * size


def static_step_bytes(tensors: Dict[str, tuple], n_layer: int, kind: str, measure: str = "bytes") -> float:
    """Weight bytes one decode step of llama.cpp's `kind` quant of this backbone reads: every
    layer weight and the head. tensors: {name: shape (ne0 first)} of the backbone's tensors.
    Small F32 tensors (norms) are left out, as in step_bytes they cost the same on both sides.
    measure="cost": the step's decode cost (type_cost) instead."""
    # llama.cpp runs every weight as its own mat-mul node (it joins nothing).
    node = 0.0 if measure == "bytes" else NODE_COST
    of = _type_bytes if measure == "bytes" else type_cost
    total = 0.0
    for l in range(n_layer):
        for role in _LAYER_WEIGHTS:
            shape = tensors.get(f"blk.{l}.{role}.weight")
            if shape is not None:
                total += of(_llama_cpp_type(kind, role, l, n_layer, int(shape[0])), int(np.prod(shape))) + node
    head = tensors.get("output.weight", tensors.get("token_embd.weight"))
    if head is not None:
        total += of(_llama_cpp_type(kind, "output", -1, n_layer, int(head[0])), int(np.prod(head))) + node
    return total


def _plain_tensor_shapes(model) -> Dict[str, tuple]:
    r = _reader(model.model_path)
    return {t.name: tuple(int(x) for x in t.shape) for t in r.tensors if not t.name.startswith("river.")}


def tier_bounds(model, layers: List[dict], head: dict, measure: str = "cost") -> dict:
    """Per tier, the anchor quant's cost per step (or bytes, measure="bytes"; layers and head
    from weight_bytes with the same measure) relative to this file's river-only step."""
    return tier_bounds_of(_plain_tensor_shapes(model), model.n_layer, layers, head, measure)


def tier_bounds_of(shapes: Dict[str, tuple], L: int, layers: List[dict], head: dict, measure: str = "cost") -> dict:
    """tier_bounds from the backbone's tensor shapes ({name: shape}, ne0 first) and layer count."""
    river_only = step_bytes(layers, head, L, -1, 0, True)
    # Count only the weights step_bytes counts for the anchors' side too: layer matrices and head
    # (and the F32 norms, for bytes; they cost nothing in the cost measure).
    norms = sum(_norm_bytes(shapes, l) for l in range(L)) if measure == "bytes" else 0.0
    anchors = {kind: static_step_bytes(shapes, L, kind, measure) + norms for _, kind in TIERS}
    return {"measure": measure, "river_only": river_only, "anchors": anchors,
            "bounds": {name: anchors[kind] / river_only for name, kind in TIERS}}


def _norm_bytes(shapes: Dict[str, tuple], l: int) -> float:
    """F32 bytes of layer l's 1-D tensors (norms, biases), which every file keeps in F32."""
    p = f"blk.{l}."
    return sum(4.0 * int(np.prod(s)) for n, s in shapes.items() if n.startswith(p) and len(s) == 1)
