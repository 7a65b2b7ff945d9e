"""Temp files next to outputs: how every writer of this package names its temp file, and how the
ones killed writers left behind are found and removed."""
from __future__ import annotations

import os
import re
import time
import uuid

# Every writer of this package writes "<folder>/.<name>.<pid>.<8 hex digits><suffix>.tmp" and
# renames it to "<folder>/<name>" only when complete, and removes it on every exit Python sees
# (errors, KeyboardInterrupt, SystemExit). A process killed outright (SIGKILL, power loss) cannot
# clean up: its hidden temp file stays behind, harmless (no reader looks at it), until the next
# writer of the same name, or any use of the cache, removes the temp files of dead processes.
_TEMP_RE = re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)\.[0-9a-f]{8}[\w.-]*\.tmp$")
# Earlier versions named the temp file "<name>.<pid>.<8 hex>.tmp" (not hidden).
_LEGACY_TEMP_RE = re.compile(r"^(?P<name>.+)\.(?P<pid>\d+)\.[0-9a-f]{8}\.tmp$")
# Where a process id cannot be checked (not POSIX), a temp file this old counts as abandoned.
_STALE_AGE_S = 24 * 3600


def temp_name(dst, suffix: str = ".tmp") -> str:
    """A private temp file name next to ``dst`` (same folder, so a rename moves it into place):
    ``.<name>.<pid>.<random><suffix>``; ``suffix`` must end in ".tmp"."""
    if not suffix.endswith(".tmp"):
        raise ValueError(f"temp suffix must end in .tmp, got {suffix!r}")
    folder, name = os.path.split(os.path.abspath(os.fspath(dst)))
    return os.path.join(folder, f".{name}.{os.getpid()}.{uuid.uuid4().hex[:8]}{suffix}")


def _temp_owner(filename: str):
    """(final name, writer pids) of a temp file name, or None if ``filename`` is no temp file.
    A temp of a temp (e.g. a metadata rewrite of a staged output) unwraps to the final name."""
    pids = []
    m = _TEMP_RE.match(filename) or _LEGACY_TEMP_RE.match(filename)
    while m:
        pids.append(int(m.group("pid")))
        filename = m.group("name")
        m = _TEMP_RE.match(filename)
    return (filename, pids) if pids else None


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True  # our own: another thread may be writing it
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except (OverflowError, ValueError):
        return False  # not a possible process id
    except OSError:
        return True  # e.g. EPERM: it exists, owned by someone else
    return True


def stale_temp_files(folder, name: str | None = None) -> list:
    """Temp files in ``folder`` (of the final file ``name``, or of any) whose writers are gone."""
    try:
        entries = os.listdir(folder)
    except OSError:
        return []
    out = []
    for entry in entries:
        owner = _temp_owner(entry)
        if owner is None or (name is not None and owner[0] != name):
            continue
        path = os.path.join(folder, entry)
        if os.name == "posix":
            # os.kill(pid, 0) is a liveness query only on POSIX (on Windows it would kill).
            stale = not any(_pid_alive(p) for p in owner[1])
        else:
            try:
                stale = time.time() - os.path.getmtime(path) > _STALE_AGE_S
            except OSError:
                continue
        if stale and os.path.isfile(path):
            out.append(path)
    return sorted(out)


def remove_stale_temp_files(folder, name: str | None = None) -> list:
    """Remove what ``stale_temp_files`` finds; return the paths removed. Never raises: a file
    another cleaner removed first, or one this user may not remove, is left to others."""
    removed = []
    for path in stale_temp_files(folder, name):
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass
    return removed
