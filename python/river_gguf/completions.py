"""OpenAI-style response dictionaries.

The shapes follow what ``llama_cpp.Llama.create_completion`` and
``create_chat_completion`` return, so code written against llama-cpp-python
can consume river_gguf output unchanged.  Optional engine statistics are
attached under the extra top-level key ``"river"``.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Callable, Dict, Iterable, Iterator, Optional, Union

__all__ = [
    "new_id",
    "now",
    "usage",
    "completion_response",
    "completion_chunk",
    "chat_response",
    "chat_chunk",
    "chat_role_chunk",
    "chat_content_chunk",
    "chat_final_chunk",
    "chat_chunks",
]


def new_id(prefix: str = "cmpl") -> str:
    """``new_id("cmpl") -> "cmpl-<uuid4>"``; ``new_id("chatcmpl") -> "chatcmpl-<uuid4>"``."""
    prefix = (prefix or "").rstrip("-")
    u = str(uuid.uuid4())
    return f"{prefix}-{u}" if prefix else u


def now() -> int:
    """Unix timestamp in whole seconds (the ``created`` field)."""
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> Dict[str, int]:
    prompt_tokens = int(prompt_tokens)
    completion_tokens = int(completion_tokens)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _with_extra(d: Dict[str, Any], extra: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    if extra:
        d["river"] = dict(extra)
    return d


# --------------------------------------------------------------- completions
def completion_response(
    id: str,
    created: int,
    model: str,
    text: str,
    finish_reason: Optional[str],
    prompt_tokens: int,
    completion_tokens: int,
    extra: Optional[Dict[str, Any]] = None,
) -> Dict[str, Any]:
    d = {
        "id": id,
        "object": "text_completion",
        "created": int(created),
        "model": model,
        "choices": [
            {
                "text": text,
                "index": 0,
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        ],
        "usage": usage(prompt_tokens, completion_tokens),
    }
    return _with_extra(d, extra)


def completion_chunk(
    id: str,
    created: int,
    model: str,
    text: str,
    finish_reason: Optional[str] = None,
    extra: Optional[Dict[str, Any]] = None,
) -> Dict[str, Any]:
    d = {
        "id": id,
        "object": "text_completion",
        "created": int(created),
        "model": model,
        "choices": [
            {
                "text": text,
                "index": 0,
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        ],
    }
    return _with_extra(d, extra)


# ---------------------------------------------------------------------- chat
def chat_response(
    id: str,
    created: int,
    model: str,
    content: str,
    finish_reason: Optional[str],
    prompt_tokens: int,
    completion_tokens: int,
    extra: Optional[Dict[str, Any]] = None,
) -> Dict[str, Any]:
    d = {
        "id": id,
        "object": "chat.completion",
        "created": int(created),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        ],
        "usage": usage(prompt_tokens, completion_tokens),
    }
    return _with_extra(d, extra)


def chat_chunk(
    id: str,
    created: int,
    model: str,
    delta: Dict[str, Any],
    finish_reason: Optional[str] = None,
    extra: Optional[Dict[str, Any]] = None,
) -> Dict[str, Any]:
    d = {
        "id": id,
        "model": model,
        "created": int(created),
        "object": "chat.completion.chunk",
        "choices": [
            {
                "index": 0,
                "delta": dict(delta),
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        ],
    }
    return _with_extra(d, extra)


def chat_role_chunk(id: str, created: int, model: str) -> Dict[str, Any]:
    """First streamed chunk: ``delta == {"role": "assistant"}``."""
    return chat_chunk(id, created, model, {"role": "assistant"})


def chat_content_chunk(id: str, created: int, model: str, content: str) -> Dict[str, Any]:
    """A streamed piece of text: ``delta == {"content": content}``."""
    return chat_chunk(id, created, model, {"content": content})


def chat_final_chunk(
    id: str,
    created: int,
    model: str,
    finish_reason: Optional[str],
    extra: Optional[Dict[str, Any]] = None,
) -> Dict[str, Any]:
    """Last streamed chunk: empty delta plus the finish reason."""
    return chat_chunk(id, created, model, {}, finish_reason, extra)


def chat_chunks(
    id: str,
    created: int,
    model: str,
    pieces: Iterable[str],
    finish_reason: Union[str, None, Callable[[], Optional[str]]] = "stop",
    extra: Union[Dict[str, Any], None, Callable[[], Optional[Dict[str, Any]]]] = None,
) -> Iterator[Dict[str, Any]]:
    """Wrap an iterable of text pieces into a full chat stream.

    Yields the role chunk, one content chunk per non-empty piece, then the
    final chunk.  ``finish_reason`` and ``extra`` may be zero-argument
    callables, evaluated after ``pieces`` is exhausted (the finish reason is
    usually only known at that point).
    """
    yield chat_role_chunk(id, created, model)
    for piece in pieces:
        if piece:
            yield chat_content_chunk(id, created, model, piece)
    fr = finish_reason() if callable(finish_reason) else finish_reason
    ex = extra() if callable(extra) else extra
    yield chat_final_chunk(id, created, model, fr, ex)
