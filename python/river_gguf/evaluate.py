"""Quality and speed evaluation of River early exit, against the static quant ladder.

Metrics, per domain (see eval_data for the texts and the calibration/evaluation split):
- perplexity, teacher-forced **through the decode path** (the prompt is prefilled, every
  completion token is one decode step, with exits), over at most `score_tokens` tokens per item;
- greedy agreement with the F16 backbone: the share of generated tokens equal, position by
  position, to the backbone's greedy continuation of the same prompt, and the mean length of
  the identical prefix;
- decode tok/s of greedy generation (all configurations run item by item, interleaved, so a
  drifting machine load hits every configuration alike);
- mean exit layer of the decode steps (n_layer - 1 = never exited).

Sweeps: tau over a grid dense where the similarities live (0.96..0.995 on SmolLM2), fixed
exit layers, and the **shuffle control**: a River run's exit layers are permuted across its
tokens (the histogram is kept exactly) and the text is re-scored with those depths forced per
decode step. If the cosine rule does not beat its own shuffle, the signal adds nothing beyond
the mix of depths.

The static quant ladder is scored by the same code (river_gguf's engine in backbone mode,
which matches llama.cpp bit for bit) and timed in stock llama.cpp (llama-cpp-python).

    PYTHONPATH=python python -m river_gguf.evaluate --quick          # CI sanity, < 2 min
    PYTHONPATH=python python benchmarks/pareto_report.py             # full report
"""
from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .results import json_safe, log_softmax_at

from . import eval_data

# Dense where SmolLM2's mid-layer similarities live: mean exit layer moves from ~2 to ~28 here.
DEFAULT_TAUS = (0.96, 0.97, 0.975, 0.98, 0.9825, 0.985, 0.9875, 0.99, 0.995)
DEFAULT_FIXED_EXITS = (0, 5, 10, 15, 20, 24, 27)
LADDER = ("f16", "q8_0", "q6_k", "q5_k_m", "q4_k_m", "q4_0")
SHUFFLE_SEED = 1234
SHUFFLE_DRAWS = 2

Prepared = List[Tuple[List[int], int]]  # (tokens, prefix) per item


# ----- data ----------------------------------------------------------------------------
def prepare(model, items: Sequence[eval_data.Item], score_tokens: int = 128, prompt_tokens: int = 384) -> Prepared:
    """Tokenize items; keep at most `prompt_tokens` of the prompt (BOS + its tail) and
    `score_tokens` of the completion."""
    out = []
    for it in items:
        toks, prefix = it.tokens(model)
        p, c = toks[:prefix], toks[prefix:prefix + score_tokens]
        if len(p) > prompt_tokens:
            p = p[:1] + p[len(p) - prompt_tokens + 1:]
        if not c:
            continue
        out.append((p + c, len(p)))
    return out


# ----- perplexity ----------------------------------------------------------------------
@dataclass
class ScoreRun:
    logprobs: np.ndarray                 # all scored tokens, items concatenated
    exits: List[List[int]]               # per item: exit layer of each decode step
    seconds: float

    @property
    def perplexity(self) -> float:
        return float(np.exp(-self.logprobs.mean())) if len(self.logprobs) else float("nan")

    @property
    def mean_exit_layer(self) -> float:
        flat = [e for ex in self.exits for e in ex]
        return float(np.mean(flat)) if flat else float("nan")

    @property
    def n_tokens(self) -> int:
        return int(len(self.logprobs))


def score_items(model, prepared: Prepared, bar=None, **opts) -> ScoreRun:
    """Model.score over items. The first scored token of an item is predicted by the prefill
    (backbone), the others by decode steps; `exits` holds the decode steps' exit layers."""
    lps, exits = [], []
    t0 = time.perf_counter()
    for toks, prefix in prepared:
        r = model.score(toks, prefix=prefix, **opts)
        lps.append(r.logprobs)
        exits.append([int(e) for e in r.exit_layers[1:]])
        if bar is not None:
            bar.update(len(toks) - prefix)
    return ScoreRun(np.concatenate(lps) if lps else np.zeros(0), exits, time.perf_counter() - t0)


def score_forced(model, prepared: Prepared, exits: List[List[int]], river_head: bool = False, bar=None) -> ScoreRun:
    """Teacher-forced scoring with a given exit layer per decode step (engine mode 3): a
    backbone prefill, then step j of item i exits after layer exits[i][j]."""
    eng = model._engine
    lps, used = [], []
    t0 = time.perf_counter()
    for (toks, prefix), ex in zip(prepared, exits):
        if len(ex) != len(toks) - prefix - 1:
            raise ValueError(f"item needs {len(toks) - prefix - 1} exit layers, got {len(ex)}")
        eng.truncate(0)
        logits, _, _ = eng.eval(toks[:prefix], mode=0)
        for i in range(prefix, len(toks)):
            lps.append(log_softmax_at(logits[-1], toks[i]))
            if i + 1 < len(toks):
                k = ex[i - prefix]
                logits, got, _ = eng.eval([toks[i]], mode=3, exit_layer=int(k), river_head=bool(river_head))
        used.append(list(ex))
        if bar is not None:
            bar.update(len(toks) - prefix)
    return ScoreRun(np.array(lps), used, time.perf_counter() - t0)


def shuffle_exits(exits: List[List[int]], seed: int) -> List[List[int]]:
    """The same exit layers (same histogram, same count per item), assigned to tokens at random."""
    flat = np.array([e for ex in exits for e in ex], dtype=np.int64)
    perm = np.random.default_rng(seed).permutation(flat)
    out, i = [], 0
    for ex in exits:
        out.append([int(x) for x in perm[i:i + len(ex)]])
        i += len(ex)
    return out


def histogram(exits: List[List[int]]) -> Dict[int, int]:
    h: Dict[int, int] = {}
    for ex in exits:
        for e in ex:
            h[int(e)] = h.get(int(e), 0) + 1
    return dict(sorted(h.items()))


# ----- greedy agreement and decode speed -----------------------------------------------
@dataclass
class GreedyRun:
    tokens: List[List[int]] = field(default_factory=list)
    decode_steps: int = 0
    decode_seconds: float = 0.0
    exit_layers: List[int] = field(default_factory=list)

    def add(self, tokens, steps, seconds, exits=()):
        self.tokens.append(list(tokens))
        self.decode_steps += steps
        self.decode_seconds += seconds
        self.exit_layers.extend(int(e) for e in exits)

    @property
    def decode_tok_s(self) -> float:
        return self.decode_steps / self.decode_seconds if self.decode_seconds > 0 else float("nan")


def greedy_river(model, prompt: List[int], n_new: int, **opts) -> Tuple[List[int], int, float, List[int]]:
    g = model.generate(prompt, max_tokens=n_new, temperature=0.0, **opts)
    s = g.stats
    secs = s["decode_tokens"] / s["decode_tok_s"] if s["decode_tok_s"] > 0 else 0.0
    return g.tokens, s["decode_tokens"], secs, s["exit_layers"][1:]


class LlamaCppRunner:
    """Greedy decode in stock llama.cpp, timed like river_gguf's loop (one eval and one logits
    row read back per step)."""

    def __init__(self, path: str, n_ctx: int, n_threads: int):
        import llama_cpp

        self.llm = llama_cpp.Llama(path, n_ctx=n_ctx, n_threads=n_threads, n_threads_batch=n_threads,
                                   flash_attn=True, verbose=False)
        self.n_vocab = self.llm.n_vocab()
        self.eos = self.llm.token_eos()

    def _argmax(self) -> int:
        row = np.array(np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.n_vocab,)))
        return int(np.argmax(row))

    def greedy(self, prompt: List[int], n_new: int) -> Tuple[List[int], int, float, List[int]]:
        import llama_cpp

        self.llm.reset()
        self.llm.eval(prompt)
        tok, out, secs, steps = self._argmax(), [], 0.0, 0
        while True:
            if llama_cpp.llama_vocab_is_eog(self.llm._model.vocab, tok):
                break
            out.append(tok)
            if len(out) >= n_new:
                break
            t0 = time.perf_counter()
            self.llm.eval([tok])
            tok = self._argmax()
            secs += time.perf_counter() - t0
            steps += 1
        return out, steps, secs, []

    def close(self):
        self.llm.close()


def agreement(ref: List[List[int]], out: List[List[int]]) -> Tuple[float, float]:
    """(share of positions where out equals ref, mean identical-prefix length), over items."""
    same = total = 0
    prefixes = []
    for a, b in zip(ref, out):
        n = max(len(a), len(b))
        total += n
        same += sum(1 for x, y in zip(a, b) if x == y)
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        prefixes.append(k)
    return (same / total if total else float("nan")), (float(np.mean(prefixes)) if prefixes else float("nan"))


# ----- tau selection (calibration) -----------------------------------------------------
def select_tau(rows: Sequence[dict], backbone_ppl: float, budget: float) -> dict:
    """The fastest row whose perplexity is within `budget` (a fraction: 0.02 = 2%) of the
    backbone's. Fastest = lowest mean exit layer (deterministic), then highest measured
    speed, then lowest tau. rows: dicts with tau, ppl, mean_exit_layer and optionally tok_s.
    With no row within budget, tau 1.01 (never exit) is returned, feasible=False."""
    limit = backbone_ppl * (1.0 + budget)
    ok = [r for r in rows if r["ppl"] <= limit]
    if not ok:
        return {"threshold": 1.01, "feasible": False, "ppl_limit": limit}
    best = min(ok, key=lambda r: (r["mean_exit_layer"], -r.get("tok_s", 0.0), r["tau"]))
    return {"threshold": float(best["tau"]), "feasible": True, "ppl_limit": limit, "row": dict(best)}


def calibration_items(domains: Sequence[str] = eval_data.DOMAINS, per_domain: Optional[int] = 8):
    return {eval_data.domain_name(d): eval_data.select(eval_data.load_domain(d), "calibration", per_domain)
            for d in domains}


def calibrate(model, budget: float = 0.02, taus: Sequence[float] = DEFAULT_TAUS, items=None,
              score_tokens: int = 96, progress: bool = True, **opts) -> dict:
    """Pick tau: the fastest one whose calibration perplexity (tokens pooled over domains) is
    within `budget` of the backbone's. items: {domain: [Item]} (default: calibration split of
    GSM8K and HumanEval, 8 items each). opts: further exit options (river_head, min_exit_layer)."""
    from tqdm import tqdm

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
    sel = select_tau(rows, base.perplexity, budget)
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


# ----- the evaluation plan -------------------------------------------------------------
@dataclass
class Setup:
    """One backbone/river pair (derived-model kinds) and what to sweep on it."""
    name: str
    backbone: str
    river: Optional[str]
    taus: Sequence[float] = ()
    fixed_exits: Sequence[int] = ()
    shuffle_taus: Sequence[float] = ()
    backbone_row: bool = False
    river_only: bool = True


@dataclass
class Settings:
    setups: List[Setup]
    ladder: Sequence[str] = LADDER
    domains: Sequence[str] = eval_data.DOMAINS
    score_items: int = 8          # evaluation items per domain scored for perplexity
    score_tokens: int = 96        # completion tokens scored per item
    gen_items: int = 3            # items per domain for greedy agreement / speed
    gen_tokens: int = 32
    prompt_tokens: int = 384      # prompts are cut to BOS + their last tokens
    n_ctx: int = 1024
    n_threads: int = 2
    river_head: bool = False
    speed_check: bool = False     # --quick: extra interleaved backbone-vs-river speed rounds
    progress: bool = True


def quick_settings() -> Settings:
    return Settings(
        setups=[Setup("F16+Q4_0", "f16", "q4_0", taus=(0.97, 0.98), fixed_exits=(10,), shuffle_taus=(0.98,),
                      backbone_row=True)],
        ladder=(), score_items=2, score_tokens=48, gen_items=1, gen_tokens=24, prompt_tokens=192, n_ctx=768,
        speed_check=True)


def full_settings() -> Settings:
    return Settings(
        setups=[
            Setup("F16+Q4_0", "f16", "q4_0", taus=DEFAULT_TAUS, fixed_exits=DEFAULT_FIXED_EXITS,
                  shuffle_taus=(0.975, 0.9825, 0.9875), backbone_row=True),
            Setup("F16+Q4_K_M", "f16", "q4_k_m", taus=(0.97, 0.98, 0.985, 0.99, 0.995), shuffle_taus=(0.985,)),
            Setup("Q8_0+Q4_0", "q8_0", "q4_0", taus=(0.97, 0.98, 0.985, 0.99, 0.995), backbone_row=True),
        ],
        score_items=10, score_tokens=80, gen_items=3, gen_tokens=32, prompt_tokens=256)


@dataclass
class Row:
    setup: str
    kind: str                     # backbone, river, fixed, river-only, shuffle, ladder
    label: str
    opts: dict
    tau: Optional[float] = None
    exit_layer: Optional[int] = None
    of: Optional[str] = None      # shuffle: label of the river row it shuffles
    draw: Optional[int] = None
    domains: Dict[str, dict] = field(default_factory=dict)

    def as_dict(self):
        return {"setup": self.setup, "kind": self.kind, "label": self.label, "tau": self.tau,
                "exit_layer": self.exit_layer, "of": self.of, "draw": self.draw, "domains": self.domains,
                "overall": self.overall()}

    def overall(self) -> dict:
        d = list(self.domains.values())
        out = {}
        n = sum(x.get("n_tokens", 0) for x in d)
        if n and all("ppl" in x for x in d):  # token-pooled: exp of the mean NLL over all tokens
            out["ppl"] = math.exp(sum(x["n_tokens"] * math.log(x["ppl"]) for x in d) / n)
        steps = sum(x.get("decode_steps", 0) for x in d)
        secs = sum(x.get("decode_seconds", 0.0) for x in d)
        if steps and secs:
            out["decode_tok_s"] = steps / secs
        for key in ("mean_exit_layer", "agreement", "agreement_prefix"):
            vals = [x[key] for x in d if x.get(key) is not None and not math.isnan(x[key])]
            if vals:
                out[key] = float(np.mean(vals))
        return out


def _path(kind: str) -> str:
    from .default_model import derived_model

    return derived_model(kind)


def _plan(settings: Settings, n_layer_hint: int = 30) -> List[Row]:
    rows: List[Row] = []
    rh = settings.river_head
    for s in settings.setups:
        if s.backbone_row:
            rows.append(Row(s.name, "backbone", f"{s.backbone.upper()} backbone", dict(mode="backbone")))
        if s.river_only and s.river:
            rows.append(Row(s.name, "river-only", f"{s.river.upper()} river-only",
                            dict(mode="river-only", river_head=rh)))
        for tau in s.taus:
            rows.append(Row(s.name, "river", f"tau={tau:g}", dict(mode="river", threshold=float(tau), river_head=rh),
                            tau=float(tau)))
        for k in s.fixed_exits:
            rows.append(Row(s.name, "fixed", f"exit@{k}", dict(exit_layer=int(k), river_head=rh), exit_layer=int(k)))
        for tau in s.shuffle_taus:
            for d in range(SHUFFLE_DRAWS):
                rows.append(Row(s.name, "shuffle", f"shuffle(tau={tau:g})#{d}", {}, tau=float(tau),
                                of=f"tau={tau:g}", draw=d))
    for q in settings.ladder:
        rows.append(Row("ladder", "ladder", q.upper(), dict(mode="backbone")))
    return rows


def _prompt_part(model, item, prompt_tokens: int = 384) -> List[int]:
    """An item's prompt tokens for generation, cut like prepare() cuts them (BOS + the tail)."""
    toks, prefix = item.tokens(model)
    p = toks[:prefix]
    return p if len(p) <= prompt_tokens else p[:1] + p[len(p) - prompt_tokens + 1:]


def _setup_of(settings: Settings, name: str) -> Setup:
    return next(s for s in settings.setups if s.name == name)


def run_eval(settings: Settings) -> dict:
    """Run the whole plan; returns the report dict (see write_outputs)."""
    from tqdm import tqdm
    from .model import Model

    t_start = time.perf_counter()
    models: Dict[Tuple[str, Optional[str]], object] = {}

    def model_for(backbone: str, river: Optional[str]):
        key = (backbone, river)
        if key not in models:
            models[key] = Model(_path(backbone), river=_path(river) if river else None, n_ctx=settings.n_ctx,
                                n_threads=settings.n_threads)
        return models[key]

    rows = _plan(settings)

    def model_of(row: Row):
        if row.kind == "ladder":
            return model_for(row.label.lower(), None)
        s = _setup_of(settings, row.setup)
        return model_for(s.backbone, s.river)

    ref_model = model_for("f16", None)
    n_layer = ref_model.n_layer
    data = {}
    for d in settings.domains:
        items = eval_data.load_domain(d)
        ev = eval_data.select(items, "evaluation")
        data[eval_data.domain_name(d)] = {
            "score": prepare(ref_model, ev[:settings.score_items], settings.score_tokens, settings.prompt_tokens),
            "gen": [_prompt_part(ref_model, it, settings.prompt_tokens) for it in ev[:settings.gen_items]],
            "n_items": len(items), "n_eval": len(ev),
            "score_ids": [it.id for it in ev[:settings.score_items]],
            "gen_ids": [it.id for it in ev[:settings.gen_items]],
        }

    # --- 1. perplexity (and exit layers) through the decode path ---
    river_runs: Dict[Tuple[str, str, str], ScoreRun] = {}
    n_score = sum(sum(len(t) - p for t, p in dd["score"]) for dd in data.values())
    with tqdm(total=n_score * len(rows), desc="perplexity", unit="tok", disable=not settings.progress) as bar:
        for row in rows:
            for dname, dd in data.items():
                if row.kind == "shuffle":
                    base = river_runs[(row.setup, row.of, dname)]
                    ex = shuffle_exits(base.exits, SHUFFLE_SEED + 1000 * row.draw)
                    r = score_forced(model_of(row), dd["score"], ex, settings.river_head, bar)
                    extra = {"river_ppl": base.perplexity, "histogram_preserved": histogram(ex) == histogram(base.exits)}
                else:
                    r = score_items(model_of(row), dd["score"], bar, **row.opts)
                    extra = {}
                    if row.kind == "river":
                        river_runs[(row.setup, row.label, dname)] = r
                        extra["exit_histogram"] = histogram(r.exits)
                row.domains[dname] = {"ppl": r.perplexity, "n_tokens": r.n_tokens,
                                      "mean_exit_layer": r.mean_exit_layer if row.kind != "ladder" else None,
                                      "score_seconds": r.seconds, **extra}

    # --- 2. greedy agreement and decode speed: item by item, every configuration in turn ---
    gen_rows = [r for r in rows if r.kind not in ("shuffle",)]
    runners: Dict[str, LlamaCppRunner] = {}
    for r in gen_rows:
        if r.kind == "ladder":
            runners[r.label] = LlamaCppRunner(_path(r.label.lower()), settings.n_ctx, settings.n_threads)
    ref_runs = {d: GreedyRun() for d in data}
    runs = {(id(r), d): GreedyRun() for r in gen_rows for d in data}
    n_gen = sum(len(dd["gen"]) for dd in data.values())
    with tqdm(total=n_gen * (len(gen_rows) + 1), desc="greedy+speed", unit="run", disable=not settings.progress) as bar:
        for dname, dd in data.items():
            for p in dd["gen"]:
                ref_runs[dname].add(*greedy_river(ref_model, p, settings.gen_tokens, mode="backbone"))
                bar.update(1)
                order = gen_rows if len(ref_runs[dname].tokens) % 2 else list(reversed(gen_rows))
                for r in order:
                    if r.kind == "ladder":
                        res = runners[r.label].greedy(p, settings.gen_tokens)
                    else:
                        res = greedy_river(model_of(r), p, settings.gen_tokens, **r.opts)
                    runs[(id(r), dname)].add(*res)
                    bar.update(1)
    for x in runners.values():
        x.close()
    for r in gen_rows:
        for dname in data:
            g = runs[(id(r), dname)]
            share, pre = agreement(ref_runs[dname].tokens, g.tokens)
            r.domains[dname].update(agreement=share, agreement_prefix=pre, decode_tok_s=g.decode_tok_s,
                                    decode_steps=g.decode_steps, decode_seconds=g.decode_seconds,
                                    engine="llama.cpp" if r.kind == "ladder" else "river_gguf")
    for r in rows:  # a shuffle runs at its river run's depth mix: give it that row's speed
        if r.kind == "shuffle":
            src = next(x for x in rows if x.setup == r.setup and x.label == r.of)
            for dname in data:
                for k in ("decode_tok_s", "decode_steps", "decode_seconds"):
                    r.domains[dname][k] = src.domains[dname].get(k)

    # --- 3. optional: dedicated interleaved speed rounds, backbone vs fastest river (for --quick) ---
    speed = None
    if settings.speed_check:
        s0 = settings.setups[0]
        m = model_for(s0.backbone, s0.river)
        tau = min(s0.taus)
        p = next(iter(data.values()))["gen"][0]
        b_s, r_s = [], []
        for i in range(5):
            for which in (("b", "r") if i % 2 == 0 else ("r", "b")):
                opts = dict(mode="backbone") if which == "b" else dict(mode="river", threshold=tau)
                _, steps, secs, _ = greedy_river(m, p, 24, **opts)
                (b_s if which == "b" else r_s).append(steps / secs if secs else 0.0)
        speed = {"tau": tau, "backbone_tok_s": statistics.median(b_s), "river_tok_s": statistics.median(r_s),
                 "backbone_runs": b_s, "river_runs": r_s}

    report = {
        "model": "SmolLM2-135M-Instruct", "n_layer": n_layer, "threads": settings.n_threads,
        "settings": {"prompt_tokens": settings.prompt_tokens, "score_items": settings.score_items, "score_tokens": settings.score_tokens,
                     "gen_items": settings.gen_items, "gen_tokens": settings.gen_tokens,
                     "river_head": settings.river_head, "shuffle_seed": SHUFFLE_SEED, "shuffle_draws": SHUFFLE_DRAWS,
                     "split": f"item i is calibration text iff i % {eval_data.CALIBRATION_MODULUS} == 0; "
                              "only evaluation items are used here"},
        "domains": {d: {k: v for k, v in dd.items() if k not in ("score", "gen")} for d, dd in data.items()},
        "rows": [r.as_dict() for r in rows],
        "speed_check": speed,
        "seconds": time.perf_counter() - t_start,
    }
    report["analysis"] = analyse(report)
    return report


# ----- analysis ------------------------------------------------------------------------
def _interp(xs, ys, x):
    """Linear interpolation of y at x over points sorted by x; None outside the range."""
    pts = sorted(zip(xs, ys))
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    if pts and pts[0][0] == x:
        return pts[0][1]
    return None


def analyse(report: dict) -> dict:
    rows = report["rows"]
    out: dict = {"shuffle": [], "vs_ladder": {}, "sanity": {}}
    # Shuffle control.
    for r in rows:
        if r["kind"] != "river":
            continue
        sh = [x for x in rows if x["kind"] == "shuffle" and x["setup"] == r["setup"] and x["of"] == r["label"]]
        if not sh:
            continue
        per = {}
        for d in r["domains"]:
            sp = [x["domains"][d]["ppl"] for x in sh]
            per[d] = {"river_ppl": r["domains"][d]["ppl"], "shuffle_ppl": sp,
                      "cosine_beats_shuffle": r["domains"][d]["ppl"] < min(sp)}
        sp_all = [x["overall"]["ppl"] for x in sh]
        out["shuffle"].append({"setup": r["setup"], "tau": r["tau"], "river_ppl": r["overall"]["ppl"],
                               "shuffle_ppl": sp_all, "cosine_beats_shuffle": r["overall"]["ppl"] < min(sp_all),
                               "per_domain": per})
    # Against the ladder: River ppl at Q4_K_M's speed; River speed at Q8_0's ppl.
    lad = {r["label"]: r["overall"] for r in rows if r["kind"] == "ladder"}
    for setup in sorted({r["setup"] for r in rows if r["kind"] == "river"}):
        pts = [(r["overall"].get("decode_tok_s"), r["overall"].get("ppl")) for r in rows
               if r["setup"] == setup and r["kind"] == "river" and r["overall"].get("decode_tok_s")]
        a: dict = {"points": len(pts)}
        if "Q4_K_M" in lad and pts:
            x = lad["Q4_K_M"]["decode_tok_s"]
            y = _interp([p[0] for p in pts], [p[1] for p in pts], x)
            a["q4_k_m"] = {"ladder_tok_s": x, "ladder_ppl": lad["Q4_K_M"]["ppl"], "river_ppl_at_speed": y,
                           "river_max_tok_s": max(p[0] for p in pts),
                           "river_wins": (y is not None and y < lad["Q4_K_M"]["ppl"])}
        if "Q8_0" in lad and pts:
            yq = lad["Q8_0"]["ppl"]
            ok = [p[0] for p in pts if p[1] <= yq]
            a["q8_0"] = {"ladder_tok_s": lad["Q8_0"]["decode_tok_s"], "ladder_ppl": yq,
                         "river_best_tok_s_at_or_below_ppl": max(ok) if ok else None,
                         "river_min_ppl": min(p[1] for p in pts),
                         "river_wins": bool(ok) and max(ok) > lad["Q8_0"]["decode_tok_s"]}
        out["vs_ladder"][setup] = a
    # Sanity (what --quick asserts).
    for s in sorted({r["setup"] for r in rows if r["kind"] == "backbone"}):
        b = next(r for r in rows if r["setup"] == s and r["kind"] == "backbone")
        ro = next((r for r in rows if r["setup"] == s and r["kind"] == "river-only"), None)
        if ro is not None:
            out["sanity"][f"{s}: backbone ppl < river-only ppl"] = {
                d: b["domains"][d]["ppl"] < ro["domains"][d]["ppl"] for d in b["domains"]}
    sc = report.get("speed_check")
    if sc:
        out["sanity"]["river decode faster than backbone"] = sc["river_tok_s"] > sc["backbone_tok_s"]
    return out


def sanity_failures(report: dict) -> List[str]:
    fails = []
    for name, v in report["analysis"]["sanity"].items():
        if isinstance(v, dict):
            fails += [f"{name} [{d}]" for d, ok in v.items() if not ok]
        elif not v:
            fails.append(name)
    return fails


# ----- output --------------------------------------------------------------------------
def _f(x, fmt="{:.3f}"):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def markdown(report: dict) -> str:
    doms = list(report["domains"])
    head = ["setup", "config", "tok/s", "ppl"] + [f"ppl {d}" for d in doms] + \
           ["mean exit", "agree", "agree prefix"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in report["rows"]:
        o = r["overall"]
        cells = [r["setup"], r["label"] + (" (llama.cpp)" if r["kind"] == "ladder" else ""),
                 _f(o.get("decode_tok_s"), "{:.1f}"), _f(o.get("ppl"))]
        cells += [_f(r["domains"][d].get("ppl")) for d in doms]
        cells += [_f(o.get("mean_exit_layer"), "{:.1f}"), _f(o.get("agreement"), "{:.2f}"),
                  _f(o.get("agreement_prefix"), "{:.1f}")]
        lines.append("| " + " | ".join(cells) + " |")
    a = report["analysis"]
    out = ["\n".join(lines), ""]
    if a["shuffle"]:
        out.append("Shuffle control (same exit-layer histogram, depths assigned to tokens at random, "
                   f"seed {report['settings']['shuffle_seed']}, {report['settings']['shuffle_draws']} draws):\n")
        out.append("| setup | tau | River ppl | shuffled ppl | cosine beats shuffle |\n|---|---|---|---|---|")
        for s in a["shuffle"]:
            out.append(f"| {s['setup']} | {s['tau']:g} | {s['river_ppl']:.3f} | "
                       f"{', '.join(f'{x:.3f}' for x in s['shuffle_ppl'])} | "
                       f"{'yes' if s['cosine_beats_shuffle'] else 'no'} |")
        out.append("")
    for setup, v in a["vs_ladder"].items():
        if "q4_k_m" in v:
            q = v["q4_k_m"]
            y = q["river_ppl_at_speed"]
            out.append(f"- {setup} at Q4_K_M's speed ({q['ladder_tok_s']:.1f} tok/s, ppl {q['ladder_ppl']:.3f}): "
                       + (f"River ppl {y:.3f} -> {'River wins' if q['river_wins'] else 'Q4_K_M wins'}"
                          if y is not None else
                          f"River never reaches that speed (max {q['river_max_tok_s']:.1f} tok/s) -> Q4_K_M wins"))
        if "q8_0" in v:
            q = v["q8_0"]
            b = q["river_best_tok_s_at_or_below_ppl"]
            out.append(f"- {setup} at Q8_0's ppl ({q['ladder_ppl']:.3f}, {q['ladder_tok_s']:.1f} tok/s): "
                       + (f"best River speed {b:.1f} tok/s -> {'River wins' if q['river_wins'] else 'Q8_0 wins'}"
                          if b is not None else
                          f"no River point reaches that ppl (best {q['river_min_ppl']:.3f}) -> Q8_0 wins"))
    return "\n".join(out) + "\n"


def pareto_plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 6))
    rows = report["rows"]
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:purple"]
    for i, setup in enumerate(s for s in dict.fromkeys(r["setup"] for r in rows) if s != "ladder"):
        c = colors[i % len(colors)]
        for kind, style, lab in (("river", "-o", "River tau"), ("fixed", "--s", "fixed exit")):
            pts = sorted((r["overall"]["decode_tok_s"], r["overall"]["ppl"], r) for r in rows
                         if r["setup"] == setup and r["kind"] == kind and r["overall"].get("decode_tok_s"))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, color=c, ms=4, label=f"{setup} {lab}")
                for x, y, r in pts:
                    ax.annotate(f"{r['tau']:g}" if kind == "river" else str(r["exit_layer"]), (x, y), fontsize=6,
                                xytext=(2, 2), textcoords="offset points", color=c)
        sh = [(r["overall"]["decode_tok_s"], r["overall"]["ppl"]) for r in rows
              if r["setup"] == setup and r["kind"] == "shuffle" and r["overall"].get("decode_tok_s")]
        if sh:
            ax.plot(*zip(*sh), "x", color=c, label=f"{setup} shuffled depths")
        for kind, mk in (("backbone", "*"), ("river-only", "v")):
            for r in rows:
                if r["setup"] == setup and r["kind"] == kind and r["overall"].get("decode_tok_s"):
                    ax.plot(r["overall"]["decode_tok_s"], r["overall"]["ppl"], mk, color=c, ms=9,
                            label=f"{setup} {r['label']}")
    lad = [r for r in rows if r["kind"] == "ladder" and r["overall"].get("decode_tok_s")]
    if lad:
        ax.plot([r["overall"]["decode_tok_s"] for r in lad], [r["overall"]["ppl"] for r in lad], "kD", ms=6,
                label="static quant (llama.cpp)")
        for r in lad:
            ax.annotate(r["label"], (r["overall"]["decode_tok_s"], r["overall"]["ppl"]), fontsize=8,
                        xytext=(4, -8), textcoords="offset points")
    ax.set_xlabel("decode tok/s (greedy, batch 1, %d threads)" % report["threads"])
    ax.set_ylabel("perplexity (teacher-forced through the decode path, %s)" % " + ".join(report["domains"]))
    ax.set_title(f"{report['model']}: River early exit vs. static quants (lower right is better)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def write_outputs(report: dict, out_dir: str, preamble: str = "") -> Dict[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    paths = {k: os.path.join(out_dir, n) for k, n in (("md", "report.md"), ("json", "report.json"),
                                                       ("png", "pareto.png"))}
    with open(paths["json"], "w", encoding="utf-8") as f:
        json.dump(json_safe(report), f, indent=1)
    with open(paths["md"], "w", encoding="utf-8") as f:
        f.write(preamble + markdown(report))
    pareto_plot(report, paths["png"])
    return paths


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    s = quick_settings() if a.quick else full_settings()
    rep = run_eval(s)
    print(markdown(rep))
    if a.out:
        print(write_outputs(rep, a.out))
    fails = sanity_failures(rep)
    for f in fails:
        print(f"SANITY FAILED: {f}", file=sys.stderr)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
