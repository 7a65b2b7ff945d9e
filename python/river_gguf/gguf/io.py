"""Reading/writing GGUF files with the ``gguf`` package, plus llama.cpp quantization.

Everything that produces a file writes to a hidden temporary file in the destination
directory first and then ``os.replace``-s it, so a crash or a concurrent writer
never leaves a half-written file under the final name. The temp file is removed on every
exit Python sees; one left by a killed process is removed by the next writer of that name
(``remove_stale_temp_files``).
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import signal
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, List, Mapping, Optional

import gguf
import llama_cpp
import llama_cpp._logger as llama_logger
import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT
from tqdm import tqdm

from .reader import GGUFReader
from .writer import GGUFWriter

# llama.cpp's LLAMA_FTYPE_MOSTLY_F16; general.file_type for an F16 conversion.
_FILE_TYPE_MOSTLY_F16 = 1

# Quantization names accepted by quantize() -> llama_cpp LLAMA_FTYPE_* attribute.
FTYPES: dict[str, str] = {
    "f16": "LLAMA_FTYPE_MOSTLY_F16",
    "bf16": "LLAMA_FTYPE_MOSTLY_BF16",
    "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0",
    "q6_k": "LLAMA_FTYPE_MOSTLY_Q6_K",
    "q5_0": "LLAMA_FTYPE_MOSTLY_Q5_0",
    "q5_1": "LLAMA_FTYPE_MOSTLY_Q5_1",
    "q5_k_s": "LLAMA_FTYPE_MOSTLY_Q5_K_S",
    "q5_k_m": "LLAMA_FTYPE_MOSTLY_Q5_K_M",
    "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0",
    "q4_1": "LLAMA_FTYPE_MOSTLY_Q4_1",
    "q4_k_s": "LLAMA_FTYPE_MOSTLY_Q4_K_S",
    "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M",
    "q3_k_s": "LLAMA_FTYPE_MOSTLY_Q3_K_S",
    "q3_k_m": "LLAMA_FTYPE_MOSTLY_Q3_K_M",
    "q3_k_l": "LLAMA_FTYPE_MOSTLY_Q3_K_L",
    "q2_k": "LLAMA_FTYPE_MOSTLY_Q2_K",
}

# Integer tensors carry no weights to dequantize; write_f16() copies them as is.
_INT_TYPES = {QT.I8, QT.I16, QT.I32, QT.I64}


# ----- temp files next to outputs ------------------------------------------------------
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


def temp_files(folder, name: str | None = None) -> list:
    """(path, writer pids) of the temp files in ``folder`` of the final file ``name`` (or of any
    final file), whether their writers are alive or not; temps of temps count as their final
    file's."""
    try:
        entries = os.listdir(folder)
    except OSError:
        return []
    out = []
    for entry in sorted(entries):
        owner = _temp_owner(entry)
        if owner is not None and (name is None or owner[0] == name):
            out.append((os.path.join(folder, entry), owner[1]))
    return out


def stale_temp_files(folder, name: str | None = None) -> list:
    """Temp files in ``folder`` (of the final file ``name``, or of any) whose writers are gone."""
    out = []
    for path, pids in temp_files(folder, name):
        if os.name == "posix":
            # os.kill(pid, 0) is a liveness query only on POSIX (on Windows it would kill).
            stale = not any(_pid_alive(p) for p in pids)
        else:
            try:
                stale = time.time() - os.path.getmtime(path) > _STALE_AGE_S
            except OSError:
                continue
        if stale and os.path.isfile(path):
            out.append(path)
    return sorted(out)


def remove_own_temp_files(folder, name: str) -> list:
    """Remove the temp files in ``folder`` of the final file ``name`` that this process wrote
    (temps of temps included); return the paths removed. A writer's own cleanup of a temp file can
    itself be cut short by Ctrl-C (the KeyboardInterrupt raised between the check and the removal);
    a caller that wraps all its writers of ``name`` sweeps with this once it unwinds."""
    removed = []
    for path, pids in temp_files(folder, name):
        if os.getpid() in pids:
            try:
                os.unlink(path)
                removed.append(path)
            except FileNotFoundError:
                pass
    return removed


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


# ----- atomic output ---------------------------------------------------------------------
@contextlib.contextmanager
def atomic_output(dst_path: str | os.PathLike) -> Iterator[str]:
    """Yield a temp path next to ``dst_path``; move it into place only on success.

    The temp file is removed whatever ends the block (an error, KeyboardInterrupt, SystemExit);
    temp files of ``dst_path`` that killed writers left behind are removed first."""

    dst_path = os.fspath(dst_path)
    folder = os.path.dirname(os.path.abspath(dst_path))
    os.makedirs(folder, exist_ok=True)
    remove_stale_temp_files(folder, os.path.basename(dst_path))
    # A unique name per writer, not created here: the writer creates it with
    # normal umask permissions (mkstemp would leave the final file 0600).
    tmp = temp_name(dst_path)
    try:
        yield tmp
        os.replace(tmp, dst_path)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def check_output_path(dst_path: str | os.PathLike, inputs: Iterable[str | os.PathLike | None] = ()) -> str:
    """Refuse an output path that cannot work, before any work starts: a folder (or a name
    ending in a separator), something that is not a regular file, one of ``inputs``, or a path
    whose folder is missing (FileNotFoundError) or not writable (PermissionError). Writability is
    probed by creating and removing a hidden temp file, which also covers read-only file systems
    and ACLs that permission bits do not show. Returns the path as a string."""

    dst = os.fspath(dst_path)
    if not dst:
        raise ValueError("the output path is empty")
    if os.path.isdir(dst) or dst.endswith(os.sep) or (os.altsep and dst.endswith(os.altsep)):
        raise ValueError(f"output {dst} is a folder; give a file name")
    if os.path.lexists(dst) and not os.path.isfile(dst):
        raise ValueError(f"output {dst} exists and is not a regular file")
    for src in inputs:
        if src is not None and _same_file(dst, os.fspath(src)):
            raise ValueError(f"output {dst} would overwrite the input {os.fspath(src)}; choose another name")
    folder = os.path.dirname(os.path.abspath(dst))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"output folder does not exist: {folder}")
    probe = temp_name(dst, ".probe.tmp")
    # Ctrl-C is held while the probe exists: a KeyboardInterrupt between its creation and its
    # removal would leave it behind.
    with deferred_interrupts():
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as e:
            cls = PermissionError if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS) else OSError
            raise cls(f"cannot write to the output folder {folder} ({e.strerror})") from None
        try:
            os.close(fd)
        finally:
            os.unlink(probe)
    return dst


def _same_file(a: str, b: str) -> bool:
    if os.path.exists(a) and os.path.exists(b):
        return os.path.samefile(a, b)
    return os.path.realpath(a) == os.path.realpath(b)


# llama.cpp's quantizer, one line per tensor that has no block of its type's size:
# "warning: blk.0.attn_q.weight - ncols 576 not divisible by 256 (required for type q4_K) -> falling back to q5_0".
_FALLBACK = re.compile(r"warning: (\S+)\s+- ncols\s+(\d+) not divisible by\s+\d+ \(required for type\s+(\S+)\)"
                       r".*?-> falling back to\s+(\S+)")
_FALLBACK_TOTAL = re.compile(r"(\d+) of (\d+) tensor\(s\) required fallback quantization")


@dataclass
class LlamaLog:
    """What llama.cpp (libllama and ggml) logged while it was captured (captured_llama_log): kept
    rather than printed, so a conversion prints one line per step (quantize_summary) and
    `river-gguf convert -v` shows the lines themselves. `echo` receives each line as it comes."""
    lines: List[str] = field(default_factory=list)
    echo: Optional[Callable[[str], None]] = None
    _partial: str = ""

    def add(self, text: str) -> None:
        text = self._partial + text
        *done, self._partial = text.split("\n")
        for line in done:
            self.lines.append(line)
            if self.echo is not None:
                self.echo(line)

    def mark(self) -> int:
        """A position in the lines, for quantize_summary of what came after it."""
        return len(self.lines)

    def quantize_summary(self, since: int = 0) -> str:
        """One line of what the quantizer logged since `since`: how many tensors fell back to
        another type, by row width and type change ("180 of 272 tensors fell back: 576-wide rows,
        q4_K -> q5_0 150, q6_K -> q8_0 30"), or that none did."""
        lines = self.lines[since:]
        moves = Counter((int(m.group(2)), m.group(3), m.group(4)) for line in lines
                        for m in [_FALLBACK.search(line)] if m)
        total = next((m for line in lines for m in [_FALLBACK_TOTAL.search(line)] if m), None)
        if not moves:
            return "no tensor fell back to another type"
        n = sum(moves.values())
        widths = sorted({w for w, _, _ in moves})
        head = f"{n} of {total.group(2)} tensors" if total else f"{n} tensors"
        parts = ", ".join(f"{a} -> {b} {c}" for (_, a, b), c in sorted(moves.items(), key=lambda kv: -kv[1]))
        return f"{head} fell back: {'/'.join(map(str, widths))}-wide rows, {parts}"


_LOG_STACK: List[LlamaLog] = []  # the captures open, innermost last


@llama_cpp.llama_log_callback
def _collect(level, text, user_data):
    _LOG_STACK[-1].add(text.decode("utf-8", errors="replace"))


@contextlib.contextmanager
def captured_llama_log(log: LlamaLog) -> Iterator[LlamaLog]:
    """Send llama.cpp's log to `log` instead of stderr while the block runs (where captures nest,
    the innermost gets it), then hand it back to the capture around it, or to llama-cpp-python's
    own callback."""
    _LOG_STACK.append(log)
    if len(_LOG_STACK) == 1:
        llama_cpp.llama_log_set(_collect, ctypes.c_void_p(0))
    try:
        yield log
    finally:
        _LOG_STACK.pop()
        if not _LOG_STACK:
            llama_cpp.llama_log_set(llama_logger.llama_log_callback, ctypes.c_void_p(0))


@contextlib.contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Hold SIGINT (and SIGTERM, where Python handles it) during a native call that calls back into
    Python, and deliver it to the original handler once the call has returned.

    Why: llama.cpp's quantizer logs through a ctypes callback. Python runs signal handlers whenever
    it executes bytecode, so Ctrl-C during quantization raised KeyboardInterrupt inside that
    callback, where ctypes prints and drops it, and the conversion went on to exit 0. Here the
    handlers only record the signal while the call runs; the default handler then raises
    KeyboardInterrupt in the caller's frame, as if the signal had arrived just after the call.
    The native call itself cannot be stopped: it finishes its file first (seconds on small models).
    """
    if threading.current_thread() is not threading.main_thread():
        yield  # Python runs handlers on the main thread only: nothing can be swallowed here
        return
    pending: list[int] = []
    saved = {}

    def record(signum, _frame):
        if signum not in pending:
            pending.append(signum)

    for sig in (signal.SIGINT, getattr(signal, "SIGTERM", None)):
        if sig is None:
            continue
        handler = signal.getsignal(sig)
        if callable(handler):  # SIG_DFL / SIG_IGN act in C and never reach a callback
            saved[sig] = handler
            signal.signal(sig, record)
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        for sig in pending:
            saved[sig](sig, None)


def metadata_items(reader: gguf.GGUFReader, skip: Iterable[str] = ()) -> Iterator[tuple[str, Any, VT, VT | None]]:
    """Yield ``(key, value, type, array_sub_type)`` for each KV field of ``reader``.

    GGUF.* are header pseudo-fields of the reader and general.architecture is
    written by GGUFWriter's constructor, so both are left out.
    """
    skip = set(skip) | {"general.architecture"}
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in skip:
            continue
        vtype = field.types[0]
        if vtype != VT.ARRAY:
            yield key, field.contents(), vtype, None
            continue
        if len(field.types) > 2:
            raise NotImplementedError(f"nested arrays are not supported: {key}")
        value = field.contents()
        if value:  # GGUFWriter refuses empty arrays; an absent key means the same to llama.cpp
            # Keep the element type: the writer would otherwise guess it from the
            # Python values (every int -> INT32), losing e.g. UINT32 or INT64.
            yield key, value, vtype, field.types[-1]


def copy_metadata(reader: gguf.GGUFReader, writer: gguf.GGUFWriter, skip: Iterable[str] = ()) -> None:
    """Copy KV fields from ``reader`` to ``writer`` keeping their exact GGUF types."""
    for key, value, vtype, sub_type in metadata_items(reader, skip):
        writer.add_key_value(key, value, vtype, sub_type=sub_type)


def _f16_target(t: gguf.ReaderTensor) -> QT | None:
    """Type a tensor gets in the F16 file, or None to copy its bytes unchanged."""
    if t.tensor_type in _INT_TYPES:
        return None
    # 2-D+ weights become F16; 1-D tensors (norms, biases) stay F32 like llama.cpp does.
    return QT.F16 if len(t.shape) >= 2 else QT.F32


def write_f16(src_path: str | os.PathLike, dst_path: str | os.PathLike, progress: bool = True) -> str:
    """Write an F16 copy of a GGUF: dequantize 2-D weights to F16, keep 1-D as F32."""
    check_output_path(dst_path, inputs=[src_path])
    reader = GGUFReader(src_path)
    arch = reader.fields["general.architecture"].contents()

    with atomic_output(dst_path) as tmp, contextlib.closing(GGUFWriter(tmp, arch)) as writer:
        copy_metadata(reader, writer, skip={"general.file_type"})
        writer.add_file_type(_FILE_TYPE_MOSTLY_F16)

        # Declare all tensors first (the header needs their sizes), then stream the
        # data one tensor at a time so the dequantized model is never all in memory.
        plan = []
        for t in reader.tensors:
            np_shape = tuple(int(x) for x in reversed(t.shape))  # GGUF ne order is reversed
            target = _f16_target(t)
            if target is None:
                writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, raw_dtype=t.tensor_type)
            else:
                dt = np.dtype(np.float16 if target == QT.F16 else np.float32)
                writer.add_tensor_info(t.name, np_shape, dt, t.n_elements * dt.itemsize)
            plan.append((t, np_shape, target))

        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()

        desc = f"f16 {os.path.basename(os.fspath(dst_path))}"
        for t, np_shape, target in tqdm(plan, desc=desc, unit="tensor", disable=not progress):
            data = t.data
            if target is not None:
                data = gguf.quants.dequantize(t.data, t.tensor_type)
                if data.shape != np_shape:
                    raise ValueError(f"{t.name}: dequantized shape {data.shape} != expected {np_shape}")
                data = data.astype(np.float16 if target == QT.F16 else np.float32)
            writer.write_tensor_data(np.ascontiguousarray(data))
    return os.fspath(dst_path)


def _embedding_width(path) -> int:
    """Row length of the token embedding (= the head's rows): n_embd."""
    for t in GGUFReader(path).tensors:
        if t.name == "token_embd.weight":
            return int(t.shape[0])
    raise ValueError(f"{path} has no token_embd.weight")


#: The F32 rows llama.cpp's quantizer converts and holds at once (its max_buf_size; llama.cpp's own
#: default is 8 GiB): it quantizes a tensor slab by slab, so an 8B model's 2 GiB head costs this
#: much memory, not twice its F32 size. The bytes written do not depend on it (rows round alone).
QUANT_BUFFER_BYTES = 256 << 20


def quantize(src_path: str | os.PathLike, dst_path: str | os.PathLike, ftype: str, n_threads: int = 2,
             allow_requantize: bool = False, head_type: str | None = None,
             importance: Mapping[str, np.ndarray] | None = None) -> str:
    """Quantize ``src_path`` (normally an F16 GGUF) with llama.cpp's own quantizer.

    allow_requantize: accept an already quantized source (e.g. Q8_0).
    head_type: a GGML type name ("q4_0", "q8_0", ...) for the token embedding and output tensors
        (the head), instead of llama.cpp's choice for ``ftype``.
    importance: per weight (GGUF tensor name), the mean square of each input column, which
        llama-quantize --imatrix reads from an imatrix file (sum / count): ggml's
        importance-weighted rounding for those tensors. Note that llama.cpp's mix changes with it
        (for Q4_0 the first n_layer/8 ffn_down tensors become Q4_1), as with llama-quantize."""
    params = quantize_params(src_path, dst_path, ftype, n_threads)
    head = None
    if head_type is not None:
        try:
            head = QT[str(head_type).upper()]
        except KeyError:
            raise ValueError(f"unknown head type {head_type!r}") from None
        # llama.cpp falls back for its own choices but corrupts memory on a forced type whose
        # block does not divide the row (e.g. Q6_K on a 576-wide head): refuse it here.
        width = _embedding_width(src_path)
        block = gguf.GGML_QUANT_SIZES[head][0]
        if width % block:
            raise ValueError(f"head type {head.name} needs rows that are a multiple of {block}, "
                             f"but this model's rows have {width} values")
    params.allow_requantize = bool(allow_requantize)
    if head is not None:
        params.token_embedding_type = int(head)
        params.output_tensor_type = int(head)
    keep = _set_importance(params, importance) if importance is not None else []
    out = run_quantize(src_path, dst_path, ftype, params)
    del keep
    return out


def _set_importance(params, importance: Mapping[str, np.ndarray]) -> list:
    """Give llama.cpp's quantize params the importance vectors (its llama_model_imatrix_data list,
    ended by a null name); returns what llama.cpp reads through pointers, to keep alive until the
    quantizer returns."""
    if not len(importance):
        raise ValueError("importance must name at least one weight")
    entries = (llama_cpp.llama_model_imatrix_data * (len(importance) + 1))()
    keep: list = [entries]
    for i, name in enumerate(sorted(importance)):
        imp = np.ascontiguousarray(importance[name], dtype=np.float32).reshape(-1)
        cname = name.encode()
        keep += [imp, cname]
        entries[i].name = cname
        entries[i].data = imp.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        entries[i].size = imp.size
    params.imatrix = entries
    return keep


# llama.cpp's quantizer, one line per tensor ("[  12/ 272] blk.1.attn_q.weight - [  576,   576,     1,     1],
# type =    f16, size =    0.633 MiB ->    0.178 MiB (q4_0)" in a dry run; no "(type)" when it stays).
_TENSOR_LINE = re.compile(r"\[\s*\d+/\s*\d+\]\s+(\S+)\s+- \[[^\]]*\], type =\s*(\S+),.*?(?:\((\w+)\))?\s*$")


def planned_types(src_path: str | os.PathLike, ftype: str, n_threads: int = 2, allow_requantize: bool = False,
                  head_type: str | None = None, importance: bool = False) -> dict:
    """The ggml type llama.cpp's quantizer gives each tensor of ``src_path`` for ``ftype``,
    without quantizing or writing anything (its dry run): {name: type name ("Q4_K", "F32")}.
    importance: as with an importance matrix (llama.cpp's mix changes with one), given here as
    unit vectors, which the type choice does not read."""
    src_path = os.fspath(src_path)
    # No output path is checked or probed: a dry run writes nothing, and the input's folder may
    # be read-only (llama.cpp's dry run never opens the output name it is given).
    params = _default_params(src_path, ftype, n_threads)
    params.dry_run = True
    params.allow_requantize = bool(allow_requantize)
    if head_type is not None:
        params.token_embedding_type = params.output_tensor_type = int(QT[str(head_type).upper()])
    keep = (_set_importance(params, {t.name: np.ones(int(t.shape[0]), dtype=np.float32)
                                     for t in GGUFReader(src_path).tensors if len(t.shape) >= 2})
            if importance else [])
    log = LlamaLog()
    with captured_llama_log(log), deferred_interrupts():
        rc = llama_cpp.llama_model_quantize(os.fsencode(src_path), os.fsencode(src_path + ".dry-run"),
                                            ctypes.byref(params))
    del keep
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src_path} -> {ftype}, dry run) failed with code {rc}")
    out = {}
    for line in log.lines:
        m = _TENSOR_LINE.search(line)
        if m:
            out[m.group(1)] = (m.group(3) or m.group(2)).upper()
    if not out:
        raise RuntimeError(f"llama.cpp's dry run of {src_path} -> {ftype} listed no tensors")
    return out


def quantize_params(src_path, dst_path, ftype: str, n_threads: int):
    """llama.cpp's default quantize parameters for ``ftype``, after checking the inputs and the
    output path (before any work starts)."""
    params = _default_params(src_path, ftype, n_threads)
    check_output_path(dst_path, inputs=[src_path])
    return params


def _default_params(src_path, ftype: str, n_threads: int):
    """llama.cpp's default quantize parameters for ``ftype``, after checking the input."""
    key = ftype.lower()
    if key not in FTYPES:
        raise ValueError(f"unknown ftype {ftype!r}; valid: {', '.join(sorted(FTYPES))}")
    if not os.path.isfile(os.fspath(src_path)):
        raise FileNotFoundError(f"model file not found: {os.fspath(src_path)}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, FTYPES[key])
    params.nthread = n_threads
    params.max_buf_size = QUANT_BUFFER_BYTES
    return params


def run_quantize(src_path, dst_path, ftype: str, params) -> str:
    """Run ``llama_model_quantize`` into a temp file renamed to ``dst_path``; Ctrl-C is held until
    it returns (llama.cpp's ctypes log callback would drop it)."""

    # The quantizer logs every tensor: kept, not printed (into a capture the caller opened around
    # this call, as the converter does, or else one of its own that is dropped).
    quiet = contextlib.nullcontext() if _LOG_STACK else captured_llama_log(LlamaLog())
    with atomic_output(dst_path) as tmp, quiet:
        with deferred_interrupts():
            rc = llama_cpp.llama_model_quantize(
                os.fsencode(os.fspath(src_path)), os.fsencode(tmp), ctypes.byref(params)
            )
        if rc != 0:
            raise RuntimeError(f"llama_model_quantize({src_path!s} -> {ftype}) failed with code {rc}")
    return os.fspath(dst_path)
