"""Named exit settings stored in a River GGUF: one file, several points of the speed/quality curve.

A static quant is one point; a River GGUF holds a backbone, a river and the exit rule, so it can
run anywhere between the river's speed and the backbone's quality. The converter measures a grid
of settings and keeps three as presets, one per tier (``fast``, ``balanced``, the default, and
``quality``); river_gguf.calibrate.cost_model says how the tiers are anchored and chosen.

A setting (``Setting``) is an ExitOptions and the fields it names; a preset (``Preset``) is a
setting with the numbers its calibration measured. This module is the stored format a Model
reads: JSON under ``river.presets`` (each preset's named options under ``options``, with its
calibration KLD, perplexity, mean exit layer, cost and cost relative to river-only),
``river.presets_grid`` (every measured setting), ``river.presets_anchors`` (the anchors) and
``river.default_preset`` (the one a Model uses by default). Where two tiers pick the same
setting, the higher tier's entry says so (``same_as``) and why.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Mapping, Optional, Tuple

from .options import ExitOptions

PRESET_KEY = "river.presets"
DEFAULT_KEY = "river.default_preset"
NAMES = ("fast", "balanced", "quality")
DEFAULT_PRESET = "balanced"
ANCHORS_KEY = "river.presets_anchors"
GRID_KEY = "river.presets_grid"

# The exit options a setting may name: every ExitOptions field but the prompt policy, which stays the file's.
OPTION_KEYS = tuple(f.name for f in fields(ExitOptions) if f.name != "prefill")
# The fields a setting fixes whether it names them or not: the rule, where tokens may exit, the
# tail and whose attention the river runs. A measured point means these whole; the threshold,
# the head and the drafting stay the caller's unless the setting names them.
WHOLE_KEYS = ("exit_rule", "tail", "min_exit_layer", "river_attention")


@dataclass(frozen=True)
class Setting:
    """One exit setting as the presets and the calibration grid name it: `options`, the
    ExitOptions it runs (every field it does not name at ExitOptions' default), and `names`, the
    fields it names, which are its JSON keys and what it sets over a Model's defaults as a preset."""
    options: ExitOptions
    names: Tuple[str, ...]

    @classmethod
    def of(cls, **named) -> "Setting":
        """The setting naming these fields. An unknown field raises ValueError."""
        bad = sorted(set(named) - set(OPTION_KEYS))
        if bad:
            raise ValueError(f"a setting names exit options only ({', '.join(OPTION_KEYS)}); unknown: {bad}")
        return cls(ExitOptions(**named), tuple(k for k in OPTION_KEYS if k in named))

    @classmethod
    def from_json(cls, raw: Any, where: str) -> "Setting":
        """The setting of a stored JSON object (`where` names it in the error)."""
        if not isinstance(raw, dict):
            raise ValueError(f"{where}'s options must be a JSON object, got {raw!r}")
        try:
            return cls.of(**raw)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None

    def named(self) -> Dict[str, Any]:
        """The fields it names, as stored (its JSON object) and as a preset sets them."""
        return {k: getattr(self.options, k) for k in self.names}

    def call_options(self) -> Dict[str, Any]:
        """Call options that run this setting whole: the fields it names, and WHOLE_KEYS at its
        values (their defaults where it does not name them), not at a Model's current exit
        options (its default preset may set a tail or the backbone's attention)."""
        return {**{k: getattr(self.options, k) for k in WHOLE_KEYS}, **self.named()}

    def with_options(self, **changes) -> "Setting":
        """This setting with these fields changed (and named)."""
        return Setting.of(**{**self.named(), **changes})

    @property
    def is_dynamic(self) -> bool:
        """Whether its tokens leave the backbone by the exit rule (mode "river")."""
        return self.options.mode == "river"

    @property
    def plain_river_only(self) -> bool:
        """River-only with no backbone tail and the river's own attention: the step costs are relative to."""
        o = self.options
        return o.mode == "river-only" and not o.tail and o.river_attention == "river"


@dataclass(frozen=True)
class Preset:
    """A stored preset: its setting and the numbers its calibration measured ("kld", "ppl",
    "mean_exit_layer", "relative_cost", "tier", "same_as", "why", ...)."""
    setting: Setting
    measured: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def of_row(cls, row: Mapping[str, Any]) -> "Preset":
        """The preset of a calibration row ({"options": Setting, numbers...})."""
        return cls(row["options"], {k: v for k, v in row.items() if k != "options"})

    def to_json(self) -> dict:
        return {"options": self.setting.named(), **self.measured}


def parse(metadata: dict) -> Dict[str, Preset]:
    """The presets stored in a file's metadata ({} when none). Raises ValueError if malformed."""
    raw = metadata.get(PRESET_KEY)
    if raw is None:
        return {}
    try:
        stored = json.loads(raw)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{PRESET_KEY} is not valid JSON: {e}") from None
    if not isinstance(stored, dict) or not all(isinstance(v, dict) and isinstance(v.get("options"), dict)
                                               for v in stored.values()):
        raise ValueError(f"{PRESET_KEY} must map names to {{'options': {{...}}}}")
    out = {}
    for name, p in stored.items():
        bad = set(p["options"]) - set(OPTION_KEYS)
        if bad:
            raise ValueError(f"preset {name!r} sets unknown options {sorted(bad)}")
        out[name] = Preset.of_row({**p, "options": Setting.from_json(p["options"], f"preset {name!r}")})
    return out


def parse_grid(raw: str) -> List[dict]:
    """The rows of a stored river.presets_grid: each {"options": Setting, numbers...}."""
    try:
        rows = json.loads(raw)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{GRID_KEY} is not valid JSON: {e}") from None
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ValueError(f"{GRID_KEY} must be a list of rows")
    return [{**r, "options": Setting.from_json(r.get("options"), f"{GRID_KEY} row {i}")} for i, r in enumerate(rows)]


def _json_of(obj: Any) -> Any:
    if isinstance(obj, Setting):
        return obj.named()
    if isinstance(obj, Preset):
        return obj.to_json()
    raise TypeError(f"{type(obj).__name__} is not stored in a River GGUF's presets")


def dump(value: Any) -> str:
    """The stored JSON of presets, grid rows or anchors (Settings as the fields they name)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=_json_of)


def describe(presets: Dict[str, Preset], default: Optional[str] = None) -> List[str]:
    """One line per preset, for `river-gguf info`."""
    lines = []
    for name in sorted(presets, key=lambda n: (NAMES.index(n) if n in NAMES else len(NAMES), n)):
        p, o = presets[name].measured, presets[name].setting.options
        what = o.mode
        if what == "lossless":
            what = f"lossless draft_max={o.draft_max}"
        elif what == "river":
            what = f"tau={o.threshold} min_exit={o.min_exit_layer}"
        if o.river_attention != "river":
            what += f" river_attention={o.river_attention}"
        lines.append(
            f"{name}{' (default)' if name == default else ''}: {what} tail={o.tail} "
            f"river_head={o.river_head} | calibration KLD {p.get('kld', float('nan')):.4f}"
            + (f" [{p['kld_ci'][0]:.4f}, {p['kld_ci'][1]:.4f}]" if p.get("kld_ci") else "")
            + (f" ({p['n_tokens']} tokens, {p['scored']})" if p.get("n_tokens") else "") + ", ppl "
            f"{p.get('ppl', float('nan')):.4f}"
            + (f" ({p.get('reference', 'backbone')} {p['reference_ppl']:.4f})" if "reference_ppl" in p else "") + ", "
            f"{p.get('relative_cost', float('nan')):.2f}x river-only's cost per step (tier "
            f"{p.get('tier', float('nan')):.2f}x), mean exit {p.get('mean_exit_layer', float('nan')):.1f}"
            + (f" [= {p['same_as']}: {p['why']}]" if p.get("same_as") else f" [{p['why']}]" if p.get("why") else ""))
    return lines
