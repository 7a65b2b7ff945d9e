"""Streamed answers as server-sent events: `data: {chunk}` lines, then `data: [DONE]`."""
import json
import logging
from typing import Any, AsyncIterator, Callable, Dict

from sse_starlette.sse import EventSourceResponse

from .errors import from_model_error
from .worker import StreamLease

log = logging.getLogger("river_gguf.serve")

DONE = "[DONE]"


def encode(chunk: Dict[str, Any]) -> str:
    # allow_nan=False: a NaN would make the line invalid JSON for strict clients; callers pass
    # chunks through json_safe first.
    return json.dumps(chunk, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


async def events(lease: StreamLease, first: Dict[str, Any],
                 prepare: Callable[[Dict[str, Any]], Dict[str, Any]]) -> AsyncIterator[Dict[str, str]]:
    """SSE events of one stream. An error after the first chunk can no longer change the HTTP
    status; it is sent as an OpenAI error event (the openai client raises it) and ends the stream."""
    try:
        if not StreamLease.is_end(first):
            yield {"data": encode(prepare(first))}
        async for chunk in lease.rest():
            yield {"data": encode(prepare(chunk))}
    except Exception as e:  # noqa: BLE001 - reported to the client, then logged by from_model_error
        yield {"data": encode(from_model_error(e).body())}
        return
    finally:
        lease.release()
    yield {"data": DONE}


class LeasedEventSourceResponse(EventSourceResponse):
    """An EventSourceResponse that releases the model however it ends. If the client goes away
    before the event generator first runs, closing the generator runs none of its code; this
    finally still frees the model for the next request."""

    def __init__(self, lease: StreamLease, content, **kwargs):
        super().__init__(content, **kwargs)
        self._lease = lease

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._lease.release()


def stream_response(lease: StreamLease, first: Dict[str, Any],
                    prepare: Callable[[Dict[str, Any]], Dict[str, Any]]) -> LeasedEventSourceResponse:
    # sep="\n": the plain line ending OpenAI's own server uses.
    return LeasedEventSourceResponse(lease, events(lease, first, prepare), sep="\n")
