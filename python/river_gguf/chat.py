"""Chat prompt rendering from a GGUF ``tokenizer.chat_template``.

GGUF files carry the Hugging Face chat template (Jinja2) in the metadata key
``tokenizer.chat_template``.  :func:`format_chat` renders it in a sandboxed
Jinja2 environment with the variables HF templates expect (``messages``,
``bos_token``, ``eos_token``, ``add_generation_prompt``, ``raise_exception``,
``strftime_now``).  When no template is available a plain ChatML template is
used.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any, Dict, List, Optional

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["format_chat", "validate_messages", "CHATML_TEMPLATE", "VALID_ROLES"]

VALID_ROLES = ("system", "user", "assistant", "tool")

#: Fallback used when the model has no chat template.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class _GenerationTag(jinja2.ext.Extension):
    """Accept HF's ``{% generation %}...{% endgeneration %}`` and render the body."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)  # the 'generation' name token
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return body


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: Optional[int] = None,
    separators=None,
    sort_keys: bool = False,
) -> str:
    # HF renders chat-template JSON without escaping non-ASCII or HTML chars.
    return json.dumps(
        value,
        ensure_ascii=ensure_ascii,
        indent=indent,
        separators=separators,
        sort_keys=sort_keys,
    )


def _raise_exception(message: str):
    raise ValueError(f"chat template error: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        loader=jinja2.BaseLoader(),
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def validate_messages(messages: Any) -> List[Dict[str, Any]]:
    """Check the OpenAI-style message list; raise ValueError if malformed."""
    if not isinstance(messages, (list, tuple)):
        raise ValueError(
            f"messages must be a list of dicts, got {type(messages).__name__}"
        )
    if len(messages) == 0:
        raise ValueError("messages must contain at least one message")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise ValueError(
                f"messages[{i}] must be a dict, got {type(msg).__name__}"
            )
        if "role" not in msg:
            raise ValueError(f"messages[{i}] is missing the 'role' key")
        role = msg["role"]
        if role not in VALID_ROLES:
            raise ValueError(
                f"messages[{i}]['role'] must be one of {', '.join(VALID_ROLES)}; "
                f"got {role!r}"
            )
        if "content" not in msg:
            raise ValueError(f"messages[{i}] is missing the 'content' key")
        if not isinstance(msg["content"], str):
            raise ValueError(
                f"messages[{i}]['content'] must be a str, got "
                f"{type(msg['content']).__name__}"
            )
        out.append(msg)
    return out


def format_chat(
    template: Optional[str],
    messages: List[Dict[str, Any]],
    bos_token: str = "",
    eos_token: str = "",
    add_generation_prompt: bool = True,
    **extra: Any,
) -> str:
    """Render ``messages`` with a GGUF/HF chat template.

    ``extra`` keyword arguments are passed to the template as additional
    variables (e.g. ``tools=...``).  Template errors (syntax errors or a
    template calling ``raise_exception``) are raised as ValueError.
    """
    msgs = validate_messages(messages)
    if template is None or (isinstance(template, str) and template.strip() == ""):
        template = CHATML_TEMPLATE
    if not isinstance(template, str):
        raise ValueError(
            f"template must be a str or None, got {type(template).__name__}"
        )
    try:
        tmpl = _compile(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"invalid chat template: {e}") from e
    variables = dict(extra)
    # HF and llama-cpp-python both pass ``tools=None`` when no tools are given,
    # so ``{% if tools is not none %}`` style checks behave the same here.
    variables.setdefault("tools", None)
    variables.update(
        messages=[dict(m) for m in msgs],
        bos_token=bos_token or "",
        eos_token=eos_token or "",
        add_generation_prompt=bool(add_generation_prompt),
    )
    try:
        return tmpl.render(**variables)
    except jinja2.TemplateError as e:
        raise ValueError(f"chat template rendering failed: {e}") from e
