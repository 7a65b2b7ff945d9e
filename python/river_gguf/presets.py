"""Named exit settings stored in a River GGUF: one file, several points of the speed/quality curve.

A static quant is one point; a River GGUF holds a backbone, a river and the exit rule, so it can
run anywhere between the river's speed and the backbone's quality. The calibrator measures a
small grid of settings (backbone tail, dynamic exit tau, river-only) on the calibration split and
keeps three as presets, one per tier. Each tier is anchored on the static llama.cpp quant of the
same backbone that the preset has to match, by the weight bytes one decode step reads:

- ``fast``: the setting closest to the backbone (lowest KL divergence) that reads no more bytes
  per step than llama.cpp's Q4_0 of this backbone;
- ``balanced`` (the default): the same within Q4_K_M's bytes;
- ``quality``: the same within Q8_0's bytes.

A step's bytes (``step_bytes``) and the anchors (``static_step_bytes``, which applies llama.cpp's
per-tensor type choice for Q4_0, Q4_K_M and Q8_0, fallbacks for rows that are not a multiple of
256 included) are computed from the tensors' types and shapes, and KL divergence from the
backbone is a deterministic computation on fixed calibration text, so the same input gives the
same presets, byte for byte, on any run. Decode is memory-bound, and at equal bytes river_gguf's
step is no slower than llama.cpp's (it joins Q/K/V and gate/up); the Pareto report checks the
measured speeds. Earlier versions timed the tails during conversion, and their choice moved
with the machine's load.

Where two tiers pick the same setting, the higher tier's entry says so (``same_as``) and why: no
setting within its larger budget came closer to the backbone.

They are stored as JSON under ``river.presets`` with their calibration KLD, perplexity, mean exit
layer, bytes and bytes relative to river-only, ``river.presets_grid`` holds every measured
setting, ``river.presets_anchors`` the anchors, and ``river.default_preset`` names the one a Model
uses by default.
"""
from __future__ import annotations

import json
from typing import Dict, List, Optional

import numpy as np

PRESET_KEY = "river.presets"
DEFAULT_KEY = "river.default_preset"
NAMES = ("fast", "balanced", "quality")
DEFAULT_PRESET = "balanced"

# Each tier and the llama.cpp quant whose bytes per decode step bound it.
TIERS = (("fast", "q4_0"), ("balanced", "q4_k_m"), ("quality", "q8_0"))
ANCHORS_KEY = "river.presets_anchors"

# The exit options a preset may set (ExitOptions fields).
OPTION_KEYS = ("mode", "threshold", "min_exit_layer", "tail", "river_head", "exit_layer", "river_attention")


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


def choose(rows: List[dict], bounds: Dict[str, float]) -> Dict[str, dict]:
    """Pick the presets from measured rows ({"options", "kld", "relative_cost", ...}): per tier,
    the lowest KLD among rows whose relative cost is within bounds[tier] (ties: the cheaper, then
    the row listed first); a tier no row fits gets the cheapest row. A pure function of its
    inputs: the same rows and bounds give the same presets. A tier whose pick equals a lower
    tier's is marked same_as, with the reason."""
    out: Dict[str, dict] = {}
    order = {id(r): i for i, r in enumerate(rows)}
    for name, _ in TIERS:
        tier = float(bounds[name])
        ok = [r for r in rows if r["relative_cost"] <= tier + 1e-12]
        if ok:
            pick = min(ok, key=lambda r: (r["kld"], r["relative_cost"], order[id(r)]))
        else:
            pick = min(rows, key=lambda r: (r["relative_cost"], order[id(r)]))
        entry = dict(pick, tier=tier)
        same = [n for n, p in out.items() if p["options"] == pick["options"]]
        if same:
            entry["same_as"] = same[0]
            entry["why"] = (f"no measured setting within {tier:.2f}x river-only's bytes is closer to the backbone "
                            f"than {same[0]}'s" if ok else f"no measured setting fits {tier:.2f}x river-only's bytes")
        out[name] = entry
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
            f"river_head={o.get('river_head')} | calibration KLD {p.get('kld', float('nan')):.4f}, ppl "
            f"{p.get('ppl', float('nan')):.4f} (backbone {p.get('backbone_ppl', float('nan')):.4f}), "
            f"{p.get('relative_cost', float('nan')):.2f}x river-only's bytes per step (tier "
            f"{p.get('tier', float('nan')):.2f}x), mean exit {p.get('mean_exit_layer', float('nan')):.1f}"
            + (f" [= {p['same_as']}: {p['why']}]" if p.get("same_as") else ""))
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

    def layer(sizes, l, kinds=None):
        p = f"blk.{l}."
        return sum(n for name, n in sizes.items() if name.startswith(p)
                   and (kinds is None or name[len(p):].split(".")[0] in kinds))

    layers = [{"backbone": layer(bb_sizes, l), "river": layer(rv_sizes, l),
               "backbone_attention": layer(bb_sizes, l, ATTENTION_KINDS),
               "river_attention": layer(rv_sizes, l, ATTENTION_KINDS)} for l in range(L)]
    head = {"backbone": bb_sizes.get("output.weight", bb_sizes.get("token_embd.weight", 0)),
            "river": rv_sizes.get("output.weight", rv_sizes.get("token_embd.weight", 0))}
    return layers, head


# The attention group of a layer (the tensors river_attention="backbone" takes from the backbone).
# attn_qkv is phi3's joined Q/K/V; post_attention_norm is gemma's and olmo2's norm on the attention output.
ATTENTION_KINDS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output", "attn_q_norm", "attn_k_norm",
                   "post_attention_norm")

# The grid the calibrator measures: static river-only with a backbone tail, and the dynamic
# exit with a tail (tau dense where SmolLM2's and Qwen2.5's mid-layer similarities live); then
# the same with the backbone's attention in the river layers (precision by tensor kind).
STATIC_TAILS = (0, 1, 2, 3, 4, 6, 8, 10, 12, 16)
DYNAMIC = tuple((tau, tail) for tail in (2, 4) for tau in (0.97, 0.98, 0.99))
ATTENTION_TAILS = (0, 2, 4, 8)
ATTENTION_DYNAMIC = tuple((tau, 0) for tau in (0.97, 0.98, 0.99))


def grid(n_layer: int, river_head: bool = True) -> List[dict]:
    rows = [{"mode": "river-only", "tail": t, "river_head": river_head} for t in STATIC_TAILS if t < n_layer]
    rows += [{"mode": "river", "threshold": tau, "min_exit_layer": 0, "tail": t, "river_head": river_head}
             for tau, t in DYNAMIC if t < n_layer - 1]
    rows += [{"mode": "river-only", "tail": t, "river_head": river_head, "river_attention": "backbone"}
             for t in ATTENTION_TAILS if t < n_layer]
    rows += [{"mode": "river", "threshold": tau, "min_exit_layer": 0, "tail": t, "river_head": river_head,
              "river_attention": "backbone"} for tau, t in ATTENTION_DYNAMIC if t < n_layer - 1]
    return rows


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
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    return n_elements / block * size


def static_step_bytes(tensors: Dict[str, tuple], n_layer: int, kind: str) -> float:
    """Weight bytes one decode step of llama.cpp's `kind` quant of this backbone reads: every
    layer weight and the head. tensors: {name: shape (ne0 first)} of the backbone's tensors.
    Small F32 tensors (norms) are left out, as in step_bytes they cost the same on both sides."""
    total = 0.0
    for l in range(n_layer):
        for role in _LAYER_WEIGHTS:
            shape = tensors.get(f"blk.{l}.{role}.weight")
            if shape is not None:
                total += _type_bytes(_llama_cpp_type(kind, role, l, n_layer, int(shape[0])), int(np.prod(shape)))
    head = tensors.get("output.weight", tensors.get("token_embd.weight"))
    if head is not None:
        total += _type_bytes(_llama_cpp_type(kind, "output", -1, n_layer, int(head[0])), int(np.prod(head)))
    return total


def _plain_tensor_shapes(model) -> Dict[str, tuple]:
    import gguf

    r = gguf.GGUFReader(model.model_path)
    return {t.name: tuple(int(x) for x in t.shape) for t in r.tensors if not t.name.startswith("river.")}


def tier_bounds(model, layers: List[dict], head: dict) -> dict:
    """Per tier, the anchor quant's bytes per step relative to this file's river-only step."""
    shapes = _plain_tensor_shapes(model)
    L = model.n_layer
    river_only = step_bytes(layers, head, L, -1, 0, True)
    # Count only the weights step_bytes counts for the anchors' side too: layer matrices and head.
    norms = sum(_norm_bytes(shapes, l) for l in range(L))
    anchors = {kind: static_step_bytes(shapes, L, kind) + norms for _, kind in TIERS}
    return {"river_only_bytes": river_only, "anchor_bytes": anchors,
            "bounds": {name: anchors[kind] / river_only for name, kind in TIERS}}


def _norm_bytes(shapes: Dict[str, tuple], l: int) -> float:
    """F32 bytes of layer l's 1-D tensors (norms, biases), which every file keeps in F32."""
    p = f"blk.{l}."
    return sum(4.0 * int(np.prod(s)) for n, s in shapes.items() if n.startswith(p) and len(s) == 1)


def calibrate_presets(model, items=None, score_tokens: int = 64, progress: bool = True,
                      settings: Optional[List[dict]] = None) -> dict:
    """Measure `settings` (default: grid()) on the calibration split and choose the presets.

    Quality is the KL divergence of each setting's next-token distribution from the backbone's
    (the same file in backbone mode), both teacher-forced through the decode path with exits live
    (a batched pass is a different computation for quantized weights: eval/divergence.py). Cost
    is the weight bytes a step reads (step_bytes), against the tier bounds of tier_bounds.
    Returns {"presets", "rows", "anchors", "backbone_ppl", ...}."""
    from tqdm import tqdm

    from .eval import divergence
    from .eval import report as evaluate

    items = evaluate.calibration_items() if items is None else items
    prepared = [p for its in items.values() for p in evaluate.prepare(model, its, score_tokens)]
    settings = grid(model.n_layer) if settings is None else settings
    layers, head = weight_bytes(model)
    L = model.n_layer
    n_tok = sum(len(t) - p for t, p in prepared)
    configs = {i: (model, dict(exit_layer=None, **opts)) for i, opts in enumerate(settings)}
    configs["backbone"] = (model, dict(mode="backbone", exit_layer=None))
    with tqdm(total=n_tok * len(configs), desc="presets", unit="tok", disable=not progress) as bar:
        runs = divergence.score_configs(model, configs, prepared, bar=bar)
    base = runs.pop("backbone")
    river_only_cost = step_bytes(layers, head, L, -1, 0, True)
    rows = []
    for i, opts in enumerate(settings):
        r = runs[i]
        static = divergence.is_static(configs[i][1])
        mean_exit = -1.0 if static else r.mean_exit_layer
        cost = step_bytes(layers, head, L, mean_exit, opts.get("tail", 0), opts.get("river_head", True),
                          opts.get("river_attention", "river"))
        s = divergence.summarize(r)
        rows.append({"options": dict(opts), "kld": s["kld"], "kld_ci": s["kld_ci"], "same_top": s["same_top"],
                     "ppl": r.perplexity, "mean_exit_layer": mean_exit, "cost": cost,
                     "relative_cost": cost / river_only_cost,
                     "backbone_layers": backbone_layers_per_step(L, mean_exit, opts.get("tail", 0)),
                     "backbone_ppl": base.perplexity})
    anchors = tier_bounds(model, layers, head)
    chosen = choose(rows, anchors["bounds"])
    return {"presets": chosen, "rows": rows, "anchors": anchors, "backbone_ppl": base.perplexity,
            "river_only_cost": river_only_cost, "backbone_cost": step_bytes(layers, head, L, L - 1, 0, False),
            "n_tokens": base.n_tokens, "items": {d: [it.id for it in its] for d, its in items.items()}}


GRID_KEY = "river.presets_grid"


def preset_metadata(res: dict, default: str = DEFAULT_PRESET) -> dict:
    """The river.* keys that store calibrated presets, and every measured setting (so the tiers
    can be chosen again without measuring)."""
    grid_rows = [{k: r[k] for k in ("options", "kld", "same_top", "ppl", "cost", "relative_cost", "mean_exit_layer")}
                 for r in res["rows"]]
    return {PRESET_KEY: dump(res["presets"]), DEFAULT_KEY: default, GRID_KEY: dump(grid_rows),
            ANCHORS_KEY: dump(res["anchors"]), "river.presets_calibration_tokens": int(res["n_tokens"])}
