"""Chat templates render within limits (issue 8): a template from a downloaded file cannot hang
create_chat_completion or exhaust memory; it gets a ValueError naming the limit instead."""
from __future__ import annotations

import threading
import time

import pytest

from river_gguf import chat
from river_gguf.chat import TemplateLimitError, format_chat
from river_gguf.gguf.reader import GGUFReader

MSGS = [{"role": "user", "content": "Hi"}]
ISSUE_TEMPLATE = "{% for a in range(10**6) %}{% for b in range(10**6) %}x{% endfor %}{% endfor %}"


def _fails_fast(template, match, seconds=10.0, **kw):
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=match) as info:
        format_chat(template, MSGS, **kw)
    assert time.monotonic() - t0 < seconds
    assert isinstance(info.value, TemplateLimitError)
    return info.value


def test_the_issues_nested_loops():
    _fails_fast(ISSUE_TEMPLATE, r"range\(\) of 1,000,000 items.*MAX_RANGE")


@pytest.fixture
def step_limit_only(monkeypatch):
    """A small step limit and a generous time limit: the step limit is what a runaway hits."""
    monkeypatch.setattr(chat, "MAX_RENDER_STEPS", 100_000)
    monkeypatch.setattr(chat, "MAX_RENDER_SECONDS", 60.0)


def test_nested_loops_within_the_range_cap_hit_the_step_limit(step_limit_only):
    _fails_fast("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
                r"step limit of 100,000 .*MAX_RENDER_STEPS")


def test_loops_over_a_long_string_are_counted_too(step_limit_only):
    # No range() involved: 5000 x 5000 iterations over the characters of a built string.
    _fails_fast("{% set s = 'x' * 5000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}", "step limit")


def test_default_limits_stop_the_runaway_within_seconds():
    _fails_fast("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
                r"(step|time) limit", seconds=10)


def test_time_limit(monkeypatch):
    monkeypatch.setattr(chat, "MAX_RENDER_SECONDS", 0.05)
    monkeypatch.setattr(chat, "MAX_RENDER_STEPS", 10**12)
    _fails_fast(ISSUE_TEMPLATE.replace("10**6", "10**5"), r"time limit of 0.05 s", seconds=5)


def test_recursion():
    _fails_fast("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursion")


@pytest.mark.parametrize("template", [
    "{{ 'x' * 10**9 }}",
    "{{ 10**9 * 'x' }}",
    "{{ ['x'] * 10**9 }}",
    "{{ 'x'.ljust(10**9) }}",
    "{{ 'x'.center(10**9) }}",
    "{{ 'x' | center(10**9) }}",
    "{{ 'x' | indent(10**9, true) }}",
    "{{ '%*s' % (10**9, 'x') }}",
    "{{ '%999999999s' % 'x' }}",
    "{{ '{:>999999999}'.format('x') }}",
    "{{ ('x' * 100000).replace('', 'y' * 1000) }}",
    "{{ ('x' * 100000) | replace('x', 'y' * 1000) }}",
    "{{ ('x' * 100000).join(range(100000)|map('string')|list) }}",
    "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
])
def test_huge_values_refused_before_they_are_built(template):
    _fails_fast(template, "size limit")


def test_huge_integers_refused():
    _fails_fast("{{ 2 ** 100000000 }}", r"MAX_INT_BITS")


def test_output_size_limit(monkeypatch):
    monkeypatch.setattr(chat, "MAX_OUTPUT_CHARS", 100_000)
    _fails_fast("{% for i in range(1000) %}{{ 'x' * 1000 }}{% endfor %}", r"output exceeded the size limit of 100,000")


def test_ordinary_templates_unaffected():
    out = format_chat("{% for m in messages %}{{ loop.index }}:{{ m['role'] }}={{ m.content | upper }};"
                      "{% endfor %}{{ range(3) | join(',') }}{{ '%05d' % 42 }}{{ 'ab' * 3 }}{{ 2 ** 10 }}"
                      "{{ '{:>4}'.format('z') }}",
                      [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])
    assert out == "1:system=S;2:user=U;0,1,2" "00042" "ababab" "1024" "   z"
    # Large but legitimate content passes: a 1 MB message.
    big = "word " * 200_000
    assert big in format_chat(None, [{"role": "user", "content": big}])


def test_the_budget_is_per_call_and_per_thread():
    # Many renders in a row each get a fresh budget...
    tmpl = "{% for i in range(50000) %}{% endfor %}ok"
    for _ in range(50):
        assert format_chat(tmpl, MSGS) == "ok"
    # ...and a runaway template in one thread does not stop another thread's render.
    results = {}

    def run(name, template):
        try:
            results[name] = format_chat(template, MSGS)
        except ValueError as e:
            results[name] = e

    threads = [threading.Thread(target=run, args=("bad", ISSUE_TEMPLATE.replace("10**6", "10**5"))),
               threading.Thread(target=run, args=("good", None))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert isinstance(results["bad"], TemplateLimitError)
    assert results["good"].startswith("<|im_start|>user\nHi<|im_end|>")


def test_create_chat_completion_with_a_hostile_template(tmp_path):
    """The limits guard river_gguf.Llama's handlers for a file's templates (and so the server)."""
    from river_gguf import Llama
    from river_gguf.gguf.meta import set_river_metadata
    from river_gguf.eval.random_model import write_tiny_model

    path = write_tiny_model(tmp_path / "tiny.gguf", "llama", n_layer=2)
    set_river_metadata(path, {"tokenizer.chat_template": ISSUE_TEMPLATE.replace("10**6", "10**5")})
    llm = Llama(path, n_ctx=64, n_threads=1, verbose=False)
    assert llm.chat_format == "chat_template.default"
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="(step|time) limit"):
        llm.create_chat_completion(MSGS, max_tokens=2)
    assert time.monotonic() - t0 < 10


RICH_TEMPLATE = """
{%- macro show(m, depth) -%}[{{ depth }}:{{ m.role }}]{% endmacro -%}
{%- set ns = namespace(n=0, seen='') -%}
{%- for m in messages -%}
  {%- set ns.n = ns.n + 1 -%}{%- set ns.seen = ns.seen ~ m.role[0] -%}
  {{ show(m, loop.index0) }}{{ m['content'] | trim | replace('x', 'y') }}{% if not loop.last %}|{% endif %}
  {%- if loop.first %}({{ loop.length }} msgs, next {{ loop.nextitem.role }}){% endif -%}
{%- endfor -%}
{%- for k, v in {'a': 1, 'b': [1, 2]}.items() recursive %}{{ k }}={{ v | tojson }};{% endfor -%}
{%- for i in range(3) | reverse %}{{ i }}{% else %}none{% endfor -%}
{{ ns.n }}{{ ns.seen }}{{ '%s-%d' % ('z', 7) }}{{ '{}/{}'.format(1, 2) }}{{ [1, 2] + [3] }}{{ 7 // 2 }}{{ 'ab' ~ 'cd' }}
{%- if tools %}{{ tools | tojson(indent=2) }}{% endif -%}
{%- if add_generation_prompt %}<gen>{% endif %}"""


def _plain_render(template, msgs, **kw):
    """The same environment without the limits (what format_chat rendered before)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(loader=jinja2.BaseLoader(), trim_blocks=True, lstrip_blocks=True,
                                        extensions=[chat._GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = chat._tojson
    env.globals["raise_exception"] = chat._raise_exception
    env.globals["strftime_now"] = chat._strftime_now
    v = dict(tools=None, messages=msgs, bos_token="<s>", eos_token="</s>", add_generation_prompt=True)
    v.update(kw)
    return env.from_string(template).render(**v)


def test_limits_change_no_output_of_real_templates():

    from river_gguf.default_model import default_model_path

    f = GGUFReader(default_model_path()).fields["tokenizer.chat_template"]
    smol = bytes(f.parts[f.data[0]]).decode("utf-8")
    msgs = [{"role": "system", "content": " s x "}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo"}, {"role": "user", "content": "more x"}]
    tools = [{"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}]
    for template in (smol, RICH_TEMPLATE, chat.CHATML_TEMPLATE):
        for kw in ({}, {"tools": tools}):
            ours = format_chat(template, msgs, "<s>", "</s>", **kw)
            assert ours == _plain_render(template, msgs, **kw)
    assert "[0:system]s y|(4 msgs, next user)" in format_chat(RICH_TEMPLATE, msgs)
