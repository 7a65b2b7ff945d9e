"""Task accuracy (eval/tasks.py): the sandbox that runs generated code, HumanEval's checker and
GSM8K's answer matching."""
import time


from river_gguf.eval import tasks


def test_sandbox_kills_an_infinite_loop_and_counts_it_as_a_failure():
    t0 = time.perf_counter()
    r = tasks.run_sandboxed("while True:\n    pass\n", timeout=2)
    assert not r.passed and r.reason == "timeout"
    assert time.perf_counter() - t0 < 6


def test_sandbox_limits_memory_network_and_exit_status():
    assert tasks.run_sandboxed("print('ok')").passed
    r = tasks.run_sandboxed("raise SystemExit(3)")
    assert not r.passed and r.returncode == 3
    assert not tasks.run_sandboxed("x = bytearray(8 << 30)\n", memory_mb=512).passed
    r = tasks.run_sandboxed("import socket\nsocket.create_connection(('127.0.0.1', 9))\n")
    assert not r.passed and "network access is disabled" in r.output
    assert not tasks.run_sandboxed("import sys\nsys.stdin.read() or sys.exit(1)\n").passed  # no input


def test_humaneval_canonical_solutions_pass_and_wrong_ones_fail():
    from river_gguf.measure.data import humaneval_items

    probs = tasks.humaneval_problems()
    assert len(probs) == 164
    canon = {it.id: it.completion for it in humaneval_items()}
    for p in probs[:4]:
        assert tasks.check_humaneval(p, canon[p.task_id]).passed, p.task_id
        assert not tasks.check_humaneval(p, "    return None\n").passed
    # A completion is cut at the next top-level statement, as HumanEval's stop sequences do.
    p = probs[0]
    assert tasks.check_humaneval(p, canon[p.task_id] + "\nprint(undefined_name)\n").passed
    assert not tasks.check_humaneval(p, "    while True:\n        pass\n", timeout=2).passed


def test_gsm8k_answers():
    probs = tasks.gsm8k_problems()
    assert len(probs) == 100 and all(p.answer is not None for p in probs)
    p = probs[0]
    assert tasks.gsm8k_correct(p, f" So the total is {p.answer}.\n\nQuestion: next")
    assert tasks.gsm8k_correct(p, f" It is 12 then 3.\n#### {p.answer}")
    assert not tasks.gsm8k_correct(p, f" It is {p.answer}1.")
    assert tasks.parse_number("costs $1,250.00 in all") == "1250"
    assert tasks.parse_number("no number") is None
    shots = tasks.gsm8k_shots(p, probs)
    assert len(shots) == 4 and p.id not in {s.id for s in shots}
    prompt = tasks.gsm8k_prompt(p, shots)
    assert prompt.endswith(p.question) and all(s.worked_answer in prompt for s in shots)
    assert p.worked_answer not in prompt
