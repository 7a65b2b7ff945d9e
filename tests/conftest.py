"""Fixtures the whole suite shares: the default model and the files derived from it, the random
tiny models and their River GGUFs, each built once and kept between runs (support.BuildCache),
and the oracle: stock llama.cpp through llama-cpp-python. Each folder's conftest.py holds what
only that folder shares."""
import json
import os
import pathlib
import resource
import signal
import sys

import pytest

# In pytest-xdist's workers (one a core), every OpenMP team is one thread: ggml-cpu computes with
# as many threads as OpenMP gives it, so an engine or a llama.cpp reference asked for 2 threads
# computes with 1 instead of spinning against the other worker. Set before llama_cpp (and
# numpy's OpenBLAS) load; scripts/test.sh sets them in the environment too.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_THREAD_LIMIT", "1")
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

# The repository's tools (tools/fuzz_gguf.py, ...) are scripts, not part of the package.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tools"))

import llama_cpp  # noqa: E402,F401

from river_gguf.default_model import default_model_path, derived_model  # noqa: E402
from river_gguf.eval.random_model import write_tiny_model  # noqa: E402

from support import THREADS, BuildCache, oracles, package_digest  # noqa: E402


#: CPU seconds of each test file whose tests take 3 s or more in all (measured on 2026-12-06: one
#: pytest-xdist worker, one thread, its fixtures built once, the cache of built files warm;
#: scripts/test.sh runs with --dist loadfile). A file not listed counts DEFAULT_TEST_SECONDS a test.
#: `RIVER_TEST_SECONDS=PATH pytest -n 1 ...` writes each test's CPU seconds to PATH (JSON lines,
#: `cpu_seconds`), to be summed by file here.
FILE_SECONDS = {
    "tests/native/test_fuzz.py": 82,
    "tests/calibrate/test_calibrate_and_quick_eval.py": 79,
    "tests/native/test_architectures.py": 58,
    "tests/test_lossless.py": 49,
    "tests/native/test_flash_attn.py": 49,
    "tests/native/test_river.py": 44,
    "tests/calibrate/test_presets.py": 42,
    "tests/convert/test_convert_hardening.py": 38,
    "tests/measure/test_divergence.py": 37,
    "tests/eval/test_evaluate.py": 36,
    "tests/convert/test_imatrix.py": 31,
    "tests/serve/test_server.py": 30,
    "tests/test_llama.py": 27,
    "tests/convert/test_convert.py": 26,
    "tests/native/test_engine_parity.py": 21,
    "tests/test_llama_chat_format.py": 19,
    "tests/test_lossless_partings.py": 18,
    "tests/test_lossless_distribution.py": 17,
    "tests/native/test_exit_decision.py": 16,
    "tests/scripts/test_gpu_bundle.py": 16,
    "tests/native/test_river_attention.py": 16,
    "tests/test_rpc.py": 15,
    "tests/convert/test_dry_run.py": 15,
    "tests/gguf/test_gguf_tools.py": 13,
    "tests/test_generation.py": 11,
    "tests/test_draft_vocab.py": 10,
    "tests/native/test_sequences.py": 10,
    "tests/calibrate/test_tune.py": 9,
    "tests/test_llama_embeddings.py": 8,
    "tests/native/test_malformed_gguf.py": 7,
    "tests/cli/test_cli.py": 7,
    "tests/test_lossless_ngram.py": 7,
    "tests/test_llama_grammar.py": 7,
    "tests/gguf/test_river_index.py": 7,
    "tests/test_api_hardening.py": 7,
    "tests/test_lossless_matrix.py": 5,
    "tests/native/test_bad_input.py": 4,
    "tests/test_chat_sandbox.py": 3,
    "tests/gguf/test_reader.py": 3,
}
DEFAULT_TEST_SECONDS = 0.1


def file_seconds(path: str, n_tests: int) -> float:
    """What a test file is expected to cost, for the order files start in."""
    return FILE_SECONDS.get(path, DEFAULT_TEST_SECONDS * n_tests)


@pytest.hookimpl(tryfirst=True)  # before pytest-random-order's shuffle, when that is asked for
def pytest_collection_modifyitems(config, items):
    """The longest files first, each file's tests together and in their order. scripts/test.sh
    hands pytest-xdist's workers whole files in this order (--dist loadfile
    --no-loadscope-reorder): a worker takes the next file when it is almost done with its own, so
    long files first leaves only short ones to the end, where a long one would run on one worker
    while the other waits; and no file's module fixtures are built on both workers."""
    count = {}
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        count[path] = count.get(path, 0) + 1
    first_seen = {path: i for i, path in enumerate(count)}

    def key(item):
        path = item.nodeid.split("::", 1)[0]
        return -file_seconds(path, count[path]), first_seen[path]

    items.sort(key=key)  # stable: a file's tests keep their order


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With RIVER_TEST_SECONDS set: the test's CPU seconds, its fixtures' set-up and tear-down
    included, this process's and its finished children's (what FILE_SECONDS holds)."""
    out = os.environ.get("RIVER_TEST_SECONDS")
    start = _cpu_seconds() if out else 0.0
    yield
    if out:
        with open(out, "a") as f:  # one short line a write: workers appending at once keep whole lines
            f.write(json.dumps({"test": item.nodeid, "cpu_seconds": round(_cpu_seconds() - start, 2)}) + "\n")


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _cache_root(config) -> pathlib.Path:
    """Where the suite keeps what it builds between runs: pytest's cache folder (.cache/test
    without the cache plugin)."""
    cache = getattr(config, "cache", None)
    return cache.mkdir("river_gguf") if cache else pathlib.Path(__file__).parent.parent / ".cache" / "test"


def pytest_configure(config):
    config.addinivalue_line("markers", "alone: times or measures the process: run outside pytest-xdist's workers "
                                       "(scripts/test.sh runs these after the others, one at a time)")
    # Files derived from the default model (its F16 and llama.cpp's quants of it) are slow to make.
    os.environ.setdefault("RIVER_GGUF_CACHE", str(_cache_root(config) / "derived"))


@pytest.fixture(scope="session")
def built(pytestconfig):
    return BuildCache(_cache_root(pytestconfig) / "built")


@pytest.fixture(scope="session")
def q4_1_path():
    return default_model_path()


def _derived(built, kind):
    with built.lock("derived"):  # xdist's two workers would otherwise both write it
        return derived_model(kind)


@pytest.fixture(scope="session")
def f16_path(built):
    return _derived(built, "f16")


@pytest.fixture(scope="session")
def q4_0_path(built):
    return _derived(built, "q4_0")


@pytest.fixture(scope="session")
def derived(built):
    """derived(kind): a cached derivative of the default model (default_model.DERIVED_KINDS)."""
    return lambda kind: _derived(built, kind)


@pytest.fixture
def default_sigint():
    """SIGINT as a foreground Python process has it, for tests that send it: KeyboardInterrupt
    here, and the default action in the processes the test starts (exec resets a caught signal
    to the default). A suite started from a background job of a shell without job control
    (`pytest ... &` in a script, `nohup ... &`) inherits SIGINT ignored, and so would the
    processes it starts; this installs the handler such a test assumes, and puts back the one
    it found."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


@pytest.fixture
def oracle_factory():
    with oracles(n_threads=THREADS) as make:
        yield make


@pytest.fixture(scope="session")
def river_gguf_path(built, f16_path):
    """SmolLM2 F16 backbone + Q4_0 river, profiled tau, no imatrix or presets."""
    from river_gguf.convert.build import build_river_gguf

    options = dict(river_type="q4_0", backbone_type=None, imatrix=None, presets=False)
    return built.get("smollm2-f16+q4_0", lambda out: build_river_gguf(f16_path, out, progress=False, **options),
                     [os.path.basename(f16_path), options], package_digest())


class TinyModels:
    """Random-weight models (river_gguf.eval.random_model.write_tiny_model) and River GGUFs of them, built
    once per set of options for the whole suite and kept between runs."""

    def __init__(self, built: BuildCache):
        self._built = built

    def model(self, arch: str, **kw) -> str:
        """write_tiny_model(arch, **kw)'s file."""
        return self._built.get(f"tiny-{arch}", lambda out: write_tiny_model(out, arch, **kw), kw, package_digest())

    def river(self, arch: str, model: dict | None = None, **convert) -> str:
        """A River GGUF of model(arch, **model), converted with build_river_gguf(**convert) over
        these defaults: the backbone as it is, a Q4_0 river, tau 0.9, no imatrix, no presets."""
        from river_gguf.convert.build import build_river_gguf

        plain = self.model(arch, **(model or {}))
        opts = dict(dict(backbone_type=None, river_type="q4_0", imatrix=None, presets=False, threshold=0.9,
                         n_threads=THREADS), **convert)
        key = [os.path.basename(plain), {k: v for k, v in opts.items() if k != "n_threads"}]
        return self._built.get(f"tiny-{arch}-river", lambda out: build_river_gguf(plain, out, progress=False, **opts),
                               key, package_digest())


@pytest.fixture(scope="session")
def tiny(built):
    return TinyModels(built)
