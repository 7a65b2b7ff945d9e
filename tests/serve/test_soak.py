"""tools/soak_server.py: its answer checks refuse what the server must not answer, and a short
soak on a tiny random model with two slots answers every request as expected."""
import json
import os
import runpy
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "soak_server.py")


@pytest.fixture(scope="module")
def soak():
    return runpy.run_path(SCRIPT)


class FakeTarget:
    """Answers /extras/tokenize/count with a fixed count."""

    def __init__(self, count):
        self.count = count

    def request(self, method, path, body=None, timeout=0):
        return 200, {"count": self.count}, b""


def _usage(p, c):
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def test_usage_checks(soak):
    check, unexpected = soak["check_usage"], soak["Unexpected"]
    body, path = {"prompt": "a b", "max_tokens": 4}, "/v1/completions"
    check(FakeTarget(3), path, body, "xyzw", "length", _usage(3, 4))
    check(FakeTarget(3), path, body, "x", "stop", _usage(3, 1))
    check(FakeTarget(3), path, body, "", "stop", _usage(3, 0))
    bad = [(FakeTarget(3), "x", "length", _usage(3, 2)),                  # "length" before max_tokens
           (FakeTarget(3), "x", "eos", _usage(3, 1)),                     # no such finish_reason
           (FakeTarget(3), "x", "stop", {**_usage(3, 1), "total_tokens": 5}),
           (FakeTarget(3), "x" * 9, "length", _usage(3, 4 + soak["UTF8_OVERRUN"] + 1)),
           (FakeTarget(3), "x", "stop", _usage(3, 0)),                    # text from no token
           (FakeTarget(5), "x", "stop", _usage(3, 1))]                    # prompt_tokens miscounted
    for target, text, finish, usage in bad:
        with pytest.raises(unexpected):
            check(target, path, body, text, finish, usage)


def test_error_checks(soak):
    check, unexpected = soak["check_error"], soak["Unexpected"]
    err = {"error": {"message": "Unrecognized request argument: bogus", "type": "invalid_request_error",
                     "param": "bogus", "code": None}}
    check(400, err, b"", "bogus")
    for status, parsed, param in [(200, err, "bogus"), (422, err, "bogus"), (400, err, "prompt"),
                                  (400, {"detail": "bad"}, None), (400, None, None)]:
        with pytest.raises(unexpected):
            check(status, parsed, b"", param)


def test_slot_context_follows_the_documented_rounding(soak):
    assert soak["slot_context"](512, 2) == 256
    assert soak["slot_context"](4096, 4) == 1024
    assert soak["slot_context"](1000, 3) == 512


def test_rss_verdict(soak):
    verdict, mib = soak["rss_verdict"], soak["MIB"]
    flat = [(t, 100 * mib) for t in range(100)]
    assert verdict(flat, 100, 0.1, 0.05)["verdict"] == "flat"
    grew = [(t, (100 + t) * mib) for t in range(100)]
    assert verdict(grew, 100, 0.1, 0.05)["verdict"] == "grew"
    assert verdict([], 100, 0.1, 0.05)["verdict"].startswith("unknown")


@pytest.mark.alone  # a 20-second soak (two slots, eight clients): longer than the suite allows a test in parallel
def test_short_soak_on_a_tiny_model_answers_every_request(tiny, tmp_path):
    model = tiny.model("llama", n_layer=2)
    out = tmp_path / "soak.json"
    r = subprocess.run([sys.executable, SCRIPT, model, "--parallel", "2", "--n-ctx", "512", "--threads", "1",
                        "--minutes", str(20 / 60), "--rss-every", "1", "--seed", "1", "--json", str(out),
                        "--server-log", str(tmp_path / "server.log")],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    s = json.loads(out.read_text())
    kinds = s["by_kind"]
    assert s["failures"] == 0 and not s["server_problems"]
    assert s["requests"] > 50
    for kind in ("completion", "chat", "completion-stream", "chat-stream"):
        assert kinds.get(kind, 0) > 0, kinds
    assert any(k.startswith("malformed-") for k in kinds) and any(k.endswith("-dropped") for k in kinds), kinds
    assert s["rss"]["samples"] >= 10 and s["rss"]["verdict"] in ("flat", "grew")
