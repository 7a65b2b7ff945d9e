"""Named exit settings stored in a River GGUF: one file, several points of the speed/quality curve.

A static quant is one point; a River GGUF holds a backbone, a river and the exit rule, so it can
run anywhere between the river's speed and the backbone's quality. The calibrator measures a
small grid of settings (backbone tail, dynamic exit tau, river-only) on the calibration split and
keeps three as presets, by speed tier. Speed is the time of a decode step relative to river-only,
from a line t = a + b * (backbone layers per step) fitted to river-only decode timed with each
static tail on this machine during calibration (`step_time_model`).

The tiers are set where llama.cpp's static quants fall on that scale. In this project's runs
(SmolLM2-135M, 2 threads; BENCHMARKS.md) river-only decodes at 1.1x a static Q4_0 (the engine
joins the river's Q/K/V and gate/up weights), a Q4_K_M step takes about 1.5x river-only's time
and a Q8_0 step 1.6x:

- ``fast``: the best perplexity within FAST_TIME x river-only's time (2% slack: in practice the
  river alone), faster than a static Q4_0;
- ``balanced`` (the default): the best perplexity within BALANCED_TIME x: no slower than Q4_K_M;
- ``quality``: the best perplexity within QUALITY_TIME x: about Q8_0's speed.

They are stored as JSON under ``river.presets`` with their measured calibration perplexity,
mean exit layer, bytes and predicted relative time, ``river.presets_grid`` holds every measured
setting, and ``river.default_preset`` names the one a Model uses by default.
"""
from __future__ import annotations

import json
from typing import Dict, List, Optional

PRESET_KEY = "river.presets"
DEFAULT_KEY = "river.default_preset"
NAMES = ("fast", "balanced", "quality")
DEFAULT_PRESET = "balanced"

# Speed tiers: decode-step time relative to the river alone (river-only = 1.0).
FAST_TIME = 1.02
BALANCED_TIME = 1.50
QUALITY_TIME = 1.65

# The exit options a preset may set (ExitOptions fields).
OPTION_KEYS = ("mode", "threshold", "min_exit_layer", "tail", "river_head", "exit_layer")


def parse(metadata: dict) -> Dict[str, dict]:
    """The presets stored in a file's metadata ({} when none). Raises ValueError if malformed."""
    raw = metadata.get(PRESET_KEY)
    if raw is None:
        return {}
    try:
        presets = json.loads(raw)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{PRESET_KEY} is not valid JSON: {e}") from None
    if not isinstance(presets, dict) or not all(isinstance(v, dict) and isinstance(v.get("options"), dict)
                                                for v in presets.values()):
        raise ValueError(f"{PRESET_KEY} must map names to {{'options': {{...}}}}")
    for name, p in presets.items():
        bad = set(p["options"]) - set(OPTION_KEYS)
        if bad:
            raise ValueError(f"preset {name!r} sets unknown options {sorted(bad)}")
    return presets


def dump(presets: Dict[str, dict]) -> str:
    return json.dumps(presets, sort_keys=True, separators=(",", ":"))


def step_bytes(layer_bytes: List[dict], head_bytes: dict, n_layer: int, exit_layer: float, tail: int,
               river_head: bool) -> float:
    """Weight bytes one decode step reads: backbone layers 0..exit_layer, river layers up to
    the tail, backbone tail, and the head. exit_layer may be a mean (fractional); -1 = river-only.
    layer_bytes[l] = {"backbone": bytes, "river": bytes}; head_bytes = {"backbone": .., "river": ..}."""
    river_last = n_layer - 1 - tail
    total = 0.0
    for l in range(n_layer):
        if l > river_last:
            total += layer_bytes[l]["backbone"]
        else:
            # share of this layer run by the backbone, for a fractional mean exit layer
            share = min(max(exit_layer - l + 1, 0.0), 1.0)
            total += share * layer_bytes[l]["backbone"] + (1 - share) * layer_bytes[l]["river"]
    exited = exit_layer < river_last
    total += head_bytes["river" if (river_head and exited) else "backbone"]
    return total


def choose(rows: List[dict]) -> Dict[str, dict]:
    """Pick the presets from measured rows ({"options", "ppl", "relative_time", ...}): per tier,
    the lowest perplexity whose relative time is within the tier; a tier no row fits gets the
    fastest row."""
    out: Dict[str, dict] = {}
    for name, tier in (("fast", FAST_TIME), ("balanced", BALANCED_TIME), ("quality", QUALITY_TIME)):
        ok = [r for r in rows if r["relative_time"] <= tier]
        pick = min(ok, key=lambda r: (r["ppl"], r["relative_time"])) if ok else min(rows, key=lambda r: r["relative_time"])
        out[name] = dict(pick, tier=tier)
    return out


def describe(presets: Dict[str, dict], default: Optional[str] = None) -> List[str]:
    """One line per preset, for `river-gguf info`."""
    lines = []
    for name in sorted(presets, key=lambda n: (NAMES.index(n) if n in NAMES else len(NAMES), n)):
        p = presets[name]
        o = p["options"]
        what = o.get("mode", "river")
        if what == "river":
            what = f"tau={o.get('threshold')} min_exit={o.get('min_exit_layer', 0)}"
        lines.append(
            f"{name}{' (default)' if name == default else ''}: {what} tail={o.get('tail', 0)} "
            f"river_head={o.get('river_head')} | calibration ppl {p.get('ppl', float('nan')):.4f}"
            f" (backbone {p.get('backbone_ppl', float('nan')):.4f}), step time "
            f"{p.get('relative_time', float('nan')):.2f}x river-only ({p.get('relative_cost', float('nan')):.2f}x its "
            f"bytes), mean exit {p.get('mean_exit_layer', float('nan')):.1f}")
    return lines


# ----- measuring the settings ----------------------------------------------------------
def weight_bytes(model) -> tuple:
    """(layer_bytes, head_bytes) of a loaded Model's files: per layer, the bytes of the
    backbone's and the river's tensors; the head each side uses (the river's is its
    river.output/river.token_embd, the backbone's its output or tied token_embd)."""
    import gguf

    bb = gguf.GGUFReader(model.model_path)
    bb_sizes = {t.name: int(t.n_bytes) for t in bb.tensors}
    if model.river_path:
        rv_sizes = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(model.river_path).tensors}
    else:
        from .river_format import river_tensors

        rv_sizes = {t.name[len("river."):]: int(t.n_bytes) for t in river_tensors(bb)}
    L = model.n_layer

    def layer(sizes, l):
        p = f"blk.{l}."
        return sum(n for name, n in sizes.items() if name.startswith(p))

    layers = [{"backbone": layer(bb_sizes, l), "river": layer(rv_sizes, l)} for l in range(L)]
    head = {"backbone": bb_sizes.get("output.weight", bb_sizes.get("token_embd.weight", 0)),
            "river": rv_sizes.get("output.weight", rv_sizes.get("token_embd.weight", 0))}
    return layers, head


# The grid the calibrator measures: static river-only with a backbone tail, and the dynamic
# exit with a tail (tau dense where SmolLM2's and Qwen2.5's mid-layer similarities live).
STATIC_TAILS = (0, 1, 2, 3, 4, 6, 8, 10, 12, 16)
DYNAMIC = tuple((tau, tail) for tail in (2, 4) for tau in (0.97, 0.98, 0.99))


def grid(n_layer: int, river_head: bool = True) -> List[dict]:
    rows = [{"mode": "river-only", "tail": t, "river_head": river_head} for t in STATIC_TAILS if t < n_layer]
    rows += [{"mode": "river", "threshold": tau, "min_exit_layer": 0, "tail": t, "river_head": river_head}
             for tau, t in DYNAMIC if t < n_layer - 1]
    return rows


def _static_perplexity(model, prepared, opts: dict) -> float:
    """Perplexity of a river-only setting (with or without a tail) in one batched pass per item.
    Every token, prompt included, runs the same layers then, so a batched pass computes what
    token-by-token decoding computes (up to float summation order) at prefill speed."""
    import numpy as np

    from .results import log_softmax_at

    lps = []
    for toks, prefix in prepared:
        logits = model.logits(toks, **opts)
        lps += [log_softmax_at(logits[i - 1], toks[i]) for i in range(prefix, len(toks))]
    return float(np.exp(-np.mean(lps)))


def _decode_seconds(model, prompt: List[int], n: int, **opts) -> float:
    """Seconds per greedy decode step of the engine loop alone (no sampling, no EOS stop)."""
    import time

    import numpy as np

    o = model._options(**opts)
    e = model._engine
    e.truncate(0)
    logits, _, _ = e.eval(prompt, **o.engine_args(prompt=True))
    step = o.engine_args(prompt=False)
    t0 = time.perf_counter()
    for _ in range(n):
        logits, _, _ = e.eval([int(np.argmax(logits[-1]))], **step)
    return (time.perf_counter() - t0) / n


def backbone_layers_per_step(n_layer: int, mean_exit_layer: float, tail: int) -> float:
    """Backbone layers one decode step runs: layers 0..exit (a mean for the dynamic exit; -1 for
    river-only) and the tail; the rest run in the river."""
    river_last = n_layer - 1 - tail
    return min(float(n_layer), min(mean_exit_layer + 1.0, river_last + 1.0) + tail)


def step_time_model(model, prompt: List[int], tails=STATIC_TAILS, n: int = 64, rounds: int = 5) -> dict:
    """Time river-only decode with each backbone tail in `tails` (engine loop, interleaved rounds,
    medians) and fit t = a + b * (backbone layers per step) by least squares.

    A backbone layer and a river layer differ in more than bytes (their kernels, and joined
    Q/K/V and gate/up weights where the engine repacks), so time is fitted against the layer
    mix a step runs, measured on this machine; relative_time(k) is then t(k) / t(0), for a
    step that runs k backbone layers (fractional for the dynamic exit's mean)."""
    import statistics

    import numpy as np

    tails = [t for t in tails if t < model.n_layer]
    runs = {t: [] for t in tails}
    for i in range(rounds):
        for t in (tails if i % 2 == 0 else tails[::-1]):  # load drift hits every tail alike
            runs[t].append(_decode_seconds(model, prompt, n, mode="river-only", river_head=True, tail=t,
                                           exit_layer=None))
    x = np.array(tails, dtype=float)
    y = np.array([statistics.median(runs[t]) for t in tails])
    b, a = np.polyfit(x, y, 1) if len(tails) > 1 else (0.0, float(y[0]))
    b = max(float(b), 0.0)  # a backbone layer never costs less than a river layer's share of noise
    a = float(np.mean(y - b * x))
    return {"tails": list(tails), "seconds": [float(v) for v in y], "a_s": a, "b_s_per_layer": b,
            "relative_time": lambda k: (a + b * k) / a if a > 0 else 1.0 + k}


def calibrate_presets(model, items=None, score_tokens: int = 96, progress: bool = True,
                      settings: Optional[List[dict]] = None) -> dict:
    """Measure `settings` (default: grid()) on the calibration split and choose the presets.

    Perplexity is teacher-forced through the decode path (evaluate.score_items); river-only
    settings, whose tokens all run the same layers, are scored in one batched pass per item. Speed is
    the step time relative to river-only, from a line in backbone layers per step fitted to the
    timed static tails (step_time_model); `cost` is the weight bytes a step reads (step_bytes), kept
    for the record. Returns {"presets", "rows", "backbone_ppl", "river_only_cost", ...}."""
    from tqdm import tqdm

    from .eval import report as evaluate

    items = evaluate.calibration_items() if items is None else items
    prepared = [p for its in items.values() for p in evaluate.prepare(model, its, score_tokens)]
    settings = grid(model.n_layer) if settings is None else settings
    layers, head = weight_bytes(model)
    L = model.n_layer
    n_tok = sum(len(t) - p for t, p in prepared)
    rows = []
    with tqdm(total=n_tok * (len(settings) + 1), desc="presets", unit="tok", disable=not progress) as bar:
        base = evaluate.score_items(model, prepared, bar, mode="backbone", exit_layer=None)
        for opts in settings:
            full = dict(exit_layer=None, **opts)
            if opts["mode"] == "river-only":
                ppl, mean_exit = _static_perplexity(model, prepared, full), -1.0
                bar.update(n_tok)
            else:
                r = evaluate.score_items(model, prepared, bar, **full)
                ppl, mean_exit = r.perplexity, r.mean_exit_layer
            cost = step_bytes(layers, head, L, mean_exit, opts.get("tail", 0), opts.get("river_head", True))
            rows.append({"options": dict(opts), "ppl": ppl, "mean_exit_layer": mean_exit, "cost": cost})
    river_only_cost = step_bytes(layers, head, L, -1, 0, True)
    backbone_cost = step_bytes(layers, head, L, L - 1, 0, False)
    timing = step_time_model(model, prepared[0][0][:prepared[0][1]])
    for r in rows:
        r["relative_cost"] = r["cost"] / river_only_cost
        r["backbone_layers"] = backbone_layers_per_step(L, r["mean_exit_layer"], r["options"].get("tail", 0))
        r["relative_time"] = timing["relative_time"](r["backbone_layers"])
        r["backbone_ppl"] = base.perplexity
    chosen = choose(rows)
    return {"presets": chosen, "rows": rows, "backbone_ppl": base.perplexity, "river_only_cost": river_only_cost,
            "backbone_cost": backbone_cost, "n_tokens": base.n_tokens,
            "timing": {k: v for k, v in timing.items() if k != "relative_time"},
            "items": {d: [it.id for it in its] for d, its in items.items()}}


GRID_KEY = "river.presets_grid"


def preset_metadata(res: dict, default: str = DEFAULT_PRESET) -> dict:
    """The river.* keys that store calibrated presets, and every measured setting (so the tiers
    can be chosen again without measuring)."""
    grid_rows = [{k: r[k] for k in ("options", "ppl", "cost", "relative_cost", "relative_time", "mean_exit_layer")}
                 for r in res["rows"]]
    return {PRESET_KEY: dump(res["presets"]), DEFAULT_KEY: default, GRID_KEY: dump(grid_rows),
            "river.presets_calibration_tokens": int(res["n_tokens"])}
