"""Named exit settings stored in a River GGUF: one file, several points of the speed/quality curve.

A static quant is one point; a River GGUF holds a backbone, a river and the exit rule, so it can
run anywhere between the river's speed and the backbone's quality. The converter measures a grid
of settings and keeps three as presets, one per tier (``fast``, ``balanced``, the default, and
``quality``); river_gguf.calibrate.cost_model says how the tiers are anchored and chosen.

This module is the stored format a Model reads: JSON under ``river.presets`` (each preset's
options with its calibration KLD, perplexity, mean exit layer, cost and cost relative to
river-only), ``river.presets_grid`` (every measured setting), ``river.presets_anchors`` (the
anchors) and ``river.default_preset`` (the one a Model uses by default). Where two tiers pick the
same setting, the higher tier's entry says so (``same_as``) and why.
"""
from __future__ import annotations

import json
from dataclasses import fields
from typing import Dict, List, Optional

from .options import ExitOptions

PRESET_KEY = "river.presets"
DEFAULT_KEY = "river.default_preset"
NAMES = ("fast", "balanced", "quality")
DEFAULT_PRESET = "balanced"
ANCHORS_KEY = "river.presets_anchors"

# The exit options a preset may set: every ExitOptions field but the prompt policy, which stays the file's.
OPTION_KEYS = tuple(f.name for f in fields(ExitOptions) if f.name != "prefill")
# What a setting that leaves them out means (a preset is a whole setting, Model._with_preset): the
# native setting's defaults (options.ExitOptions reads them from the module).
PLAIN_OPTIONS = {k: getattr(ExitOptions(), k) for k in ("exit_rule", "tail", "min_exit_layer", "river_attention")}


def complete(options: dict) -> dict:
    """A measured setting as call options that mean it whole: the keys it leaves out take their
    plain values, not those of the Model's current exit options (its default preset may set a
    tail or the backbone's attention). Grid rows, report rows and benchmark settings pass
    through this before a call."""
    return {**PLAIN_OPTIONS, **options}


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


def describe(presets: Dict[str, dict], default: Optional[str] = None) -> List[str]:
    """One line per preset, for `river-gguf info`."""
    lines = []
    for name in sorted(presets, key=lambda n: (NAMES.index(n) if n in NAMES else len(NAMES), n)):
        p = presets[name]
        o = p["options"]
        what = o.get("mode", "river")
        if what == "lossless":
            what = f"lossless draft_max={o.get('draft_max')}"
        elif what == "river":
            what = f"tau={o.get('threshold')} min_exit={o.get('min_exit_layer', 0)}"
        if o.get("river_attention", "river") != "river":
            what += f" river_attention={o['river_attention']}"
        lines.append(
            f"{name}{' (default)' if name == default else ''}: {what} tail={o.get('tail', 0)} "
            f"river_head={o.get('river_head')} | calibration KLD {p.get('kld', float('nan')):.4f}"
            + (f" [{p['kld_ci'][0]:.4f}, {p['kld_ci'][1]:.4f}]" if p.get("kld_ci") else "")
            + (f" ({p['n_tokens']} tokens, {p['scored']})" if p.get("n_tokens") else "") + ", ppl "
            f"{p.get('ppl', float('nan')):.4f}"
            + (f" ({p.get('reference', 'backbone')} {p['reference_ppl']:.4f})" if "reference_ppl" in p else "") + ", "
            f"{p.get('relative_cost', float('nan')):.2f}x river-only's cost per step (tier "
            f"{p.get('tier', float('nan')):.2f}x), mean exit {p.get('mean_exit_layer', float('nan')):.1f}"
            + (f" [= {p['same_as']}: {p['why']}]" if p.get("same_as") else f" [{p['why']}]" if p.get("why") else ""))
    return lines


GRID_KEY = "river.presets_grid"
