"""Helpers for streaming generated text.

* :class:`Utf8Decoder` turns token byte pieces (which may split a multibyte
  character) into text, replacing invalid sequences with U+FFFD.
* :class:`StopStringFilter` holds back text that might be the beginning of a
  stop string and stops at the first complete one.

Invariant: ``"".join(emitted pieces) + flush()`` equals the full text cut at
the earliest occurrence of any stop string (or the full text if none occurs),
however the text is split into pushes.
"""

from __future__ import annotations

import codecs
from typing import Iterable, List, Optional, Tuple, Union

__all__ = ["StopStringFilter", "Utf8Decoder", "truncate_at_stop"]


def truncate_at_stop(text: str, stop: Union[str, Iterable[str], None]) -> Tuple[str, bool]:
    """Non-streaming reference: cut ``text`` at the earliest stop string."""
    stops = StopStringFilter._normalise(stop)
    best = -1
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best < 0 or i < best):
            best = i
    if best < 0:
        return text, False
    return text[:best], True


class StopStringFilter:
    """Incremental stop-string matcher for streamed text."""

    def __init__(self, stop: Union[str, Iterable[str], None] = None) -> None:
        self.stops: List[str] = self._normalise(stop)
        self._max_len = max((len(s) for s in self.stops), default=0)
        self._buf = ""
        self.stopped = False
        #: The stop string that matched (None until one does).
        self.matched: Optional[str] = None

    @staticmethod
    def _normalise(stop) -> List[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        out = []
        for s in stop:
            if not isinstance(s, str):
                raise ValueError(f"stop strings must be str, got {type(s).__name__}")
            if s and s not in out:
                out.append(s)
        return out

    def _held_len(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop."""
        upper = min(len(buf), self._max_len - 1)
        for n in range(upper, 0, -1):
            tail = buf[-n:]
            for s in self.stops:
                if len(s) > n and s.startswith(tail):
                    return n
        return 0

    def push(self, text: str) -> Tuple[str, bool]:
        """Feed more text; return ``(text safe to emit, stopped)``."""
        if self.stopped:
            return "", True
        if not self.stops:
            return text, False
        buf = self._buf + text
        best = -1
        matched = None
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (best < 0 or i < best or (i == best and len(s) < len(matched))):
                best = i
                matched = s
        # Earliest position from which the rest of the buffer could still grow
        # into a (longer) stop string.  A complete match only wins if nothing
        # could start before it.
        held = self._held_len(buf)
        partial_at = len(buf) - held if held else -1
        if best >= 0 and (partial_at < 0 or best <= partial_at):
            self._buf = ""
            self.stopped = True
            self.matched = matched
            return buf[:best], True
        if held:
            self._buf = buf[-held:]
            return buf[:-held], False
        self._buf = ""
        return buf, False

    def flush(self) -> str:
        """Return text still held back (call once generation has ended).

        If that text contains a stop string it is cut there and ``stopped``
        becomes True.
        """
        if self.stopped:
            self._buf = ""
            return ""
        buf, self._buf = self._buf, ""
        # The held text may already contain a complete (shorter) stop string
        # that was waiting on a longer one starting earlier.
        best = -1
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (best < 0 or i < best):
                best, self.matched = i, s
        if best >= 0:
            self.stopped = True
            return buf[:best]
        return buf

    @property
    def pending(self) -> str:
        """Text currently held back as a possible stop-string prefix."""
        return self._buf


class Utf8Decoder:
    """Incremental UTF-8 decoder (``errors="replace"``) for token byte pieces."""

    def __init__(self) -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, b: bytes) -> str:
        return self._dec.decode(bytes(b), final=False)

    def flush(self) -> str:
        out = self._dec.decode(b"", final=True)
        self._dec.reset()
        return out

    def reset(self) -> None:
        self._dec.reset()
