"""Scoring primitives shared by the report, the calibrators and the benchmarks: evaluation items
turned into (tokens, prefix) pairs, teacher-forced perplexity through the decode path, greedy runs
on river_gguf and on stock llama.cpp, and the agreement of greedy outputs. Nothing here builds or
converts a file, so the calibrators (river_gguf.calibrate) and the converter can use it."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..greedy import greedy
from ..options import ExitOptions
from . import data as eval_data
from . import divergence
from .llama_decode import LlamaDecoder
from .teacher import score

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
    """score over items. The first scored token of an item is predicted by the prefill
    (backbone), the others by decode steps; `exits` holds the decode steps' exit layers."""
    lps, exits = [], []
    t0 = time.perf_counter()
    for toks, prefix in prepared:
        r = score(model, toks, prefix=prefix, **opts)
        lps.append(r.logprobs)
        exits.append([int(e) for e in r.exit_layers[1:]])
        if bar is not None:
            bar.update(len(toks) - prefix)
    return ScoreRun(np.concatenate(lps) if lps else np.zeros(0), exits, time.perf_counter() - t0)


def score_forced(model, reference, prepared: Prepared, exits: List[List[int]], river_head: bool = False,
                 bar=None) -> divergence.DivergenceRun:
    """Teacher-forced scoring with a given exit layer per decode step (engine mode 3): a
    backbone prefill, then step j of item i exits after layer exits[i][j]; KLD against the
    reference model (backbone mode, one batched pass per item)."""
    backbone = ExitOptions(mode="backbone", river_head=bool(river_head))
    run = divergence.DivergenceRun()
    t0 = time.perf_counter()
    for (toks, prefix), ex in zip(prepared, exits):
        if len(ex) != len(toks) - prefix - 1:
            raise ValueError(f"item needs {len(toks) - prefix - 1} exit layers, got {len(ex)}")
        text = iter(toks[prefix:])
        with model.session(backbone) as session:
            session.prefill(toks[:prefix])
            kept = [np.array(step.row, dtype=np.float32)
                    for step in session.decode(lambda row, seen: next(text), limit=len(toks) - prefix, exit_layers=ex)]
        ref = divergence.reference_logits(reference, toks, prefix, mode="backbone")  # decode, as score_configs
        run.add(divergence.compare(ref, np.stack(kept), toks[prefix:]), ex)
        if bar is not None:
            bar.update(len(toks) - prefix)
    run.seconds = time.perf_counter() - t0
    return run


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
    g = greedy(model, prompt, n_new, **opts)
    return g.tokens, g.decode_steps, g.decode_seconds, g.decode_exit_layers


class LlamaCppRunner:
    """Greedy decode in stock llama.cpp; only llama_decode is timed, as only the engine's eval is
    on river_gguf's side (llama_decode.LlamaDecoder)."""

    def __init__(self, path: str, n_ctx: int, n_threads: int):
        self.decoder = LlamaDecoder(path, n_ctx, n_threads)

    def greedy(self, prompt: List[int], n_new: int) -> Tuple[List[int], int, float, List[int]]:
        out, steps, secs = self.decoder.greedy(prompt, n_new)
        return out, steps, secs, []

    def close(self):
        self.decoder.close()


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


#: The presets' calibration items: at most this many scored tokens of each item's completion, and
#: at most this many tokens of its prompt (BOS and the prompt's tail). Every setting the presets
#: measure prefills the item's prompt as it does in use (a river-only setting with its river), so
#: the prompt's tokens are work every setting repeats and no KLD is scored on. 16 of them: on
#: Qwen2.5-Coder's calibration 1,307 tokens a setting against 1,939 with 64 (15 items, the same 1,067
#: scored), the presets' passes 26% shorter, and the presets chosen, by the full sweep and by the
#: pruned search, the same as with 64 on SmolLM2 and Qwen2.5-Coder-0.5B; the KLDs, measured in a
#: shorter context, come out higher (Qwen's river-only 0.0031 against 0.0024; BENCHMARKS.md).
PRESET_SCORE_TOKENS = 128
PRESET_PROMPT_TOKENS = 16
#: The presets' evidence by default: the scored tokens each static setting runs on, items taken in
#: turn from both domains until they hold this many. 768 gives 10 items on SmolLM2 and on
#: Qwen2.5-Coder (the fewest for which a KLD gets an interval, preset_grid.MIN_INTERVAL_ITEMS), where
#: 1,024 gave 13 and 15: the presets chosen are the same at both budgets on both models, by the full
#: sweep and by the converter's search; the intervals come out about a sixth wider; a conversion of
#: Qwen2.5-Coder-0.5B is about 6% shorter (BENCHMARKS.md). The same at every model size: the
#: presets' passes are batched, so they cost what the importance matrix's do per token.
PRESET_CALIBRATION_TOKENS = 768


def calibration_prepared(model, min_tokens: int, score_tokens: int = PRESET_SCORE_TOKENS,
                         domains: Sequence[str] = eval_data.DOMAINS, prompt_tokens: int = PRESET_PROMPT_TOKENS) -> Prepared:
    """The calibration split's items, one domain after another in turn, prepared (at most
    score_tokens scored tokens and prompt_tokens of prompt each) until they hold at least
    min_tokens scored tokens (or the split runs out)."""
    return calibration_selection(model, min_tokens, score_tokens, domains, prompt_tokens)[0]


def calibration_selection(model, min_tokens: int, score_tokens: int = PRESET_SCORE_TOKENS,
                          domains: Sequence[str] = eval_data.DOMAINS,
                          prompt_tokens: int = PRESET_PROMPT_TOKENS) -> Tuple[Prepared, List[eval_data.Item]]:
    """(calibration_prepared's items prepared, the eval_data.Items they came from)."""
    pools = [eval_data.select(eval_data.load_domain(d), "calibration") for d in domains]
    out, items, n = [], [], 0
    for i in range(max(len(p) for p in pools)):
        for pool in pools:
            if n >= min_tokens:
                return out, items
            if i < len(pool):
                items.append(pool[i])
                for toks, prefix in prepare(model, [pool[i]], score_tokens, prompt_tokens):
                    out.append((toks, prefix))
                    n += len(toks) - prefix
    return out, items


def calibration_items(domains: Sequence[str] = eval_data.DOMAINS, per_domain: Optional[int] = 8):
    return {eval_data.domain_name(d): eval_data.select(eval_data.load_domain(d), "calibration", per_domain)
            for d in domains}
