"""One request at a time on the model, in arrival order.

A model owns one KV cache, so two requests must never run on it interleaved. The worker
holds an asyncio.Lock (first come, first served) for the whole of a request: a plain
request until its answer is computed; a stream until its last chunk is sent, or until the
client goes away. Every model call runs on one thread of its own (a single-thread
executor), which also orders what is left of a cancelled request (one token step at most)
before anything the next request does.
"""
import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Awaitable, Callable, Dict, Iterator, Optional, Tuple

_END = object()


class ClientGone(Exception):
    """The client disconnected while its request waited in the queue: nothing was computed."""


class ModelWorker:
    def __init__(self, model):
        self.model = model
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="river-gguf-model")
        self._lock = asyncio.Lock()
        self.waiting = 0  # requests queued behind the one running (for /health)

    @property
    def busy(self) -> bool:
        return self._lock.locked()

    def shutdown(self) -> None:
        """Drop the queued calls; the one running finishes."""
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def _in_thread(self, fn: Callable, *args, **kwargs):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    async def _acquire(self, gone: Optional[Callable[[], Awaitable[bool]]]) -> None:
        self.waiting += 1
        try:
            await self._lock.acquire()
        finally:
            self.waiting -= 1
        # A client that gave up while queued costs nothing: skip its request.
        if gone is not None:
            try:
                left = await gone()
            except BaseException:
                self._lock.release()
                raise
            if left:
                self._lock.release()
                raise ClientGone()

    async def call(self, fn: Callable, kwargs: Dict[str, Any], gone=None) -> Any:
        """fn(**kwargs) on the model thread, after every request queued before this one.
        gone: an async check of whether the client has disconnected (Request.is_disconnected)."""
        await self._acquire(gone)
        try:
            return await self._in_thread(fn, **kwargs)
        finally:
            self._lock.release()

    async def open_stream(self, fn: Callable, kwargs: Dict[str, Any],
                          gone=None) -> Tuple["StreamLease", Dict[str, Any]]:
        """Start a streaming call and compute its first chunk, holding the model from now until
        the lease is released. Computing the first chunk here lets an error in the request
        (which a lazy generator raises only when first advanced) still be answered with an
        HTTP error status instead of an event inside a 200 stream."""
        await self._acquire(gone)
        lease = StreamLease(self)
        try:
            first = await self._in_thread(lease.start, fn, kwargs)
        except BaseException:
            lease.release()
            raise
        return lease, first


class StreamLease:
    """The model, held by one stream until release() (idempotent; called when the stream ends,
    fails, or the client disconnects)."""

    def __init__(self, worker: ModelWorker):
        self._worker = worker
        self._it: Optional[Iterator[Dict[str, Any]]] = None
        self.released = False

    def start(self, fn: Callable, kwargs: Dict[str, Any]):  # runs on the model thread
        self._it = iter(fn(**kwargs))
        return next(self._it, _END)

    async def rest(self) -> AsyncIterator[Dict[str, Any]]:
        """The chunks after the first; releases the model when done, even if cancelled."""
        try:
            while not self.released:
                chunk = await self._worker._in_thread(next, self._it, _END)
                if chunk is _END:
                    return
                yield chunk
        finally:
            self.release()

    def release(self) -> None:
        # Synchronous on purpose: it runs in finally blocks of cancelled tasks, where an await
        # would be cancelled again.
        if self.released:
            return
        self.released = True
        close = getattr(self._it, "close", None)
        if close is not None:
            # Queued on the model thread: the generator stops (no further tokens) before the
            # next request's first call runs there.
            self._worker._executor.submit(close)
        self._worker._lock.release()

    @staticmethod
    def is_end(chunk) -> bool:
        return chunk is _END


def shutdown(worker: ModelWorker) -> None:
    """Drop queued work at server exit; a call already running finishes (native code cannot be
    interrupted mid-step)."""
    worker.shutdown()
