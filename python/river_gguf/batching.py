"""Decode steps of several sessions evaluated together: the step batcher of a Model.

Each Session on a Model's KV cache decodes its own sequence. When several of them run their
decode loops at once (one thread each, as a server's slots do), a decode step reads the weights
once for the whole batch instead of once per session, so the batcher joins their single-token
steps: a session that has its next token ready submits it (`step`) and waits, and when every
session in a decode loop (a member: `join` .. `leave`) has submitted, or `window` seconds passed
since this session submitted, one thread evaluates the pending steps in one batch and hands each
session its own row. A session joins the running batch when it starts decoding and leaves when
its loop ends, so continuous batching needs nothing more.

The evaluation itself (which tokens, which rows go to whom, what each session records) is the
caller's `evaluate(requests)`, run under the Model's lock; the batcher only decides when a batch
runs and who runs it. A thread that holds the Model's lock across its decode loop (a measurement
that must not be displaced) evaluates its steps alone and at once: no other thread could run a
batch meanwhile, and no other session's step may displace it.
"""
import threading
import time
from typing import Callable, List, Optional

#: How long a thread that would lead a batch waits for the Model's lock before it looks again:
#: another thread may hold it for a prefill (it comes back soon) or be a member waiting for its
#: own step (it then leads the batch itself, and this thread's request goes with it).
_LOCK_WAIT_S = 0.002


class ModelLock:
    """A Model's lock: reentrant, as threading.RLock, and able to tell whether the calling thread
    holds it (`held_here`), which the batcher asks before it waits for other threads."""

    def __init__(self):
        self._lock = threading.RLock()
        self._owner: Optional[int] = None
        self._depth = 0

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if not self._lock.acquire(blocking, timeout):
            return False
        self._owner = threading.get_ident()
        self._depth += 1
        return True

    def release(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._owner = None
        self._lock.release()

    def held_here(self) -> bool:
        """Whether the calling thread holds the lock."""
        return self._owner == threading.get_ident()

    def __enter__(self) -> "ModelLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class StepRequest:
    """One session's decode step: its token and exit options, and, once the batch ran, the
    outcome `evaluate` set (`rows`, or `error` to raise in that session's thread)."""
    __slots__ = ("session", "token", "options", "rows", "error", "done")

    def __init__(self, session, token: int, options):
        self.session = session
        self.token = token
        self.options = options
        self.rows = None
        self.error: Optional[BaseException] = None
        self.done = False

    def outcome(self):
        if self.error is not None:
            raise self.error
        return self.rows


class StepBatcher:
    """Joins the decode steps of the sessions on one Model (see the module docstring).
    lock: the Model's lock (a ModelLock); evaluate(requests): runs one batch under it, setting each request's
    rows or error; window: the longest a submitted step waits for the other members."""

    def __init__(self, lock, evaluate: Callable[[List[StepRequest]], None], window: float = 0.005):
        self._lock = lock
        self._evaluate = evaluate
        self.window = float(window)
        self._cond = threading.Condition(threading.Lock())
        self._members = {}  # session -> how many of its decode loops are running
        self._pending: List[StepRequest] = []
        self._running = False
        self._batches = 0   # batches evaluated, and the steps they held
        self._steps = 0

    def join(self, session) -> None:
        """`session` runs a decode loop: the steps of the others wait for its step too."""
        with self._cond:
            self._members[session] = self._members.get(session, 0) + 1

    def leave(self, session, every_loop: bool = False) -> None:
        """`session`'s decode loop ended (stopped, raised or closed; every_loop: the session
        closed, whatever loops of it are left unfinished): nobody waits for it."""
        with self._cond:
            left = 0 if every_loop else self._members.get(session, 0) - 1
            if left > 0:
                self._members[session] = left
            else:
                self._members.pop(session, None)
            self._cond.notify_all()

    @property
    def counts(self) -> dict:
        """Batches evaluated since the batcher was made ("batches"), the steps they held
        ("steps": more than batches when sessions shared a batch), and the sessions in a
        decode loop now ("members")."""
        with self._cond:
            return {"batches": self._batches, "steps": self._steps, "members": len(self._members)}

    def step(self, session, token: int, options):
        """Evaluate `token` after `session`'s tokens, in a batch with the other members' steps;
        returns what evaluate set as its rows, or raises its error."""
        req = StepRequest(session, token, options)
        if self._lock.held_here():
            with self._cond:
                self._batches += 1
                self._steps += 1
            self._evaluate([req])
            return req.outcome()
        with self._cond:
            self._pending.append(req)
            self._cond.notify_all()  # a waiter may now find every member ready
        deadline = time.monotonic() + self.window
        try:
            while True:
                if self._wait_turn(req, deadline):
                    return req.outcome()
                if not self._lock.acquire(timeout=_LOCK_WAIT_S):
                    continue
                try:
                    self._lead(req)
                finally:
                    self._lock.release()
        except BaseException:
            # Interrupted while waiting: no later batch evaluates a step nobody waits for.
            with self._cond:
                if req in self._pending:
                    self._pending.remove(req)
            raise

    def _wait_turn(self, req: StepRequest, deadline: float) -> bool:
        """Wait until `req` is done (True) or this thread may lead a batch (False): no batch is
        running and every member has a step pending, or the window has passed."""
        with self._cond:
            while not req.done:
                now = time.monotonic()
                if not self._running and (self._all_ready() or now >= deadline):
                    return False
                self._cond.wait(None if self._running else deadline - now)
            return True

    def _all_ready(self) -> bool:
        """Whether every member has a step pending (or cannot share the next batch anyway: a
        session on a sequence that another pending step goes to)."""
        waiting = {r.session for r in self._pending}
        seqs = {r.session.seq for r in self._pending}
        return bool(waiting) and all(s in waiting or s.seq in seqs for s in self._members)

    def _lead(self, req: StepRequest) -> None:
        """With the Model's lock held: take a batch of the pending steps and evaluate it."""
        with self._cond:
            if req.done or self._running or not self._pending:
                return
            batch = self._take()
            self._running = True
            self._batches += 1
            self._steps += len(batch)
        try:
            self._evaluate(batch)
        except BaseException as e:  # a failure of the batch is each of its steps' to raise
            for r in batch:
                if r.rows is None and r.error is None:
                    r.error = e
            if req not in batch and not isinstance(e, Exception):
                raise  # an interrupt of this thread, which no request of its own will raise
        finally:
            with self._cond:
                for r in batch:
                    if r.rows is None and r.error is None:
                        r.error = RuntimeError("the batch holding this decode step did not evaluate it")
                    r.done = True
                self._running = False
                self._cond.notify_all()

    def _take(self) -> List[StepRequest]:
        """The pending steps that can share one batch: the first one's exit options, one step per
        sequence (two sessions on one sequence displace each other: they take turns)."""
        first = self._pending[0]
        batch, seqs, rest = [], set(), []
        for r in self._pending:
            if r.options == first.options and r.session.seq not in seqs:
                batch.append(r)
                seqs.add(r.session.seq)
            else:
                rest.append(r)
        self._pending = rest
        return batch
