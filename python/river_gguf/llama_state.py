"""river_gguf.Llama's saved states, in llama_cpp's LlamaState. The engine's KV cache cannot be copied
out, so a state holds the evaluated tokens (`llama_state`: STATE_MAGIC, then the tokens as
little-endian int32), the logits rows llama_cpp keeps and the seed; a restored Llama evaluates the
tokens again at its next evaluation. A state saved by llama_cpp.Llama (raw llama.cpp KV bytes) is
refused."""
from typing import Callable, NamedTuple, Optional

import numpy as np
from llama_cpp.llama import LlamaState

from .options import is_int

#: First bytes of a river_gguf state's `llama_state` (then the tokens as little-endian int32).
STATE_MAGIC = b"RIVERGGUF-STATE1"


class Restored(NamedTuple):
    input_ids: np.ndarray        # [n_ctx] int32: the state's input_ids, its tokens first
    n_tokens: int
    rows: Optional[np.ndarray]   # the state's logits rows [n_tokens, n_vocab], when it kept them all
    last_row: Optional[np.ndarray]  # the last position's logits, when the state kept them
    seed: int


def save(input_ids: np.ndarray, n: int, rows: Optional[np.ndarray], last_row: Optional[np.ndarray], seed: int,
         n_vocab: int) -> LlamaState:
    """The state of a Llama whose first n input_ids are evaluated. rows: their kept logits rows
    (None: not all kept); last_row: the last position's logits, so that sample() works right after
    load_state as in llama_cpp."""
    rows = rows.copy() if rows is not None else np.zeros((0, n_vocab), dtype=np.single)
    blob = STATE_MAGIC + np.asarray(input_ids[:n], dtype="<i4").tobytes()
    state = LlamaState(input_ids=input_ids.copy(), scores=rows, n_tokens=n, llama_state=blob,
                       llama_state_size=len(blob), seed=seed)
    state.river_last_logits = None if last_row is None else np.array(last_row, dtype=np.single)
    return state


def restore(state: LlamaState, n_ctx: int, n_vocab: int, check_tokens: Callable) -> Restored:
    """What `state` holds, checked against a Llama of n_ctx positions and n_vocab tokens
    (check_tokens: the Llama's check of token ids); ValueError for a state this module did not
    save, or one that does not fit."""
    blob = getattr(state, "llama_state", None)
    if not isinstance(blob, (bytes, bytearray)) or not bytes(blob).startswith(STATE_MAGIC):
        raise ValueError("this state was not saved by river_gguf.Llama.save_state (llama_cpp's states hold "
                         "llama.cpp KV bytes, which the river_gguf engine cannot load)")
    n = state.n_tokens
    if not is_int(n) or not 0 <= n <= n_ctx:
        raise ValueError(f"the state holds {n!r} tokens, which does not fit n_ctx={n_ctx}")
    tokens = np.frombuffer(bytes(blob)[len(STATE_MAGIC):], dtype="<i4")
    if len(tokens) != n:
        raise ValueError(f"corrupt state: {len(tokens)} stored tokens for n_tokens={n}")
    check_tokens(tokens)
    ids = np.zeros((n_ctx,), dtype=np.intc)
    src = np.asarray(state.input_ids, dtype=np.intc)
    m = min(len(src), n_ctx)
    ids[:m] = src[:m]
    ids[:n] = tokens
    rows = np.asarray(state.scores)
    keep = n > 0 and rows.ndim == 2 and rows.shape == (n, n_vocab)
    last = getattr(state, "river_last_logits", None)
    return Restored(ids, int(n), np.array(rows, dtype=np.single) if keep else None,
                    None if last is None else np.array(last, dtype=np.single), state.seed)
