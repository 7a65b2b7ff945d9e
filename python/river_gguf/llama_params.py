"""What one river_gguf.Llama call runs with and what it ran: its completion arguments checked, its
logits processors (the caller's, then logit_bias) and its statistics (`last_stats`) from the
session's counters."""
from .llama_sampling import logit_bias_processor
from .options import is_int
from .results import exit_stats, lossless_stats
from .session import Counters


def check_completion_args(suffix, max_tokens, logprobs, seed) -> None:
    """create_completion's arguments of these kinds, as llama_cpp takes them (ValueError else)."""
    if suffix is not None and not isinstance(suffix, str):
        raise ValueError(f"suffix must be a str or None, got {suffix!r}")
    if max_tokens is not None and not is_int(max_tokens):
        raise ValueError(f"max_tokens must be an int or None, got {max_tokens!r}")
    if logprobs is not None and (not is_int(logprobs) or logprobs < 0):
        raise ValueError(f"logprobs must be an int >= 0 or None, got {logprobs!r}")
    if seed is not None and not is_int(seed):
        raise ValueError(f"seed must be an int or None, got {seed!r}")


def logits_processors(logits_processor, logit_bias, n_vocab: int) -> list:
    """A call's logits processors as llama_cpp applies them: the caller's callables (input_ids,
    scores) -> scores, then logit_bias (a dict token id -> bias)."""
    procs = list(logits_processor) if logits_processor is not None else []
    for p in procs:
        if not callable(p):
            raise TypeError(f"logits_processor entries must be callables (input_ids, scores) -> scores, got {p!r}")
    if logit_bias:
        if not isinstance(logit_bias, dict):
            raise ValueError(f"logit_bias must be a dict token id -> bias, got {logit_bias!r}")
        procs.append(logit_bias_processor(logit_bias, n_vocab))
    return procs


def call_stats(c: Counters, opts, n_layer: int, cached: int) -> dict:
    """last_stats of a call from its session's counters: prefill and decode tokens and speeds,
    the prompt tokens reused from the cache, the exit setting, the exit statistics, and in
    lossless mode the rounds'."""
    stats = {
        "prompt_tokens_cached": cached,
        "prefill_tokens": c.prefill_tokens,
        "prefill_tok_s": c.prefill_tokens / c.prefill_s if c.prefill_s > 0 else 0.0,
        "decode_tokens": c.decode_tokens,
        "decode_tok_s": c.decode_tokens / c.decode_s if c.decode_s > 0 else 0.0,
        "mode": opts.label,
        "threshold": opts.threshold,
        "tail": opts.tail,
    }
    stats.update(exit_stats(c.exit_layers, n_layer, opts.tail))
    if opts.lossless:
        stats.update(lossless_stats(c.rounds, c.drafted, c.accepted, c.draft_s, c.verify_s),
                     draft_max=opts.draft_max, draft_p_min=opts.draft_p_min, draft_mode=opts.draft_mode,
                     ngram_rounds=c.ngram_rounds, ngram_drafted=c.ngram_drafted, ngram_accepted=c.ngram_accepted)
    return stats
