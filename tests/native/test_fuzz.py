"""The fuzz harness (issue 8): damaged copies of tiny GGUFs (truncations, byte flips, hyperparameter,
tensor type and layout sweeps, vocabulary damage, river tensor removal and mismatched rivers), each
loaded and run in a worker process. A crash, a hang, an exception river_gguf does not document, or
damage the loader must refuse that loads anyway fails the run.

RIVER_FUZZ_CASES=5000 (and RIVER_FUZZ_SEED) make a longer run; so does `python tools/fuzz_gguf.py`.
Each case is loaded through Model and through the drop-in river_gguf.Llama (RIVER_FUZZ_API=model
or llama: one of them only)."""
import os

import pytest

import fuzz_gguf as fuzz

# About 80 CPU seconds: 0.13 s per case, plus the base models. The cases run in PARTS parts, each
# a test of its own holding the whole run's checks on its own cases: the same cases as one run,
# checked more strictly. (scripts/test.sh gives the file to one worker, among the first.)
CI_CASES = 600
PARTS = 4


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A fuzz work folder with the base models built (run_fuzz reuses them)."""
    import json

    d = str(tmp_path_factory.mktemp("fuzz"))
    paths = fuzz.build_bases(os.path.join(d, "bases"))
    with open(os.path.join(d, "bases", "bases.json"), "w") as f:
        json.dump(paths, f)
    return d


@pytest.mark.parametrize("part", range(PARTS))
def test_malformed_files_end_in_documented_errors(workdir, part):
    n = int(os.environ.get("RIVER_FUZZ_CASES", CI_CASES))
    seed = int(os.environ.get("RIVER_FUZZ_SEED", 0))
    first, last = n * part // PARTS, n * (part + 1) // PARTS
    report = fuzz.run_fuzz(last, seed=seed, workdir=workdir, api=os.environ.get("RIVER_FUZZ_API", "both"),
                           first=first)
    print("\n" + report.summary())
    assert [r.index for r in report.results] == list(range(first, last))
    assert not report.failures, report.summary()
    # Every kind of damage, and both outcomes: refused files and files that run.
    m = last - first
    assert {r.kind for r in report.results} == {k for k, _ in fuzz.KINDS}
    outcomes = [r.outcome for r in report.results]
    assert outcomes.count("error") > m // 3 and outcomes.count("ran") > m // 10
    assert sum(r.outcome == "error" for r in report.results if _expects_error(seed, r.index, workdir)) > m // 10


_bases = {}


def _expects_error(seed, index, workdir):
    if workdir not in _bases:
        _bases[workdir] = fuzz.Bases(_paths(workdir))
    return fuzz.make_case(seed, index, _bases[workdir]).expect_error


def _paths(workdir):
    import json

    with open(os.path.join(workdir, "bases", "bases.json")) as f:
        return json.load(f)


def test_the_watchdog_reports_crashes_hangs_and_undocumented_exceptions(workdir, monkeypatch):
    # Cases rigged to abort, hang and raise a TypeError; the others are ordinary cases.
    monkeypatch.setenv("RIVER_FUZZ_RIG", "1:abort,3:hang,4:raise")
    report = fuzz.run_fuzz(6, seed=0, workdir=workdir, timeout=5)
    by = {r.index: r for r in report.results}
    assert by[1].outcome == "crash" and "SIGABRT" in by[1].detail
    assert by[3].outcome == "hang"
    assert by[4].outcome == "bad-exception" and "TypeError: rigged" in by[4].detail
    assert not any(by[i].failed for i in (0, 2, 5))
    assert report.workers == 3  # a fresh worker after the crash and after the hang, none otherwise


def test_cases_are_the_same_in_every_process(workdir):
    bases = fuzz.Bases(_paths(workdir))
    a = [fuzz.make_case(7, i, bases) for i in range(40)]
    b = [fuzz.make_case(7, i, bases) for i in range(40)]
    assert [c.desc for c in a] == [c.desc for c in b]
    assert a[5].build() == b[5].build()
    assert len({c.desc for c in a}) > 30


def test_gguf_rewriter_round_trips(workdir):
    for name, path in _paths(workdir).items():
        with open(path, "rb") as f:
            data = f.read()
        g = fuzz.Gguf.parse(data)
        assert g.to_bytes() == data, name
        h = g.clone()
        h.relayout({})
        assert h.to_bytes() == data, name
