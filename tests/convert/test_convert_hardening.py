"""The converter under interruption and bad output paths.

- Ctrl-C (SIGINT) or SIGTERM stops `river-gguf convert` / tools/add_river_gguf.py with exit status
  130 / 143 and leaves nothing behind, also while llama.cpp's quantizer runs (a KeyboardInterrupt
  raised inside its ctypes log callback would be dropped, and the conversion would finish with
  exit 0: gguf.io.deferred_interrupts holds the signal until the call returns).
- Temp files are removed on every exit Python sees; the hidden ones a SIGKILL leaves are harmless
  and removed by the next conversion to the same output and by the derived-file cache.
- The output path is checked before any work: a folder, an input, a missing or read-only folder.
- The output path only ever holds a complete file: presets are measured on the staged file.

Converter subprocesses run on tiny random models with one thread.
"""
from __future__ import annotations

import ctypes
import errno
import os
import pathlib
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time

import pytest


import river_gguf
from river_gguf import default_model
from river_gguf.gguf import io as gguf_io
from river_gguf.calibrate import preset_grid
from river_gguf.convert import build as convert
from river_gguf.convert.build import build_river_gguf
from river_gguf.gguf.io import deferred_interrupts
from river_gguf.eval.random_model import write_tiny_model

from support import REPO
from river_gguf.gguf.reader import GGUFReader

# The tests here send SIGINT, to themselves or to the converters they start, and assume Python's
# default handling of it: every test gets it, even where the suite runs with SIGINT ignored (a
# background job).
pytestmark = pytest.mark.usefixtures("default_sigint")

TOOL = REPO / "tools" / "add_river_gguf.py"
# The package under test (a checkout or an overlay may come before the installed one).
PKG_PARENT = str(pathlib.Path(river_gguf.__file__).resolve().parent.parent)
PKG_PARENT_UNRESOLVED = str(pathlib.Path(river_gguf.__file__).parent.parent)


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([PKG_PARENT_UNRESOLVED, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _files(folder) -> set:
    return {p.name for p in pathlib.Path(folder).iterdir()}


def _build_tiny(src, dst, **kw):
    kw.setdefault("threshold", 0.9)
    kw.setdefault("progress", False)
    kw.setdefault("imatrix", None)
    kw.setdefault("presets", False)
    kw.setdefault("n_threads", 1)
    kw.setdefault("backbone_type", None)  # as given, with the river these tests were written for
    kw.setdefault("river_type", "q4_0")
    return build_river_gguf(src, dst, **kw)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A small 4-layer F16 model: quick to convert."""
    d = tmp_path_factory.mktemp("tiny")
    return write_tiny_model(d / "bb.gguf", "llama", n_layer=4, dtype="f16")


@pytest.fixture(scope="module")
def slow_tiny(tmp_path_factory):
    """A 4-layer F16 model whose quantization to Q4_K_M takes a second or two on one thread (its
    49152 x 512 embedding and head dominate): long enough to interrupt it mid-way."""
    d = tmp_path_factory.mktemp("slow")
    return write_tiny_model(d / "bb.gguf", "llama", n_layer=4, n_embd=512, n_head=8, n_head_kv=4, n_ff=1024,
                            dtype="f16")


# ----- the mechanism: a signal during a native call that calls back into Python ----------------
_CMP = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int))


def _qsort_with_sigint(n: int = 2000) -> int:
    """Sort n ints with libc's qsort and a Python comparator (a ctypes callback, as llama.cpp's
    log callback is); SIGINT arrives during the first comparison. Returns the comparisons made."""
    libc = ctypes.CDLL(None)
    calls = [0]

    def cmp(a, b):
        calls[0] += 1
        if calls[0] == 1:
            os.kill(os.getpid(), signal.SIGINT)
        return a[0] - b[0]

    arr = (ctypes.c_int * n)(*range(n, 0, -1))
    libc.qsort(arr, n, ctypes.sizeof(ctypes.c_int), _CMP(cmp))
    return calls[0]


@pytest.fixture
def dropped(monkeypatch):
    """Exceptions that ctypes drops ("Exception ignored on calling ctypes callback function")."""
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.exc_type))
    return seen


def test_sigint_in_a_ctypes_callback_is_lost_without_deferral(dropped):
    # The finding, reproduced: the KeyboardInterrupt is raised inside the callback, where ctypes
    # drops it, and the native call runs on to the end; nothing reaches the caller.
    calls = _qsort_with_sigint()
    assert calls > 1000
    assert dropped == [KeyboardInterrupt]


def test_deferred_interrupts_redelivers_after_the_native_call(dropped):
    done = []
    with pytest.raises(KeyboardInterrupt):
        with deferred_interrupts():
            calls = _qsort_with_sigint()
            done.append(calls)
    assert done and done[0] > 1000  # the sort finished, then the interrupt was raised here
    assert dropped == []
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handler restored


def test_deferred_interrupts_calls_the_callers_own_handler():
    seen = []
    old = signal.signal(signal.SIGINT, lambda s, f: seen.append(s))
    try:
        with deferred_interrupts():
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):  # give the handler a chance to run (it only records)
                pass
            assert seen == []
        assert seen == [signal.SIGINT]
    finally:
        signal.signal(signal.SIGINT, old)


def test_deferred_interrupts_without_a_signal_changes_nothing():
    with deferred_interrupts():
        x = sum(range(100))
    assert x == 4950 and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    errors = []

    def worker():  # off the main thread it is a no-op (handlers cannot be installed there)
        try:
            with deferred_interrupts():
                pass
        except Exception as e:  # pragma: no cover - the failure being tested for
            errors.append(e)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert errors == []


@pytest.fixture
def sigint_from_llama_log(monkeypatch):
    """libllama's log callback sends SIGINT at its first message (as a Ctrl-C during a load would
    arrive), then llama-cpp-python's own callback is put back."""
    import llama_cpp
    import llama_cpp._logger as llama_logger

    calls = [0]

    @llama_cpp.llama_log_callback
    def cb(level, text, user_data):
        calls[0] += 1
        if calls[0] == 1:
            os.kill(os.getpid(), signal.SIGINT)

    llama_cpp.llama_log_set(cb, ctypes.c_void_p(0))
    yield calls
    llama_cpp.llama_log_set(llama_logger.llama_log_callback, ctypes.c_void_p(0))


def test_sigint_during_a_model_load_reaches_the_caller(tiny, sigint_from_llama_log, dropped):
    # Model holds Ctrl-C while the native load runs (libllama logs through the ctypes callback
    # that would drop it) and delivers it when the load returns.
    from river_gguf import Model

    with pytest.raises(KeyboardInterrupt):
        Model(tiny, n_ctx=16, n_threads=1)
    assert sigint_from_llama_log[0] > 1 and dropped == []


def test_converter_model_loads_keep_the_interrupt(tiny, sigint_from_llama_log, dropped):
    with pytest.raises(KeyboardInterrupt):
        convert._open_model(tiny, n_ctx=16, n_threads=1)
    assert sigint_from_llama_log[0] > 1 and dropped == []


def test_converter_vocabulary_loads_keep_the_interrupt(tiny, sigint_from_llama_log, dropped):
    # The draft ranking's vocabulary (a conversion without the calibration pass loads it): a
    # Ctrl-C there was dropped, and the conversion went on to write its output.
    with pytest.raises(KeyboardInterrupt):
        convert.draft_token_ranking(tiny, texts=["a b c"])
    assert sigint_from_llama_log[0] > 1 and dropped == []



def test_dry_run_vocabulary_load_keeps_the_interrupt(tiny, dropped, monkeypatch):
    # The dry run's vocabulary loads inside its own capture of llama.cpp's log: SIGINT arrives
    # with the capture's first line.
    from river_gguf.convert.dry_run import _Tokenizer

    real, lines = gguf_io.LlamaLog.add, []

    def add(self, text):
        lines.append(text)
        if len(lines) == 1:
            os.kill(os.getpid(), signal.SIGINT)
        return real(self, text)

    monkeypatch.setattr(gguf_io.LlamaLog, "add", add)
    with pytest.raises(KeyboardInterrupt):
        _Tokenizer(tiny)
    assert len(lines) > 1 and dropped == []


# ----- Ctrl-C / SIGTERM on the converter process --------------------------------------------------
def _temps(folder, name="out.gguf"):
    """Hidden temp files of the output ``name``, temps of temps included."""
    return [p for p in pathlib.Path(folder).iterdir()
            if p.name.startswith(".") and p.name.lstrip(".").startswith(f"{name}.") and p.name.endswith(".tmp")]


def _quantizing(folder) -> bool:
    """llama.cpp's quantizer is writing the river: the temp file of the river's temp file exists
    (the river's own temp name appears only once the quantizer is done)."""
    return any(".river.tmp." in p.name for p in _temps(folder))


def _start(cmd, folder):
    return subprocess.Popen(cmd, cwd=folder, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _wait_for(proc, pred, timeout=120.0):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if pred():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.005)
    return False


def _convert_cmd(tool: bool, src, out, *extra):
    head = [sys.executable, str(TOOL)] if tool else [sys.executable, "-m", "river_gguf.cli", "convert"]
    return head + [str(src), "-o", str(out), "-t", "1", "-q", "--threshold", "0.9", *extra]


def _signal_while_quantizing(proc, folder, sig):
    """Send `sig` to the converter once it is quantizing into `folder`; its (stdout, stderr)."""
    try:
        assert _wait_for(proc, lambda: _quantizing(folder)), proc.communicate()
        proc.send_signal(sig)
        return proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("tool,sig,code", [(False, signal.SIGINT, 130), (True, signal.SIGINT, 130),
                                           (False, signal.SIGTERM, 143)])
def test_signal_during_quantization_stops_and_leaves_nothing(slow_tiny, tmp_path, tool, sig, code):
    out = tmp_path / "out.gguf"
    before = _files(tmp_path)
    proc = _start(_convert_cmd(tool, slow_tiny, out, "--river-type", "q4_k_m", "--imatrix", "none",
                               "--no-presets"), tmp_path)
    stdout, stderr = _signal_while_quantizing(proc, tmp_path, sig)
    assert proc.returncode == code, (stdout, stderr)
    assert "wrote" not in stdout
    if sig == signal.SIGINT:
        assert "interrupted" in stderr and "Traceback" not in stderr, stderr
    assert _files(tmp_path) == before  # no output, no temp files


def test_converter_started_with_sigint_ignored_keeps_it_ignored(slow_tiny, tmp_path):
    # Started from a background job (SIGINT ignored, as a shell without job control starts one),
    # the converter leaves SIGINT ignored: a SIGINT during quantization changes nothing and the
    # conversion completes, with nothing left beside its output. SIGTERM still stops it cleanly.
    out = tmp_path / "out.gguf"
    cmd = _convert_cmd(False, slow_tiny, out, "--river-type", "q4_k_m", "--imatrix", "none", "--no-presets")
    ignore = lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)  # noqa: E731 (in the child, before exec)
    for sig, code in ((signal.SIGINT, 0), (signal.SIGTERM, 143)):
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, preexec_fn=ignore)
        stdout, stderr = _signal_while_quantizing(proc, tmp_path, sig)
        assert proc.returncode == code, (stdout, stderr)
        assert "Traceback" not in stderr, stderr
        if code == 0:
            assert f"wrote {out}" in stdout and _files(tmp_path) == {"out.gguf"}
            assert GGUFReader(out).fields["river.type"].contents() == "q4_k_m"
            out.unlink()
        else:
            assert _files(tmp_path) == set()


def _holds_reference_rows(pid: int) -> bool:
    """The calibration pass has begun: the process holds the presets' reference rows, an unlinked
    temp file (it leaves nothing behind however the process ends)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if ".river-reference-" in os.readlink(f"/proc/{pid}/fd/{fd}"):
                return True
        except OSError:
            pass
    return False


_PHASES = {
    # the calibration pass (the importance matrix, the reference rows) is running
    "imatrix": lambda proc, folder: _holds_reference_rows(proc.pid),
    # the stored backbone is quantized (its temp file got its name) and the reference rows are
    # still open: the presets are being measured (the rows are closed before the output is written)
    "presets": lambda proc, folder: any(re.fullmatch(r"\.out\.gguf\.\d+\.[0-9a-f]{8}\.backbone-q\.tmp", p.name)
                                        for p in _temps(folder)) and _holds_reference_rows(proc.pid),
}


@pytest.mark.parametrize("phase", sorted(_PHASES))
def test_sigint_during_imatrix_or_presets_leaves_nothing(tiny, tmp_path, phase):
    out = tmp_path / "out.gguf"
    before = _files(tmp_path)
    proc = _start(_convert_cmd(False, tiny, out, "--river-type", "q4_0"), tmp_path)  # imatrix and presets on
    try:
        assert _wait_for(proc, lambda: _PHASES[phase](proc, tmp_path)), proc.communicate()
        t_signal = time.monotonic()
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
        t_end = time.monotonic() - t_signal
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, (f"exited {t_end:.2f} s after the signal", stdout, stderr)
    assert "interrupted" in stderr and "Traceback" not in stderr, stderr
    assert _files(tmp_path) == before


def test_sigkill_leftovers_are_harmless_and_removed_by_the_next_conversion(slow_tiny, tmp_path):
    out = tmp_path / "out.gguf"
    proc = _start(_convert_cmd(False, slow_tiny, out, "--river-type", "q4_k_m", "--imatrix", "none",
                               "--no-presets"), tmp_path)
    try:
        assert _wait_for(proc, lambda: _quantizing(tmp_path)), proc.communicate()
        proc.kill()  # SIGKILL: nothing can clean up
    finally:
        proc.wait()
    left = _temps(tmp_path)
    assert left and not out.exists()  # hidden leftovers only, never a file under the output's name
    _build_tiny(slow_tiny, out, river_type="q4_0")
    assert _files(tmp_path) == {"out.gguf"}


# ----- temp files: every exit path, and stale ones --------------------------------------------------
@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
def test_temp_files_removed_on_every_exit(tiny, tmp_path, monkeypatch, exc):
    def boom(*a, **k):  # after the river and the backbone are quantized
        raise exc("stop")

    monkeypatch.setattr(preset_grid, "calibrate_presets", boom)
    with pytest.raises(exc):
        _build_tiny(tiny, tmp_path / "out.gguf", presets=True)
    assert _files(tmp_path) == set()


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_stale_temp_files_of_dead_writers_only(tmp_path):
    dead = _dead_pid()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        names = {
            f".out.gguf.{dead}.0123abcd.river.tmp": True,          # converter intermediate
            f".out.gguf.{dead}.0123abcd.tmp": True,                # staged output
            f"..out.gguf.{dead}.0123abcd.tmp.{dead}.89abcdef.tmp": True,  # its metadata rewrite
            f"out.gguf.{dead}.0123abcd.tmp": True,                 # older versions' naming
            f".out.gguf.{live.pid}.0123abcd.river.tmp": False,     # a conversion still running
            f".other.gguf.{dead}.0123abcd.tmp": False,             # another output's
            "notes.tmp": False,                                    # not ours at all
            "out.gguf": False,
        }
        for n in names:
            (tmp_path / n).write_bytes(b"x")
        stale = {pathlib.Path(p).name for p in gguf_io.stale_temp_files(tmp_path, "out.gguf")}
        assert stale == {n for n, s in names.items() if s}
        removed = gguf_io.remove_stale_temp_files(tmp_path, "out.gguf")
        assert {pathlib.Path(p).name for p in removed} == stale
        assert _files(tmp_path) == {n for n, s in names.items() if not s}
        # Without a name: every output's stale temp files (what the cache does).
        gguf_io.remove_stale_temp_files(tmp_path)
        assert _files(tmp_path) == {f".out.gguf.{live.pid}.0123abcd.river.tmp", "notes.tmp", "out.gguf"}
    finally:
        live.kill()
        live.wait()


def test_derived_file_cache_ignores_and_removes_stale_temp_files(tiny, tmp_path, monkeypatch):
    # A converter killed while writing into the cache left a hidden temp file there; the cache
    # neither takes it for a file nor keeps it (this broke test_derived_model_is_cached).
    monkeypatch.setenv("RIVER_GGUF_CACHE", str(tmp_path))
    stale = tmp_path / f".SmolLM2.x.f16+q4_0.river.gguf.{_dead_pid()}.0123abcd.river.tmp"
    stale.write_bytes(b"partial")
    built = default_model.build_derived(tiny, "tiny", "f16", lambda: None)
    assert not stale.exists()
    mtime = os.stat(built).st_mtime_ns
    stale.write_bytes(b"partial")
    assert default_model.build_derived(tiny, "tiny", "f16", lambda: None) == built  # cached
    assert os.stat(built).st_mtime_ns == mtime
    assert not list(tmp_path.glob("*.tmp"))


def _reference_fds(folder) -> list:
    """This process's descriptors of reference-row files (unlinked temp files) in ``folder``."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(os.path.join(str(folder), ".river-reference-")):
            out.append(target)
    return out


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_calibration_pass_closes_its_reference_file_when_it_fails(tiny, tmp_path, monkeypatch, exc):
    # The pass fails after it opened its reference rows' file (here: in the items' selection);
    # no caller holds the pass yet, so the pass closes the file itself, even while the
    # exception's traceback (and the frames it holds) lives on.
    def fail(*a, **k):
        assert len(_reference_fds(tmp_path)) == 1  # opened before the failure
        raise exc("selection failed")

    monkeypatch.setattr(convert, "calibration_selection", fail)
    with pytest.raises(exc) as info:
        convert._CalibrationPass(str(tiny), str(tmp_path), 1, False, lambda line: None, imatrix=True,
                                 threshold=True, presets=True, calibration_tokens=64, reference="F16")
    assert info.traceback and _reference_fds(tmp_path) == []


# ----- the output path, checked before any work ---------------------------------------------------
@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if the converter starts any work (the engine's vetting of the backbone is
    its first step)."""
    def fail(*a, **k):
        raise AssertionError("work started before the output path was checked")

    monkeypatch.setattr(convert, "check_loadable", fail)


def test_folder_as_output_refused_up_front(tiny, tmp_path, no_work):
    folder = tmp_path / "a_folder"
    folder.mkdir()
    with pytest.raises(ValueError, match=f"{folder}.*is a folder"):
        _build_tiny(tiny, folder)
    with pytest.raises(ValueError, match="is a folder"):
        _build_tiny(tiny, str(tmp_path / "new_name") + os.sep)
    assert _files(tmp_path) == {"a_folder"} and _files(folder) == set()


def test_input_as_output_refused_up_front(tiny, tmp_path, no_work):
    with pytest.raises(ValueError, match="would overwrite the input"):
        _build_tiny(tiny, tiny)
    link = tmp_path / "link.gguf"
    link.symlink_to(tiny)
    with pytest.raises(ValueError, match="would overwrite the input"):
        _build_tiny(tiny, link)
    imx = tmp_path / "imx.gguf"
    imx.write_bytes(b"")
    with pytest.raises(ValueError, match="would overwrite the input"):
        _build_tiny(tiny, imx, imatrix=str(imx))


def test_missing_output_folder_and_special_files_refused_up_front(tiny, tmp_path, no_work):
    with pytest.raises(FileNotFoundError, match=f"output folder does not exist: {tmp_path / 'nope'}"):
        _build_tiny(tiny, tmp_path / "nope" / "out.gguf")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="not a regular file"):
        _build_tiny(tiny, fifo)
    assert _files(tmp_path) == {"fifo"}


def test_output_checks_in_the_cli(tiny, tmp_path, capsys):
    from river_gguf import cli

    (tmp_path / "d").mkdir()
    rc = cli.main(["convert", str(tiny), "-o", str(tmp_path / "d"), "-q", "--threshold", "0.9"])
    assert rc == 2 and "is a folder" in capsys.readouterr().err
    assert _files(tmp_path / "d") == set()


def test_output_checked_before_the_default_backbone_is_made(tmp_path, capsys, monkeypatch):
    from river_gguf import cli

    def fail(kind):
        raise AssertionError("the default backbone was made before the output was checked")

    monkeypatch.setattr(default_model, "derived_model", fail)
    rc = cli.main(["convert", "-o", str(tmp_path), "-q"])  # no BACKBONE: the default model's F16
    assert rc == 2 and "is a folder" in capsys.readouterr().err


def _readonly_run(fn) -> tuple:
    """Run ``fn()`` where the file system's permission bits apply: in this process, or, as root
    (who may write anywhere), in a forked child that drops to the nobody user. Returns
    (exception type name or None, message)."""
    if os.geteuid() != 0:
        try:
            fn()
        except Exception as e:
            return type(e).__name__, str(e)
        return None, ""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: no pytest machinery from here on, only os._exit
        try:
            os.close(r)
            os.setgid(65534)
            os.setuid(65534)
            try:
                fn()
                msg = "None\n"
            except BaseException as e:
                msg = f"{type(e).__name__}\n{e}"
            os.write(w, msg.encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        data = f.read()
    os.waitpid(pid, 0)
    name, _, msg = data.partition("\n")
    return (None if name == "None" else name), msg


def test_read_only_output_folder_refused_up_front():
    # Inputs where the nobody user can read them (pytest's tmp folders are private to root).
    base = pathlib.Path(tempfile.mkdtemp(prefix="river-ro-"))
    try:
        base.chmod(0o755)
        src = write_tiny_model(base / "bb.gguf", "llama", n_layer=2, dtype="f16")
        os.chmod(src, 0o644)
        ro = base / "ro"
        ro.mkdir()
        ro.chmod(stat.S_IRUSR | stat.S_IXUSR | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)
        name, msg = _readonly_run(lambda: _build_tiny(src, ro / "out.gguf"))
        assert name == "PermissionError", msg
        assert f"cannot write to the output folder {ro}" in msg and "llama_model_quantize" not in msg
        assert _files(ro) == set()
        # The quantizer's own entry points check too.
        name, msg = _readonly_run(lambda: gguf_io.quantize(src, ro / "q.gguf", "q8_0", n_threads=1))
        assert name == "PermissionError" and str(ro) in msg, msg
    finally:
        (base / "ro").chmod(0o755)
        shutil.rmtree(base, ignore_errors=True)


def test_dry_run_on_a_read_only_input_folder(tmp_path):
    # The dry run writes nothing beside the input: it works where the input's folder refuses
    # writes (to the nobody user, which the child checks first), the output going elsewhere.
    base = pathlib.Path(tempfile.mkdtemp(prefix="river-ro-"))
    try:
        base.chmod(0o755)
        ro, out = base / "ro", base / "out"
        ro.mkdir()
        out.mkdir()
        out.chmod(0o777)
        src = write_tiny_model(ro / "bb.gguf", "llama", n_layer=2, dtype="f16")
        os.chmod(src, 0o644)
        from river_gguf import cli

        args = ["convert", str(src), "-o", str(out / "out.gguf"), "--dry-run", "-t", "1"]
        # Once here first, while the folder is writable, so that everything the dry run imports is
        # imported before the child runs as nobody, who cannot read root's Python installation.
        assert cli.main(args) == 0
        ro.chmod(0o555)
        before = _files(ro)

        def dry_run():
            try:
                open(ro / "probe", "wb").close()
            except PermissionError:
                pass
            else:
                raise AssertionError(f"{ro} accepts writes: the test would show nothing")
            rc = cli.main(args)
            if rc != 0:
                raise RuntimeError(f"the dry run exited with {rc}")

        name, msg = _readonly_run(dry_run)
        assert name is None, msg
        assert _files(ro) == before and _files(out) == set()
    finally:
        (base / "ro").chmod(0o755)
        shutil.rmtree(base, ignore_errors=True)


class _Usage:
    def __init__(self, free):
        self.total, self.used, self.free = free, 0, free


def test_free_space_checked_before_any_work_reference_rows_included(slow_tiny, tmp_path, monkeypatch):
    # The output's file system holds, at once, the river and the quantized backbone with the
    # presets' reference rows (larger than the output here: a 49,152-token vocabulary), then with
    # the output. Too little room is refused before the pass over the input starts.
    def no_pass(*a, **k):
        raise AssertionError("the pass over the input started")

    plan = convert.disk_plan(str(slow_tiny), convert.open_reader(str(slow_tiny)), "q4_0", "q8_0", None, False, True,
                             convert.DEFAULT_CALIBRATION_TOKENS, 1)
    assert plan["reference"] > plan["output"] > 0 and plan["river"] > 0 and plan["backbone"] > 0
    assert plan["need"] == plan["river"] + plan["backbone"] + plan["reference"]
    monkeypatch.setattr(convert, "_CalibrationPass", no_pass)
    for free in (plan["need"] - 1, plan["river"] + plan["backbone"] + plan["output"]):  # enough but for the rows
        monkeypatch.setattr(convert.shutil, "disk_usage", lambda p, free=free: _Usage(free))
        with pytest.raises(OSError, match="not enough free space.*reference rows") as e:
            _build_tiny(slow_tiny, tmp_path / "out.gguf", presets=True, threshold=None, backbone_type="q8_0")
        assert e.value.errno == errno.ENOSPC
    monkeypatch.setattr(convert.shutil, "disk_usage", lambda p: _Usage(plan["need"]))
    with pytest.raises(AssertionError, match="the pass over the input started"):  # the check passed
        _build_tiny(slow_tiny, tmp_path / "out.gguf", presets=True, threshold=None, backbone_type="q8_0")
    assert _files(tmp_path) == set()


def test_check_output_path_leaves_no_probe(tmp_path):
    assert gguf_io.check_output_path(tmp_path / "x.gguf") == str(tmp_path / "x.gguf")
    assert _files(tmp_path) == set()


def test_ctrl_c_while_the_probe_exists_leaves_no_probe(tmp_path, monkeypatch):
    # SIGINT lands while the probe file exists (sent from its os.close): the interrupt comes
    # through once the probe is gone.
    real_close, sent = os.close, []

    def close(fd):
        if not sent and any(n.endswith(".probe.tmp") for n in os.listdir(tmp_path)):
            sent.append(fd)
            os.kill(os.getpid(), signal.SIGINT)
        return real_close(fd)

    monkeypatch.setattr(os, "close", close)
    with pytest.raises(KeyboardInterrupt):
        gguf_io.check_output_path(tmp_path / "x.gguf")
        for _ in range(1000):  # where the interrupt would land without the hold, at the latest
            pass
    assert sent and _files(tmp_path) == set()


def test_ctrl_c_inside_a_temp_files_removal_leaves_nothing(tiny, tmp_path, monkeypatch):
    # A Ctrl-C that lands in the middle of the removal of an intermediate file (after its check,
    # before its unlink), as the conversion finishes: the converter sweeps its temp files as the
    # interrupt unwinds.
    real, hit = os.path.lexists, []

    def lexists(p):
        if not hit and os.fspath(p).endswith(".river.tmp") and real(p):
            hit.append(p)
            raise KeyboardInterrupt
        return real(p)

    monkeypatch.setattr(os.path, "lexists", lexists)
    with pytest.raises(KeyboardInterrupt):
        _build_tiny(tiny, tmp_path / "out.gguf")
    assert hit and _files(tmp_path) == set()


# ----- presets (and --calibrate) are measured before the output gets its name ---------------------
def test_presets_measured_on_the_parts_before_the_output_is_written(tiny, tmp_path, monkeypatch):
    out = tmp_path / "out.gguf"
    seen = []

    def fake_presets(model, **kw):
        seen.append((model.model_path, model.river_path))
        assert not out.exists()  # the output's name holds nothing until the file is complete
        assert not any(p.name.endswith(".tmp") and ".backbone-q." not in p.name and ".river." not in p.name
                       for p in _temps(tmp_path))  # nor is it staged: it is written once, presets included
        return {"presets": {}, "rows": [], "anchors": {}, "n_tokens": 0, "reference": "F16"}

    monkeypatch.setattr(preset_grid, "calibrate_presets", fake_presets)
    finals = []
    meta = _build_tiny(tiny, out, presets=True, finalize=lambda p: finals.append(p) or {"x": 1})
    assert len(seen) == 1 and len(finals) == 1
    backbone, river = seen[0]
    assert backbone == str(tiny)  # stored as given (a quantized backbone would be a temp file like the river's)
    name = os.path.basename(river)  # the river's temp file, next to the output
    assert os.path.dirname(river) == str(tmp_path) and name.startswith(".out.gguf.") and name.endswith(".tmp")
    assert meta["river.presets"] == "{}" and meta["x"] == 1
    r = GGUFReader(out)
    assert r.fields["river.presets"].contents() == "{}"
    assert _files(tmp_path) == {"out.gguf"}
