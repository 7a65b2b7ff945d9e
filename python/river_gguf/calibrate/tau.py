"""Tau calibration: the fastest exit threshold whose calibration perplexity is within a budget of
the backbone's (`river-gguf calibrate`, `river-gguf convert --calibrate`), and the metadata it
writes into a River GGUF."""
from __future__ import annotations

import argparse
from typing import Optional, Sequence

from tqdm import tqdm

from ..gguf.meta import set_river_metadata
from ..measure import data as eval_data
from ..measure.scoring import calibration_items, prepare, score_items
from ..options import EXIT_RULES, never_exit
from ..measure.profile import rule_taus, similarity_profile
from . import open_model

# Cosine's, dense where SmolLM2's mid-layer similarities live: mean exit layer moves from ~2 to
# ~28 here. Another rule's are these quantiles of its profile (default_taus).
DEFAULT_TAUS = (0.96, 0.97, 0.975, 0.98, 0.9825, 0.985, 0.9875, 0.99, 0.995)
DEFAULT_QUANTILES = (0.6, 0.7, 0.75, 0.8, 0.85, 0.875, 0.9, 0.95, 0.975)


def default_taus(model, exit_rule: str = EXIT_RULES[0]) -> tuple:
    """The taus calibrate tries for `exit_rule`: DEFAULT_TAUS for cosine, else DEFAULT_QUANTILES
    of the rule's profile on this model (measure.profile.similarity_profile)."""
    if exit_rule == EXIT_RULES[0]:
        return DEFAULT_TAUS
    return rule_taus(similarity_profile(model, exit_rule=exit_rule), DEFAULT_QUANTILES)


def select_tau(rows: Sequence[dict], backbone_ppl: float, budget: float, exit_rule: str = EXIT_RULES[0]) -> dict:
    """The fastest row whose perplexity is within `budget` (a fraction: 0.02 = 2%) of the
    backbone's. Fastest = lowest mean exit layer (deterministic), then highest measured
    speed, then lowest tau. rows: dicts with tau, ppl, mean_exit_layer and optionally tok_s.
    With no row within budget, the rule's never-exit threshold (options.never_exit) is
    returned, feasible=False."""
    limit = backbone_ppl * (1.0 + budget)
    ok = [r for r in rows if r["ppl"] <= limit]
    if not ok:
        return {"threshold": never_exit(exit_rule), "feasible": False, "ppl_limit": limit}
    best = min(ok, key=lambda r: (r["mean_exit_layer"], -r.get("tok_s", 0.0), r["tau"]))
    return {"threshold": float(best["tau"]), "feasible": True, "ppl_limit": limit, "row": dict(best)}


def calibrate(model, budget: float = 0.02, taus: Optional[Sequence[float]] = None, items=None,
              score_tokens: int = 96, progress: bool = True, **opts) -> dict:
    """Pick tau of the model's exit rule (or opts' exit_rule): the fastest one whose calibration
    perplexity (tokens pooled over domains) is within `budget` of the backbone's. taus: default
    default_taus for the rule. items: {domain: [Item]} (default: calibration split of GSM8K and
    HumanEval, 8 items each). opts: further exit options (river_head, min_exit_layer)."""
    rule = opts.get("exit_rule") or model.exit_options.exit_rule
    taus = default_taus(model, rule) if taus is None else taus

    items = calibration_items() if items is None else items
    prepared = [p for its in items.values() for p in prepare(model, its, score_tokens)]
    n_tok = sum(len(t) - p for t, p in prepared)
    with tqdm(total=n_tok * (len(taus) + 1), desc="calibrate", unit="tok", disable=not progress) as bar:
        base = score_items(model, prepared, bar, mode="backbone", exit_layer=None)
        rows = []
        for tau in taus:
            r = score_items(model, prepared, bar, mode="river", threshold=float(tau), exit_layer=None, **opts)
            rows.append({"tau": float(tau), "ppl": r.perplexity, "mean_exit_layer": r.mean_exit_layer,
                         "tok_s": r.n_tokens / r.seconds if r.seconds > 0 else 0.0})
    sel = select_tau(rows, base.perplexity, budget, rule)
    chosen = sel.get("row", {})
    return {
        "threshold": sel["threshold"], "feasible": sel["feasible"], "budget": float(budget),
        "backbone_ppl": base.perplexity, "calibration_ppl": chosen.get("ppl", base.perplexity),
        "mean_exit_layer": chosen.get("mean_exit_layer", float(model.n_layer - 1)),
        "tok_s": chosen.get("tok_s"), "backbone_tok_s": base.n_tokens / base.seconds if base.seconds else None,
        "n_tokens": base.n_tokens, "items": {d: [it.id for it in its] for d, its in items.items()},
        "rows": rows,
    }


def calibration_metadata(res: dict) -> dict:
    """The river.* keys a calibration result writes into a River GGUF."""
    return {
        "river.threshold": res["threshold"],
        "river.threshold_source": "calibrated",
        "river.calibration_budget": res["budget"],
        "river.calibration_ppl": res["calibration_ppl"],
        "river.backbone_ppl": res["backbone_ppl"],
        "river.calibration_mean_exit_layer": res["mean_exit_layer"],
        "river.calibration_tokens": res["n_tokens"],
        "river.calibration_split": f"{','.join(res['items'])} items with index % "
                                   f"{eval_data.CALIBRATION_MODULUS} == 0",
    }


def calibrate_file(path: str, budget: float, n_threads: int = 2, progress: bool = True,
                   items_per_domain: int = 8, score_tokens: int = 96) -> dict:
    """Calibrate tau of a River GGUF in place (atomic rewrite of its metadata)."""

    m = open_model(path, n_ctx=1024, n_threads=n_threads)
    items = calibration_items(per_domain=items_per_domain)
    res = calibrate(m, budget=budget, items=items, score_tokens=score_tokens, progress=progress)
    del m  # release the mapping before the file is replaced
    set_river_metadata(path, calibration_metadata(res))
    return res


def parse_budget(s: str) -> float:
    """'2%' -> 0.02; '0.02' -> 0.02."""
    try:
        v = float(s[:-1]) / 100.0 if s.strip().endswith("%") else float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"budget must be a fraction (0.02) or a percentage (2%), got {s!r}")
    if not 0.0 <= v < 10.0:
        raise argparse.ArgumentTypeError(f"budget out of range: {s!r}")
    return v
