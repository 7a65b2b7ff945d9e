"""The cache of files the tests build (support.BuildCache, conftest.py's fixtures): built once and
reused by a second run or another worker, built again when the converter's sources change."""
import multiprocessing
import os
import pathlib
import shutil

import river_gguf

from support import BuildCache, package_digest


def _write(path, text="x"):
    pathlib.Path(path).write_text(text)


def test_a_file_is_built_once_and_reused(tmp_path):
    calls = []
    cache = BuildCache(tmp_path)

    def make(out):
        calls.append(out)
        _write(out)

    a = cache.get("thing", make, {"n": 1}, "sources-1")
    assert cache.get("thing", make, {"n": 1}, "sources-1") == a and len(calls) == 1
    # A second run: a new cache over the same folder reuses the file.
    again = BuildCache(tmp_path)
    assert again.get("thing", make, {"n": 1}, "sources-1") == a and len(calls) == 1 and again.built == []
    # Other options are another file, beside it.
    b = cache.get("thing", make, {"n": 2}, "sources-1")
    assert b != a and os.path.isfile(a) and len(calls) == 2


def test_changed_sources_rebuild_and_remove_the_old_file(tmp_path):
    cache = BuildCache(tmp_path)
    a = cache.get("thing", lambda out: _write(out, "old"), {"n": 1}, "sources-1")
    b = cache.get("thing", lambda out: _write(out, "new"), {"n": 1}, "sources-2")
    assert a != b and not os.path.exists(a) and pathlib.Path(b).read_text() == "new"


def test_a_failed_build_leaves_nothing(tmp_path):
    cache = BuildCache(tmp_path)

    def fail(out):
        _write(out, "half")
        raise RuntimeError("killed")

    try:
        cache.get("thing", fail, {}, "s")
    except RuntimeError:
        pass
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


def _build_in_a_process(root, log):
    def make(out):
        with open(log, "a") as f:
            f.write("built\n")
        _write(out)

    BuildCache(root).get("shared", make, {}, "s")


def test_two_processes_build_a_file_once(tmp_path):
    log = tmp_path / "log"
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_build_in_a_process, args=(tmp_path / "cache", log)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert log.read_text() == "built\n"


def test_a_change_to_the_converter_changes_the_digest(tmp_path):
    pkg = tmp_path / "river_gguf"
    shutil.copytree(pathlib.Path(river_gguf.__file__).parent, pkg,
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    before = package_digest(str(pkg))
    assert package_digest(str(pkg)) == before
    with open(pkg / "convert" / "build.py", "a") as f:
        f.write("\n# a change\n")
    package_digest.cache_clear()
    assert package_digest(str(pkg)) != before


def test_the_suites_river_is_named_by_the_installed_package(river_gguf_path):
    # conftest.py's River GGUF is built for these sources: a changed converter means another name.
    assert os.path.basename(river_gguf_path).split(".")[-2] == BuildCache.digest(package_digest())
