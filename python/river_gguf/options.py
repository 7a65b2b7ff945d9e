"""River's options, defined once.

RiverOptions is everything River adds to loading a model: the river, the defaults of the exit
setting (a preset, the mode, tau, lossless drafting...), and where layers run (a GPU budget, RPC
servers, where the exit decision runs). Model, Llama, the CLI and the server take it (or its
fields as keyword arguments) and forward it; the CLI's flags come from its fields' metadata. The
fields a call may override (EXIT_FIELDS) are ExitOptions' own, generated from it (with their flags
from one table, EXIT_FLAGS), and resolve per call, from the file's defaults, into ExitOptions:
which weights run each layer of that call.
"""
import math
import numbers
from dataclasses import dataclass, field, fields, make_dataclass, replace
from typing import Any, Dict, Optional, Sequence, Union

import numpy as np

from ._loader import native as _native  # already loaded by the package's __init__: costs nothing

#: Engine.eval's mode codes by name: the one table, native/exit_setting.h kExitModes.
EXIT_MODES = dict(_native.EXIT_MODES)
_BACKBONE, _RIVER, _RIVER_ONLY, _FIXED = (EXIT_MODES[m] for m in ("backbone", "river", "river-only", "fixed"))
#: The exit rules by name, in code order (native/exit_rule.h): what each one's threshold means,
#: the highest score it reaches, and a threshold that no score passes.
_RULES = {name: (about, max_score, never) for name, about, max_score, never in _native.EXIT_RULES}
EXIT_RULES = tuple(_RULES)
_RULE_HELP = "; ".join(f"{name}: {about}" for name, (about, _, _) in _RULES.items())


def _rule(rule: Optional[str]) -> str:
    rule = EXIT_RULES[0] if rule is None else rule
    if rule not in _RULES:
        raise ValueError(f"exit_rule must be one of {EXIT_RULES}, got {rule!r}")
    return rule


def max_score(rule: Optional[str] = None) -> float:
    """The highest score `rule` (default: the default rule) gives: a threshold at or above it
    never passes."""
    return _RULES[_rule(rule)][1]


def never_exit(rule: Optional[str] = None) -> float:
    """A threshold of `rule` (default: the default rule) that no score passes: no token exits,
    and the engine runs the backbone as one graph (native never_exit_threshold)."""
    return _RULES[_rule(rule)][2]


#: The fields of the native exit setting that ExitOptions holds, by their Python names (native
#: names on the right). The rule and the river layers' attention are named for what they choose;
#: the mode and a forced exit layer are the call's (ExitOptions.engine_args). Derived from the
#: native field list, so a field added there fails here until it has its place.
_PER_CALL = ("mode", "exit_layer")
_PYTHON_NAME = {"rule": "exit_rule", "backbone_attention": "river_attention"}
SETTING_FIELDS = {_PYTHON_NAME.get(n, n): n for n in _native.ExitSetting.FIELDS if n not in _PER_CALL}
# native value -> Python value, and back, where they differ
_TO_PYTHON = {"backbone_attention": lambda b: "backbone" if b else "river"}
_TO_NATIVE = {"rule": EXIT_RULES.index, "backbone_attention": lambda s: s == "backbone"}
_DEFAULTS = {py: _TO_PYTHON.get(n, lambda v: v)(_native.EXIT_SETTING[n]) for py, n in SETTING_FIELDS.items()}

#: "lossless": the river drafts tokens and the backbone verifies them in one batch, so the output
#: is the backbone's, token for token (Llama's token loop; measure.teacher.score teacher-forced).
MODES = ("river", "backbone", "river-only", "lossless")
#: How lossless decoding drafts: every layer from the river, or River's exit rule (backbone layers
#: until the rule's score passes the threshold, the river above).
DRAFT_MODES = ("river-only", "river")
#: The most drafts a lossless round may verify in one batch.
MAX_DRAFT = 64
# Whose attention weights a river layer runs: its own, or the backbone's (with its own FFN).
RIVER_ATTENTION = ("river", "backbone")
PREFILL_POLICIES = ("backbone", "river")
#: The kernels of a lossless verify batch's rows: ggml's batched ones (the cheaper verify of
#: several drafts), or a decode step's (the text is plain decoding's, bit for bit).
LOSSLESS_KERNELS = ("batch", "decode")

#: Seconds an RPC server may take to answer one request before the Model gives up on it
#: (native/engine_config.h, as every default of the engine's config: _native.ENGINE_CONFIG).
RPC_TIMEOUT = float(_native.ENGINE_CONFIG["rpc_timeout"])
#: Where the exit decision runs, and whose weights of a remote layer go with it (engine_config.h).
EXIT_DECISIONS = tuple(_native.EXIT_DECISIONS)
RPC_WEIGHTS = tuple(_native.RPC_WEIGHTS)


def is_int(x) -> bool:
    """A real integer: Python or numpy ints, not bools (True would silently mean 1)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def is_bool(x) -> bool:
    # numpy's bool_ is not a bool subclass, but it is what a caller holding arrays passes.
    return isinstance(x, (bool, np.bool_))


def is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not is_bool(x)


_BYTE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
               "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tb": 1 << 40,
               "tib": 1 << 40}


def parse_bytes(name: str, v) -> int:
    """A size in bytes: a positive int, or a string of a number and a binary unit ("512MiB",
    "6G", "1.5GiB"; K/M/G/T and their -B/-iB forms all count in powers of 1024, as GPU memory
    is reported). Anything else raises ValueError naming the argument."""
    if is_int(v):
        if v <= 0:
            raise ValueError(f"{name} must be positive, got {v!r}")
        return int(v)
    if isinstance(v, str):
        text = v.strip().lower().replace(" ", "")
        number = text.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = text[len(number):]
        try:
            value = float(number)
        except ValueError:
            value = float("nan")
        if unit in _BYTE_UNITS and math.isfinite(value) and value > 0 and value * _BYTE_UNITS[unit] >= 1:
            return int(value * _BYTE_UNITS[unit])
    raise ValueError(f"{name} must be a positive number of bytes or a size such as '4GiB' or '512MiB', got {v!r}")


@dataclass(frozen=True)
class ExitOptions:
    # The native setting's fields (SETTING_FIELDS) with its defaults, and the call's mode and exit layer.
    mode: str = _native.EXIT_SETTING["mode"]
    exit_rule: str = _DEFAULTS["exit_rule"]            # when a token leaves in mode "river"
    threshold: float = _DEFAULTS["threshold"]          # the rule's tau; the default never exits (never_exit)
    min_exit_layer: int = _DEFAULTS["min_exit_layer"]
    exit_layer: Optional[int] = None  # force every token out after this backbone layer
    river_head: bool = _DEFAULTS["river_head"]
    # The layer Python runs. "backbone": prompts never exit; "river": sequence-level exit.
    prefill: str = "backbone"
    tail: int = _DEFAULTS["tail"]                      # exited tokens rejoin the backbone for the last `tail` layers
    river_attention: str = _DEFAULTS["river_attention"]  # "backbone": river layers run the backbone's attention
    # Lossless mode: at most draft_max drafts a round, each kept while its probability under the
    # draft is >= draft_p_min (llama.cpp's --draft-max / --draft-p-min), drafted as draft_mode says
    # with the options above (threshold, river_head, tail, river_attention).
    draft_max: int = 4
    draft_p_min: float = 0.0
    draft_mode: str = "river-only"
    # Lossless mode: n-gram drafts from the context where they pay (river_gguf.drafters), and a
    # draft length (and early stop) that follows the running acceptance and the measured costs.
    ngram_draft: bool = True
    adaptive_draft: bool = True

    def validate(self, n_layer: int, has_river: bool) -> "ExitOptions":
        if not isinstance(self.mode, str) or self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if not isinstance(self.prefill, str) or self.prefill not in PREFILL_POLICIES:
            raise ValueError(f"prefill must be one of {PREFILL_POLICIES}, got {self.prefill!r}")
        if not isinstance(self.exit_rule, str) or self.exit_rule not in EXIT_RULES:
            raise ValueError(f"exit_rule must be one of {EXIT_RULES}, got {self.exit_rule!r}")
        if not is_real(self.threshold) or not math.isfinite(self.threshold):
            raise ValueError(f"threshold must be a finite number (not a bool), got {self.threshold!r}")
        if not is_int(self.min_exit_layer) or not 0 <= self.min_exit_layer < n_layer:
            raise ValueError(f"min_exit_layer must be an int in [0, {n_layer - 1}], got {self.min_exit_layer!r}")
        if self.exit_layer is not None and (not is_int(self.exit_layer) or not -1 <= self.exit_layer < n_layer):
            raise ValueError(f"exit_layer must be an int in [-1, {n_layer - 1}] or None, got {self.exit_layer!r}")
        if not is_bool(self.river_head):
            raise ValueError(f"river_head must be a bool, got {self.river_head!r}")
        if not isinstance(self.river_attention, str) or self.river_attention not in RIVER_ATTENTION:
            raise ValueError(f"river_attention must be one of {RIVER_ATTENTION}, got {self.river_attention!r}")
        if not is_int(self.tail) or not 0 <= self.tail < n_layer:
            raise ValueError(f"tail must be an int in [0, {n_layer - 1}], got {self.tail!r}")
        if not is_int(self.draft_max) or not 0 <= self.draft_max <= MAX_DRAFT:
            raise ValueError(f"draft_max must be an int in [0, {MAX_DRAFT}], got {self.draft_max!r}")
        if not is_real(self.draft_p_min) or not 0.0 <= self.draft_p_min <= 1.0:
            raise ValueError(f"draft_p_min must be a number in [0, 1], got {self.draft_p_min!r}")
        if not isinstance(self.draft_mode, str) or self.draft_mode not in DRAFT_MODES:
            raise ValueError(f"draft_mode must be one of {DRAFT_MODES}, got {self.draft_mode!r}")
        for name in ("ngram_draft", "adaptive_draft"):
            if not is_bool(getattr(self, name)):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        uses_river = self.mode != "backbone" or (self.exit_layer is not None and self.exit_layer < n_layer - 1)
        if uses_river and not has_river:
            raise ValueError(
                f"mode={self.mode!r}, exit_layer={self.exit_layer!r} needs a river; this model has none "
                "(convert it with tools/add_river_gguf.py, or pass river=PATH)"
            )
        return self

    def with_overrides(self, **kw) -> "ExitOptions":
        known = {f.name for f in fields(self)}
        unknown = sorted(set(kw) - known)
        if unknown:
            # Without this, dataclasses.replace raises a TypeError about __init__.
            raise ValueError(f"unknown option {unknown[0]!r}; the exit options are: "
                             f"{', '.join(sorted(known | {'preset'}))}")
        return replace(self, **{k: v for k, v in kw.items() if v is not None})

    @property
    def label(self) -> str:
        """The setting's name in statistics: the mode, or "exit_layer=k" for a forced exit."""
        return self.mode if self.exit_layer is None else f"exit_layer={self.exit_layer}"

    @property
    def lossless(self) -> bool:
        return self.mode == "lossless" and self.exit_layer is None

    def engine_args(self, prompt: bool) -> dict:
        """Arguments of _native.Engine.eval for a prompt batch or a decode step (in lossless
        mode, the backbone's verify batch)."""
        args = self._setting_args()
        if self.exit_layer is not None:
            args.update(mode=_FIXED, exit_layer=int(self.exit_layer))
        elif self.mode == "river-only":
            args.update(mode=_RIVER_ONLY)
        elif self.mode == "river" and (not prompt or self.prefill == "river"):
            args.update(mode=_RIVER)
        else:
            args.update(mode=_BACKBONE)
        return args

    def draft_args(self) -> dict:
        """Arguments of _native.Engine.draft: the exit setting lossless mode drafts with."""
        args = self._setting_args()
        args.update(mode=_RIVER if self.draft_mode == "river" else _RIVER_ONLY, n_max=int(self.draft_max),
                    p_min=float(self.draft_p_min))
        return args

    def _setting_args(self) -> dict:
        """The fields of the engine's exit setting (native EXIT_SETTING) that these options set."""
        args = {n: _TO_NATIVE.get(n, type(_native.EXIT_SETTING[n]))(getattr(self, py))
                for py, n in SETTING_FIELDS.items()}
        args.update(exit_layer=-1)
        return args

    @classmethod
    def from_setting(cls, setting, **python_layer) -> "ExitOptions":
        """These options of a native ExitSetting (e.g. Engine.file_exit_setting), with the
        Python-only fields given (prefill, drafting)."""
        d = setting.as_dict()
        kw = {py: _TO_PYTHON.get(n, lambda v: v)(d[n]) for py, n in SETTING_FIELDS.items()}
        if d["mode"] == "fixed":
            kw.update(mode="river", exit_layer=d["exit_layer"])
        else:
            kw.update(mode=d["mode"])
        return cls(**kw, **python_layer)


_missing = set(SETTING_FIELDS) - {f.name for f in fields(ExitOptions)}
if _missing:
    raise ImportError(f"ExitOptions lacks the native exit setting's fields {sorted(_missing)} (SETTING_FIELDS)")


def _flag(flags: Sequence[str], help: str, parse: Optional[str] = None, bool_flag: bool = False,
          **argparse_kw) -> dict:
    """A field's command-line flag (cli/common.py adds one per field): argparse's keywords, a
    --flag/--no-flag pair for a bool, or `parse`, how its text becomes the value ("layers", "floats")."""
    return {"flags": tuple(flags), "help": help, "parse": parse, "bool_flag": bool_flag, "argparse": argparse_kw}


def _place(default, *flags, **kw) -> Any:
    """A field of where things run: fixed when the model loads."""
    if flags:
        kw["flags"] = flags
    return field(default=default, metadata={"exit": False, "river_only": False, **_flag(**kw)})


#: The command line of the exit setting: a flag and help for `preset` (a stored setting by name)
#: and for each ExitOptions field. RiverOptions and the CLI take their exit fields from
#: ExitOptions itself (river_options_class), so a field this table does not name still gets one,
#: --its-name typed as the field, that a river needs.
EXIT_FLAGS = {
    "preset": dict(flags=("--preset",), metavar="NAME",
                   help="one of the River GGUF's stored settings: fast, balanced, quality (default: the file's "
                        "default, balanced); the options below override it"),
    "mode": dict(flags=("--mode",), river_only=False, choices=MODES,
                 help="exit mode (default: the file's own); lossless: the river drafts, the backbone verifies, "
                      "and the text is the backbone's"),
    "exit_rule": dict(flags=("--exit-rule",), choices=EXIT_RULES,
                      help=f"when a token leaves the backbone in mode river (default {EXIT_RULES[0]}); {_RULE_HELP}"),
    "threshold": dict(flags=("--threshold", "--tau"), type=float, metavar="TAU", help="the exit rule's threshold"),
    "min_exit_layer": dict(flags=("--min-exit-layer",), type=int, metavar="N",
                           help="backbone layers every token runs before it may exit"),
    "exit_layer": dict(flags=("--exit-layer",), river_only=False, type=int, metavar="K",
                       help="force every decoded token out after backbone layer K"),
    "river_head": dict(flags=("--river-head",), bool_flag=True, help="exited tokens use the river's own output head"),
    "prefill": dict(flags=("--prefill",), choices=PREFILL_POLICIES,
                    help="prompts run the backbone, or River's sequence-level exit"),
    "tail": dict(flags=("--tail",), type=int, metavar="T", help="exited tokens rejoin the backbone for the last T layers"),
    "river_attention": dict(flags=("--river-attention",), choices=RIVER_ATTENTION,
                            help="whose attention weights river layers run: their own, or the backbone's (with the "
                                 "river's FFN)"),
    "draft_max": dict(flags=("--draft-max",), type=int, metavar="N", help="lossless: at most N drafts a round (default 4)"),
    "draft_p_min": dict(flags=("--draft-p-min",), type=float, metavar="P",
                        help="lossless: stop drafting at a draft whose probability is below P (default 0)"),
    "draft_mode": dict(flags=("--draft-mode",), choices=DRAFT_MODES,
                       help="lossless: draft with every layer from the river (river-only, the default) or with "
                            "River's exit rule (river: backbone layers until the rule's score passes TAU)"),
    "ngram_draft": dict(flags=("--ngram-draft",), bool_flag=True,
                        help="lossless: draft the continuation of an earlier occurrence of the text's last tokens "
                             "(prompt and output) where that pays more than the river's drafts (default on)"),
    "adaptive_draft": dict(flags=("--adaptive-draft",), bool_flag=True,
                           help="lossless: choose each round's draft length (up to --draft-max, none where no "
                                "draft pays) and stop river drafts early, from the running acceptance and the "
                                "measured costs (default on; off: always --draft-max river drafts, and the "
                                "choice between drafters never reads the clock)"),
}

#: The fields of where things run, fixed when the model loads: (name, type, default, flag).
PLACE_FIELDS = (
    ("draft_vocab", Optional[int], None, dict(
        flags=("--draft-vocab",), type=int, metavar="N",
        help="lossless: the tokens a draft may propose, the N the file ranks first (its calibration text's, then "
             "ascending ids) and the end-of-generation ones; the draft's head runs their rows alone, and the "
             "backbone's verification keeps the text the same (0: the whole vocabulary; default: 32768 for a "
             "vocabulary of 65536 or more with a river head of its own)")),
    ("lossless_kernels", str, "batch", dict(
        flags=("--lossless-kernels",), choices=LOSSLESS_KERNELS,
        help="lossless: the kernels of a verify batch's rows. batch (the default): ggml's batched kernels, the "
             "cheaper verify; the text is the backbone's as a batch computes it, which parts from plain decoding "
             "only at near-ties (--verify-kernels makes decode steps match it). decode: each row as a decode step "
             "computes it, so the text is plain decoding's (and llama.cpp's on the same file) bit for bit, at a "
             "dearer verify (where the engine cannot: layers off the CPU, repacked backbone weights, batch's)")),
    ("verify_kernels", bool, False, dict(
        flags=("--verify-kernels",), bool_flag=True,
        help="with --lossless-kernels batch: decode steps in the verify batch's kernels, each step evaluating "
             "its token with a throwaway copy in one batch, so every mode's text equals lossless mode's bit for "
             "bit (near-ties that single-token and batched kernels round apart then decide alike), at a step's "
             "extra cost")),
    ("gpu_memory", Optional[Union[int, str]], None, dict(
        flags=("--gpu-memory",), metavar="SIZE",
        help="the most the GPU placement may use, e.g. 6GiB (default: its free memory); with --ngl -1, a River "
             "model that does not fit puts its river, head and KV cache there first")),
    ("exit_decision", str, "auto", dict(
        flags=("--exit-decision",), choices=EXIT_DECISIONS,
        help="where the exit test runs: auto (graph with offloaded layers, else cpu), cpu or graph")),
    ("rpc_servers", Optional[Union[str, Sequence[str]]], None, dict(
        flags=("--rpc",), metavar="HOST:PORT[,...]",
        help="put layers on these RPC servers (river-gguf rpc-server; trusted networks only)")),
    ("rpc_layers", Optional[Union[int, Sequence[int]]], None, dict(
        flags=("--rpc-layers",), metavar="N|LIST", parse="layers",
        help="layers on the RPC servers: N (the last N, -1: all; default all) or a list like 0-3,8")),
    ("rpc_split", Optional[Sequence[float]], None, dict(
        flags=("--rpc-split",), metavar="S1,S2,...", parse="floats",
        help="each remote device's share of those layers (default: by free memory)")),
    ("rpc_weights", str, "all", dict(
        flags=("--rpc-weights",), choices=RPC_WEIGHTS,
        help="whose weights of a remote layer go with it (default all; its KV cache always does)")),
    ("rpc_timeout", Optional[float], RPC_TIMEOUT, dict(
        flags=("--rpc-timeout",), type=float, metavar="S",
        help=f"seconds an RPC server may take to answer (default {RPC_TIMEOUT:g})")),
)


def _exit_flag(f) -> dict:
    """EXIT_FLAGS' entry for an exit field, or the flag a field it does not name gets."""
    if f.name in EXIT_FLAGS:
        return dict(EXIT_FLAGS[f.name])
    flag = "--" + f.name.replace("_", "-")
    about = f"the exit setting's {f.name} (ExitOptions; default: the file's)"
    if f.type is bool:
        return dict(flags=(flag,), bool_flag=True, help=about)
    return dict(flags=(flag,), type=f.type if f.type in (int, float) else str, metavar=f.name.upper(), help=about)


class _RiverOptionsMethods:
    """RiverOptions' behaviour; its fields come from river_options_class."""

    @classmethod
    def of(cls, river_options=None, **kw):
        """These options: `river_options` (default: all unset) with the keyword arguments that
        are not None on top. An unknown name raises TypeError, as a function's would."""
        base = river_options if river_options is not None else cls()
        if not isinstance(base, cls):
            raise ValueError(f"river_options must be a RiverOptions, got {type(base).__name__}")
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(kw) - set(names))
        if unknown:
            raise TypeError(f"unexpected keyword argument {unknown[0]!r} (River options are: {', '.join(names)})")
        return replace(base, **{k: v for k, v in kw.items() if v is not None})

    def exit_overrides(self) -> Dict[str, Any]:
        """The exit setting fields that are set, as call overrides."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.metadata["exit"] and getattr(self, f.name) is not None}

    def check_river(self, has_river: bool, where: str) -> None:
        """Refuse options that only mean something with a river, on a model without one: they
        would do nothing. (`mode` and `exit_layer` are checked by what they ask.)"""
        check_river_options(has_river, where, **{f.name: getattr(self, f.name) for f in fields(self)
                                                 if f.metadata["river_only"]})


def river_options_class(exit_options=None) -> type:
    """The RiverOptions dataclass: `river`, then `preset` and every field of `exit_options`
    (default ExitOptions) as an exit field (None: the file's default; a call may override it),
    then PLACE_FIELDS. Each field's metadata holds its command-line flag (cli/common.py)."""
    exit_fields = fields(ExitOptions if exit_options is None else exit_options)
    preset = field(default=None, metadata={"exit": True, "river_only": True, **_flag(**EXIT_FLAGS["preset"])})
    spec = [("river", Optional[str], _place(None, "--river", metavar="PATH",
                                            help="a separate lower-precision GGUF of the same model, used as "
                                                 "the river")),
            ("preset", Optional[str], preset)]
    for f in exit_fields:
        flag = _exit_flag(f)
        river_only = flag.pop("river_only", True)
        spec.append((f.name, Optional[f.type],
                     field(default=None, metadata={"exit": True, "river_only": river_only, **_flag(**flag)})))
    for name, kind, default, flag in PLACE_FIELDS:
        spec.append((name, kind, _place(default, **flag)))
    cls = make_dataclass("RiverOptions", spec, bases=(_RiverOptionsMethods,), frozen=True)
    cls.__module__ = __name__
    cls.__doc__ = ("What River adds to loading a model (see the module docstring). Every field's None (or "
                   "default) leaves the choice to the file and the engine.")
    return cls


RiverOptions = river_options_class()


#: Every RiverOptions field, the ones a call may override, and those that need a river.
NAMES = tuple(f.name for f in fields(RiverOptions))
EXIT_FIELDS = tuple(f.name for f in fields(RiverOptions) if f.metadata["exit"])
RIVER_ONLY = tuple(f.name for f in fields(RiverOptions) if f.metadata["river_only"])


def check_river_options(has_river: bool, where: str, **given) -> None:
    """Refuse river options (not None) on a model without a river: they would do nothing."""
    if has_river:
        return
    for name in RIVER_ONLY:
        if given.get(name) is not None:
            raise ValueError(f"{name}={given[name]!r} is a river option, but {where} has no river "
                             "(convert it with tools/add_river_gguf.py, or pass river=PATH)")
