"""Requests on N slots: each slot a model object with its own KV sequence and its own thread.

A slot's model must never run two requests interleaved (its KV sequence holds one prompt), but
calls on different slots may run at once, each on a one-thread executor of its own. A request
takes a free slot for the whole of its work: a plain request until its answer is computed; a
stream until its last chunk is sent, or until the client goes away. Among free slots it takes
the one whose last prompt shares the longest prefix with its own, as llama-server does, so the
slot's cache can keep that prefix; with none similar enough, the least recently used. When every
slot is busy, requests wait in arrival order, and a freed slot goes to the first of them.

A slot's thread also orders what is left of a cancelled request (closing its generator: one
token step at most) before anything the next request on that slot does.
"""
import asyncio
import functools
import itertools
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Awaitable, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from .. import session

_END = object()

#: A free slot is chosen by prefix when the longest common prefix of its last prompt and the new
#: one covers more than this fraction of the new prompt (llama-server's --slot-prompt-similarity
#: default); otherwise the least recently used free slot is taken.
PROMPT_SIMILARITY = 0.1


class ClientGone(Exception):
    """The client disconnected while its request waited in the queue: nothing was computed."""


def prompt_key(kwargs: Dict[str, Any]) -> Sequence:
    """What prefix reuse compares between requests: a completion's prompt (its text, or its token
    ids), or a chat's messages as one text. A key of one kind shares no prefix with the other."""
    if "messages" in kwargs:
        return "".join(f"\x00{m.get('role', '')}\x00{m.get('content', '')}" for m in kwargs["messages"])
    prompt = kwargs.get("prompt", "")
    return prompt if isinstance(prompt, str) else tuple(prompt)


def common_prefix(a: Sequence, b: Sequence) -> int:
    """How many leading items two prompt keys share; none between keys of different kinds (a
    prompt's text against another's token ids)."""
    return session.common_prefix(a, b) if type(a) is type(b) else 0


class Slot:
    """One slot: its model object, its thread, and what /slots reports of it."""

    def __init__(self, slot_id: int, model):
        self.id = slot_id
        self.model = model
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"river-gguf-slot{slot_id}")
        self.is_processing = False
        self.key: Sequence = ""       # the last prompt's key (prefix reuse)
        self.last_used = 0            # when it was last taken (least recently used)
        self.id_task: Optional[int] = None
        self.n_prompt_tokens: Optional[int] = None  # None until the model reports it
        self.n_decoded = 0

    async def run(self, fn: Callable, *args, **kwargs):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, functools.partial(fn, *args, **kwargs))

    def n_ctx(self) -> Optional[int]:
        n_ctx = getattr(self.model, "n_ctx", None)
        return n_ctx() if callable(n_ctx) else None

    def count_answer(self, answer: Any) -> None:
        """A plain request's counts, from its usage."""
        usage = answer.get("usage") if isinstance(answer, dict) else None
        if isinstance(usage, dict):
            self.n_prompt_tokens = usage.get("prompt_tokens", self.n_prompt_tokens)
            self.n_decoded = usage.get("completion_tokens", self.n_decoded)

    def count_chunk(self, first: bool) -> None:
        """A stream's counts after one chunk, on the slot's thread. A model that keeps llama_cpp's
        n_tokens (the tokens its cache holds: the prompt, then every decoded token but the
        newest) gives exact counts; for any other, each chunk counts as one token."""
        n_tokens = getattr(self.model, "n_tokens", None)
        if not isinstance(n_tokens, int):
            self.n_decoded += 1
            return
        if first:
            self.n_prompt_tokens = n_tokens
        self.n_decoded = n_tokens - (self.n_prompt_tokens or 0) + 1

    def to_json(self) -> Dict[str, Any]:
        """llama-server's /slots entry, as far as this server knows it."""
        out: Dict[str, Any] = {"id": self.id, "n_ctx": self.n_ctx(), "speculative": False,
                               "is_processing": self.is_processing}
        if self.id_task is not None:
            out["id_task"] = self.id_task
            out["n_prompt_tokens"] = self.n_prompt_tokens
            out["next_token"] = [{"has_next_token": self.is_processing, "n_decoded": self.n_decoded}]
        return out


class ModelWorker:
    """The slots and the queue of requests waiting for one."""

    def __init__(self, models: List[Any]):
        if not models:
            raise ValueError("a server needs at least one slot")
        self.slots = [Slot(i, m) for i, m in enumerate(models)]
        self._queue: deque = deque()  # (key, future) of each waiting request, first come first
        self._clock = itertools.count(1)
        self._task_ids = itertools.count()

    @property
    def waiting(self) -> int:
        """Requests waiting for a slot (for /health)."""
        return sum(1 for _, fut in self._queue if not fut.done())

    @property
    def slots_processing(self) -> int:
        return sum(s.is_processing for s in self.slots)

    @property
    def busy(self) -> bool:
        return self.slots_processing > 0

    def shutdown(self) -> None:
        """Drop the queued calls; the ones running finish."""
        for s in self.slots:
            s.executor.shutdown(wait=False, cancel_futures=True)

    def _pick(self, key: Sequence) -> Slot:
        free = [s for s in self.slots if not s.is_processing]
        best, best_share = None, PROMPT_SIMILARITY
        for s in free:
            share = common_prefix(s.key, key) / len(key) if len(key) else 0.0
            if share > best_share:
                best, best_share = s, share
        return best or min(free, key=lambda s: s.last_used)

    def _take(self, slot: Slot, key: Sequence) -> Slot:
        slot.is_processing = True
        slot.key = key
        slot.last_used = next(self._clock)
        slot.id_task = next(self._task_ids)
        slot.n_prompt_tokens, slot.n_decoded = None, 0
        return slot

    def _dispatch(self) -> None:
        """Give free slots to the waiting requests, first come first served (a waiter cancelled
        meanwhile has a done future and is passed over)."""
        while self._queue and not all(s.is_processing for s in self.slots):
            key, fut = self._queue.popleft()
            if not fut.done():
                fut.set_result(self._take(self._pick(key), key))

    def release(self, slot: Slot) -> None:
        """Free `slot` for the first request waiting, if any. Synchronous on purpose: it runs in
        finally blocks of cancelled tasks, where an await would be cancelled again."""
        slot.is_processing = False
        self._dispatch()

    async def _wait_for_slot(self, key: Sequence) -> Slot:
        fut = asyncio.get_running_loop().create_future()
        entry = (key, fut)
        self._queue.append(entry)
        self._dispatch()
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # given a slot just as it was cancelled
                self.release(fut.result())
            elif entry in self._queue:
                self._queue.remove(entry)
            raise

    async def acquire(self, key: Sequence, gone: Optional[Callable[[], Awaitable[bool]]]) -> Slot:
        slot = await self._wait_for_slot(key)
        # A client that gave up while queued costs nothing: skip its request.
        if gone is not None:
            try:
                left = await gone()
            except BaseException:
                self.release(slot)
                raise
            if left:
                self.release(slot)
                raise ClientGone()
        return slot

    async def call(self, method: str, kwargs: Dict[str, Any], gone=None) -> Any:
        """slot.model.<method>(**kwargs) on a free slot's thread, after every request queued
        before this one has a slot. gone: an async check of whether the client has disconnected
        (Request.is_disconnected)."""
        slot = await self.acquire(prompt_key(kwargs), gone)
        try:
            answer = await slot.run(getattr(slot.model, method), **kwargs)
            slot.count_answer(answer)
            return answer
        finally:
            self.release(slot)

    async def open_stream(self, method: str, kwargs: Dict[str, Any],
                          gone=None) -> Tuple["StreamLease", Dict[str, Any]]:
        """Start a streaming call and compute its first chunk, holding a slot from now until the
        lease is released. Computing the first chunk here lets an error in the request (which a
        lazy generator raises only when first advanced) still be answered with an HTTP error
        status instead of an event inside a 200 stream."""
        slot = await self.acquire(prompt_key(kwargs), gone)
        lease = StreamLease(self, slot)
        try:
            first = await slot.run(lease.start, getattr(slot.model, method), kwargs)
        except BaseException:
            lease.release()
            raise
        return lease, first


class StreamLease:
    """A slot, held by one stream until release() (idempotent; called when the stream ends,
    fails, or the client disconnects)."""

    def __init__(self, worker: ModelWorker, slot: Slot):
        self._worker = worker
        self.slot = slot
        self._it: Optional[Iterator[Dict[str, Any]]] = None
        self.released = False

    def start(self, fn: Callable, kwargs: Dict[str, Any]):  # runs on the slot's thread
        self._it = iter(fn(**kwargs))
        return self._next(first=True)

    def _next(self, first: bool = False):  # runs on the slot's thread
        chunk = next(self._it, _END)
        if chunk is not _END:
            self.slot.count_chunk(first)
        return chunk

    async def rest(self) -> AsyncIterator[Dict[str, Any]]:
        """The chunks after the first; releases the slot when done, even if cancelled."""
        try:
            while not self.released:
                chunk = await self.slot.run(self._next)
                if chunk is _END:
                    return
                yield chunk
        finally:
            self.release()

    def release(self) -> None:
        # Synchronous: see ModelWorker.release.
        if self.released:
            return
        self.released = True
        close = getattr(self._it, "close", None)
        if close is not None:
            # Queued on the slot's thread: the generator stops (no further tokens) before the
            # next request on this slot runs there.
            self.slot.executor.submit(close)
        self._worker.release(self.slot)

    @staticmethod
    def is_end(chunk) -> bool:
        return chunk is _END


def shutdown(worker: ModelWorker) -> None:
    """Drop queued work at server exit; calls already running finish (native code cannot be
    interrupted mid-step)."""
    worker.shutdown()
