"""A text completion as llama_cpp builds it from sampled tokens: the chunks a stream sends (never
the start of a stop string, never half a UTF-8 character), the whole completion's dict, and
log-probabilities in llama_cpp's types.

Llama.create_completion runs the tokens (its generate loop on the Session) and hands each one to a
Completion; this module only turns tokens into text and dicts.
"""
from typing import Callable, Dict, Iterator, List, Optional, Sequence

import numpy as np
from llama_cpp.llama import Llama as _LlamaCpp

from .llama_sampling import top_logprobs_order

Detokenize = Callable[[List[int]], bytes]


def utf8_wait(text: bytes, current: int) -> int:
    """How many more tokens llama_cpp waits before it looks at text that ends inside a UTF-8
    sequence: for each of the last three bytes, counted 3, 2, 1 from the end, a lead byte of an
    n-byte sequence closer to the end than n sets the wait to n minus that count."""
    for i, byte in enumerate(text[-3:]):
        dist = 3 - i
        for need, lead in ((2, 0xC0), (3, 0xE0), (4, 0xF0)):
            if need > dist and byte & lead == lead:
                current = need - dist
    return current


def cut_at_stop(text: bytes, stops: Sequence[bytes]) -> Optional[bytes]:
    """The text before the first of `stops` (in their order, as llama_cpp checks them) that it
    contains, or None."""
    hit = next((s for s in stops if s in text), None)
    return None if hit is None else text[: text.index(hit)]


def held_back(text: bytes, stops: Sequence[bytes]) -> int:
    """How many bytes at the end of `text` could begin a stop string: a stream holds them."""
    hold = 0
    for s in stops:
        for i in range(min(len(s), len(text)), 0, -1):
            if text.endswith(s[:i]):
                hold = max(hold, i)
                break
    return hold


def logprob_entry(detok: Detokenize, row: np.ndarray, token: int, n: int, stream: bool) -> tuple:
    """(log p(token), top-n dict) from one logits row, as llama_cpp computes them, in its types:
    Python floats in a stream's chunks, numpy float32 in a whole completion."""
    lp = _LlamaCpp.logits_to_logprobs(row)
    value = float if stream else np.float32
    top = {}
    for i in top_logprobs_order(lp, n):
        top[detok([int(i)]).decode("utf-8", errors="ignore")] = value(lp[i])
    return value(lp[token]), top


class Completion:
    """One completion's tokens and what a stream has sent of them.

    detok: token ids to bytes; row(i): the logits row that follows prompt position i (the rows of
    the prompt's last token and of every completion token, for logprobs); prompt: the prompt as
    given (its length offsets the text); logprobs: how many top entries (None: none)."""

    def __init__(self, cid: str, created: int, model: str, detok: Detokenize, row: Callable[[int], np.ndarray],
                 prompt, prompt_tokens: List[int], bos_id: int, stops: Sequence[str], logprobs: Optional[int]):
        self.cid, self.created, self.model = cid, created, model
        self.detok, self.row = detok, row
        self.prompt, self.prompt_tokens, self.bos_id = prompt, prompt_tokens, bos_id
        self.stops = [s.encode("utf-8") for s in stops]
        self.logprobs = logprobs
        self.tokens: List[int] = [] if len(prompt) > 0 else [bos_id]
        self.returned = 0  # tokens a stream has sent

    def chunk(self, text: str, lp, finish) -> dict:
        return {"id": self.cid, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [{"text": text, "index": 0, "logprobs": lp, "finish_reason": finish}]}

    def _stream_logprobs(self, tok: int) -> tuple:
        """(the token's text, its logprobs object) for a stream's chunk of the next token to send."""
        detok = self.detok
        token_str = detok([tok]).decode("utf-8", errors="ignore")
        lp, top = logprob_entry(detok, self.row(len(self.prompt_tokens) + self.returned - 1), tok, self.logprobs,
                                stream=True)
        top[token_str] = lp
        return token_str, lp, top

    def ready(self) -> Iterator[dict]:
        """A stream's chunks of what can be sent now: what cannot be the start of a stop string
        (the rest is held back), token by token with logprobs, else in pieces that decode."""
        detok = self.detok
        pending = self.tokens[self.returned:]
        sendable = len(detok(pending)) - held_back(detok(pending), self.stops)
        end = 0
        if self.logprobs is not None:
            for tok in pending:
                if tok == self.bos_id:
                    continue
                end += len(detok([tok]))
                if end > sendable:
                    break
                offset = len(self.prompt) + len(detok(self.tokens[:self.returned]).decode("utf-8", errors="ignore"))
                token_str, lp, top = self._stream_logprobs(tok)
                self.returned += 1
                yield self.chunk(token_str, {"tokens": [token_str], "text_offset": [offset], "token_logprobs": [lp],
                                             "top_logprobs": [top]}, None)
            return
        while pending:
            for i in range(1, len(pending) + 1):
                piece = detok(pending[:i])
                try:
                    piece_text = piece.decode("utf-8")
                    break
                except UnicodeError:
                    pass
            else:
                return  # no prefix of the pending tokens decodes yet
            end += len(piece)
            if end > sendable:
                return
            pending = pending[i:]
            self.returned += i
            yield self.chunk(piece_text, None, None)

    def rest(self, finish_reason: str) -> Iterator[dict]:
        """A stream's last chunks: every token not yet sent, up to a stop string, then the finish."""
        detok = self.detok
        pending = self.tokens[self.returned:]
        pending_text = detok(pending)
        found = [s for s in self.stops if s in pending_text]
        stop_at = min(pending_text.index(s) for s in found) if found else len(pending_text)
        end = 0
        for tok in pending:
            end += len(detok([tok]))
            lp_obj = None
            if self.logprobs is not None:
                if tok == self.bos_id:
                    continue
                offset = len(self.prompt) + len(detok(self.tokens[:self.returned]))  # bytes, as llama_cpp
                token_str, lp, top = self._stream_logprobs(tok)
                lp_obj = {"tokens": [token_str], "text_offset": [offset], "token_logprobs": [lp],
                          "top_logprobs": [top]}
            if end >= stop_at:
                last = detok([tok])
                self.returned += 1
                yield self.chunk(last[: len(last) - (end - stop_at)].decode("utf-8", errors="ignore"), lp_obj, None)
                break
            self.returned += 1
            yield self.chunk(detok([tok]).decode("utf-8", errors="ignore"), lp_obj, None)
        yield self.chunk("", None, finish_reason)

    def whole(self, text: bytes, finish_reason: str, echo: bool, append: Optional[str], n_rows: int) -> dict:
        """The completion dict: the text (after the prompt with echo, the suffix appended when the
        vocabulary has no FIM tokens), logprobs from the kept rows (n_rows: positions evaluated),
        and the usage counts."""
        detok = self.detok
        text_str = text.decode("utf-8", errors="ignore")
        if echo:
            prompt = self.prompt
            text_str = (prompt if isinstance(prompt, str) else detok(prompt).decode("utf-8", errors="ignore")) + text_str
        if append is not None:
            text_str += append
        lp_obj = None if self.logprobs is None else self._whole_logprobs(echo, n_rows)
        n_prompt, n_completion = len(self.prompt_tokens), len(self.tokens)
        return {
            "id": self.cid,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [{"text": text_str, "index": 0, "logprobs": lp_obj, "finish_reason": finish_reason}],
            "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_completion,
                      "total_tokens": n_prompt + n_completion},
        }

    def _whole_logprobs(self, echo: bool, n_rows: int) -> Dict[str, list]:
        detok = self.detok
        if echo:
            skip = 1 if self.prompt_tokens[0] == self.bos_id else 0
            all_tokens = self.prompt_tokens[skip:] + self.tokens
            base_offset, first_row = 0, 0
        else:
            all_tokens = self.tokens
            base_offset, first_row = len(self.prompt), len(self.prompt_tokens) - 1
        offsets, token_lps, strs, tops = [], [], [], []
        for idx, (tok, pos) in enumerate(zip(all_tokens, range(first_row, n_rows))):
            if tok == self.bos_id:
                continue
            token_str = detok([tok]).decode("utf-8", errors="ignore")
            offsets.append(base_offset + len(detok(all_tokens[:idx]).decode("utf-8", errors="ignore")))
            strs.append(token_str)
            lp, top = logprob_entry(detok, self.row(pos), tok, self.logprobs, stream=False)
            token_lps.append(lp)
            top[token_str] = lp
            tops.append(top)
        if echo and all_tokens:
            # OpenAI's API gives no log-probability for the first token.
            token_lps[0] = None
            tops[0] = None
        return {"tokens": strs, "text_offset": offsets, "token_logprobs": token_lps, "top_logprobs": tops}


def stop_list(stop) -> List[str]:
    """A call's stop argument as a list of strings (None: none)."""
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop):
        return list(stop)
    raise ValueError(f"stop must be a str or a list of str, got {stop!r}")
