"""Exit options: which weights run each layer, resolved per call from a model's defaults."""
from dataclasses import dataclass, replace
from typing import Optional

# Engine mode codes (native/engine.h ExitMode).
_BACKBONE, _RIVER, _RIVER_ONLY, _FIXED = 0, 1, 2, 3

MODES = ("river", "backbone", "river-only")
PREFILL_POLICIES = ("backbone", "river")


@dataclass(frozen=True)
class ExitOptions:
    mode: str = "backbone"
    threshold: float = 2.0          # tau; > 1 means never exit
    min_exit_layer: int = 0
    exit_layer: Optional[int] = None  # force every token out after this backbone layer
    river_head: bool = False
    prefill: str = "backbone"       # "backbone": prompts never exit; "river": sequence-level exit
    tail: int = 0                   # exited tokens rejoin the backbone for the last `tail` layers

    def validate(self, n_layer: int, has_river: bool) -> "ExitOptions":
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.prefill not in PREFILL_POLICIES:
            raise ValueError(f"prefill must be one of {PREFILL_POLICIES}, got {self.prefill!r}")
        if not isinstance(self.threshold, (int, float)) or self.threshold != self.threshold:
            raise ValueError(f"threshold must be a number, got {self.threshold!r}")
        if not isinstance(self.min_exit_layer, int) or not 0 <= self.min_exit_layer < n_layer:
            raise ValueError(f"min_exit_layer must be an int in [0, {n_layer - 1}], got {self.min_exit_layer!r}")
        if self.exit_layer is not None and (
            not isinstance(self.exit_layer, int) or not -1 <= self.exit_layer < n_layer
        ):
            raise ValueError(f"exit_layer must be an int in [-1, {n_layer - 1}], got {self.exit_layer!r}")
        if isinstance(self.tail, bool) or not isinstance(self.tail, int) or not 0 <= self.tail < n_layer:
            raise ValueError(f"tail must be an int in [0, {n_layer - 1}], got {self.tail!r}")
        uses_river = self.mode != "backbone" or (self.exit_layer is not None and self.exit_layer < n_layer - 1)
        if uses_river and not has_river:
            raise ValueError(
                f"mode={self.mode!r}, exit_layer={self.exit_layer!r} needs a river; this model has none "
                "(convert it with tools/add_river_gguf.py, or pass river=PATH)"
            )
        return self

    def with_overrides(self, **kw) -> "ExitOptions":
        return replace(self, **{k: v for k, v in kw.items() if v is not None})

    def engine_args(self, prompt: bool) -> dict:
        """Arguments of _native.Engine.eval for a prompt batch or a decode step."""
        args = dict(threshold=float(self.threshold), min_exit_layer=self.min_exit_layer,
                    river_head=bool(self.river_head), exit_layer=-1, tail=self.tail)
        if self.exit_layer is not None:
            args.update(mode=_FIXED, exit_layer=self.exit_layer)
        elif self.mode == "river-only":
            args.update(mode=_RIVER_ONLY)
        elif self.mode == "river" and (not prompt or self.prefill == "river"):
            args.update(mode=_RIVER)
        else:
            args.update(mode=_BACKBONE)
        return args
