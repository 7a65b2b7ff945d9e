"""Chat prompt rendering from a GGUF ``tokenizer.chat_template``.

GGUF files carry the Hugging Face chat template (Jinja2) in the metadata key
``tokenizer.chat_template``.  :func:`format_chat` renders it in a sandboxed
Jinja2 environment with the variables HF templates expect (``messages``,
``bos_token``, ``eos_token``, ``add_generation_prompt``, ``raise_exception``,
``strftime_now``).  When no template is available a plain ChatML template is
used.

Templates come from downloaded files, so the sandbox also bounds the work a render may do
(limits below, per :func:`format_chat` call): every loop iteration, call, attribute and item
lookup counts as a step; steps and wall time are capped; ``range()`` is capped; strings and
lists a template builds (``*``, ``+``, ``~``, ``%``, padding and replace methods, filters) and
the rendered text are capped in length before they are built where the size is known up front.
Going over a limit raises :class:`TemplateLimitError` (a ValueError) naming the limit.
"""

from __future__ import annotations

import contextvars
import functools
import json
import math
import re
import time
from datetime import datetime
from typing import Any, Dict, List, Optional

import jinja2
import jinja2.ext
import llama_cpp.llama_chat_format as llama_chat_format
from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment
from llama_cpp.llama import StoppingCriteriaList

from ._loader import native

__all__ = ["format_chat", "render_chat", "validate_messages", "template_chat_handler", "LimitedChatFormatter",
           "CHATML_TEMPLATE", "VALID_ROLES", "TemplateLimitError"]

#: Render limits of one format_chat call. A chat template renders a few hundred steps per message
#: in well under a millisecond; these are orders of magnitude above any real template.
MAX_RENDER_SECONDS = 2.0
MAX_RENDER_STEPS = 2_000_000     # loop iterations + calls + attribute/item lookups + operators
MAX_RANGE = 100_000              # items of one range()
MAX_OUTPUT_CHARS = 16_000_000    # the rendered prompt, and any one string or list built on the way
MAX_INT_BITS = 65_536            # size of an integer a template may compute with **

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


# ----- render limits ----------------------------------------------------------------------------
class TemplateLimitError(ValueError):
    """A chat template went over one of the render limits (steps, time, range, size)."""


class _Budget:
    """The work left to one render (held in a context variable, so threads render independently)."""

    __slots__ = ("steps", "deadline")

    def __init__(self) -> None:
        self.steps = 0
        self.deadline = time.monotonic() + MAX_RENDER_SECONDS

    def tick(self, n: int = 1) -> None:
        self.steps += n
        if self.steps > MAX_RENDER_STEPS:
            raise TemplateLimitError(
                f"chat template exceeded the step limit of {MAX_RENDER_STEPS:,} loop iterations, calls "
                "and lookups (chat.MAX_RENDER_STEPS)")
        if time.monotonic() > self.deadline:
            raise TemplateLimitError(
                f"chat template exceeded the time limit of {MAX_RENDER_SECONDS:g} s (chat.MAX_RENDER_SECONDS)")


_budget: contextvars.ContextVar[Optional[_Budget]] = contextvars.ContextVar("river_chat_budget", default=None)


def _tick(n: int = 1) -> None:
    b = _budget.get()
    if b is not None:
        b.tick(n)


def _too_long(n: int, what: str) -> TemplateLimitError:
    return TemplateLimitError(
        f"chat template would build {what} of {n:,} items, over the size limit of {MAX_OUTPUT_CHARS:,} "
        "(chat.MAX_OUTPUT_CHARS)")


def _check_len(n: int, what: str = "a string") -> None:
    if n > MAX_OUTPUT_CHARS:
        raise _too_long(n, what)


def _checked(value: Any) -> Any:
    """``value``, after checking a string or container the template built is within the size limit."""
    if isinstance(value, (str, list, tuple, dict, set, bytes)):
        _check_len(len(value), f"a {type(value).__name__}")
    return value


def _check_int(value: Any) -> None:
    """Refuse an int argument so large it can only serve to build a huge string (a width, a count)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_OUTPUT_CHARS:
        raise TemplateLimitError(
            f"chat template passed {value:,} as a size, over the size limit of {MAX_OUTPUT_CHARS:,} "
            "(chat.MAX_OUTPUT_CHARS)")


# Widths and precisions in %-format and str.format specs: "%99999999s", "{:>99999999}".
_PCT_SPEC = re.compile(r"%[-+ #0]*(\d*)(?:\.(\d+))?")
_FMT_SPEC = re.compile(r"\{[^{}]*:[^{}]*?(\d+)(?:\.(\d+))?[^{}]*\}")


def _check_format_string(fmt: str) -> None:
    for m in list(_PCT_SPEC.finditer(fmt)) + list(_FMT_SPEC.finditer(fmt)):
        for g in m.groups():
            if g and len(g) > 9:
                _check_int(10 ** 9)
            elif g:
                _check_int(int(g))


def _bounded_range(*args: int) -> range:
    """range() for templates: at most MAX_RANGE items, and iterating it counts steps."""
    r = range(*args)
    if len(r) > MAX_RANGE:
        raise TemplateLimitError(
            f"chat template asked for range() of {len(r):,} items, over the limit of {MAX_RANGE:,} "
            "(chat.MAX_RANGE)")
    return r


def _budget_iter(iterable: Any):
    """What every ``{% for %}`` loop of a template iterates: the same items, one step each."""
    for item in iterable:
        _tick()
        yield item


_ITER_FILTER = "__river_budget_iter"


def _checked_replace(owner: str, old: Any, new: Any, count: Any = -1) -> None:
    if isinstance(old, str) and isinstance(new, str):
        n = owner.count(old) if old else len(owner) + 1
        if isinstance(count, int) and count >= 0:
            n = min(n, count)
        _check_len(len(owner) + n * (len(new) - len(old)))


def _check_str_method(obj: Any, args: tuple, kwargs: dict) -> None:
    """Pre-check the str methods whose result can be far larger than their inputs."""
    inner = getattr(obj, "__wrapped__", obj)  # the sandbox wraps str.format
    owner = getattr(inner, "__self__", None)
    if not isinstance(owner, str):
        return
    name = getattr(inner, "__name__", "")
    if name in ("ljust", "rjust", "center", "zfill"):
        for a in args:
            _check_int(a)
    elif name in ("format", "format_map"):
        _check_format_string(owner)
    elif name == "replace" and len(args) >= 2:
        _checked_replace(owner, *args[:3])
    elif name == "join" and args and hasattr(args[0], "__len__"):
        _check_len(len(owner) * max(len(args[0]) - 1, 0))
    elif name == "expandtabs":
        size = args[0] if args else kwargs.get("tabsize", 8)
        if isinstance(size, int):
            _check_len(len(owner) + owner.count("\t") * max(size, 0))


# Filters whose int arguments are widths or lengths of the text they build.
_SIZED_FILTERS = ("do_center", "do_indent", "do_truncate", "do_wordwrap", "_tojson")


def _limited_filter(func):
    """Wrap a filter so its size arguments and its result are checked (the value filtered, the
    first argument after any context/environment, may be any size the inputs allow)."""
    pass_arg = getattr(func, "jinja_pass_arg", None)
    skip = 2 if pass_arg is not None else 1
    sized = getattr(func, "__name__", "") in _SIZED_FILTERS

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        _tick()
        if sized:
            for a in list(args[skip:]) + list(kwargs.values()):
                _check_int(a)
        if func.__name__ == "do_replace" and len(args) >= skip + 2:
            _checked_replace(str(args[skip - 1]), *args[skip:skip + 3])
        elif func.__name__ == "do_join" and len(args) > skip and hasattr(args[skip - 1], "__len__"):
            _check_len(len(str(args[skip])) * max(len(args[skip - 1]) - 1, 0))
        elif func.__name__ == "do_format":
            _check_format_string(str(args[skip - 1]))
        return _checked(func(*args, **kwargs))

    return wrapper


class _LimitedCodeGenerator(CodeGenerator):
    """Jinja's code generator, with every for-loop iterating through ``_budget_iter`` and every
    ``~`` concatenation size-checked: loops are where a template spends unbounded time."""

    def visit_Template(self, node, frame=None):
        for loop in node.find_all(nodes.For):
            loop.iter = nodes.Filter(loop.iter, _ITER_FILTER, [], [], None, None, lineno=loop.lineno)
        return super().visit_Template(node, frame)

    def visit_Concat(self, node, frame):
        self.write("environment.checked_value(")
        super().visit_Concat(node, frame)
        self.write(")")


class _LimitedEnvironment(ImmutableSandboxedEnvironment):
    """The immutable sandbox with the render limits above."""

    code_generator_class = _LimitedCodeGenerator
    # Operators that can build huge values from small ones, or take long on big ints.
    intercepted_binops = frozenset(["*", "**", "+", "%", "//"])

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.globals["range"] = _bounded_range

    def checked_value(self, value: Any) -> Any:
        return _checked(value)

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        _tick()
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                    _check_len(len(seq) * n, f"a {type(seq).__name__}")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
            if right * math.log2(abs(left)) > MAX_INT_BITS:
                raise TemplateLimitError(
                    f"chat template computes {left} ** {right}, over the limit of {MAX_INT_BITS:,} bits "
                    "(chat.MAX_INT_BITS)")
        elif operator == "%" and isinstance(left, str):
            _check_format_string(left)
            for a in (right if isinstance(right, tuple) else (right,)):
                _check_int(a)  # "%*s" takes its width from the arguments
        return _checked(super().call_binop(context, operator, left, right))

    def call(__self, __context, __obj, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (jinja's signature)
        _tick()
        _check_str_method(__obj, args, kwargs)
        return _checked(super().call(__context, __obj, *args, **kwargs))

    def getattr(self, obj: Any, attribute: str) -> Any:
        _tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _tick()
        return super().getitem(obj, argument)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = _LimitedEnvironment(
        loader=jinja2.BaseLoader(),
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.filters = {name: _limited_filter(f) for name, f in env.filters.items()}
    env.filters[_ITER_FILTER] = _budget_iter  # not counted twice: it ticks per item itself
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def _render(tmpl: jinja2.Template, variables: Dict[str, Any]) -> str:
    """Render within the limits: a fresh budget for this call, and the text collected piece by
    piece so an output over the size limit stops the render instead of being built."""
    token = _budget.set(_Budget())
    try:
        parts: List[str] = []
        size = 0
        for piece in tmpl.generate(**variables):
            size += len(piece)
            if size > MAX_OUTPUT_CHARS:
                raise TemplateLimitError(
                    f"chat template output exceeded the size limit of {MAX_OUTPUT_CHARS:,} characters "
                    "(chat.MAX_OUTPUT_CHARS)")
            parts.append(piece)
        return "".join(parts)
    finally:
        _budget.reset(token)


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


def format_chat(template: Optional[str], messages: List[Dict[str, Any]], *args: Any, **kwargs: Any) -> str:
    """Render ``messages``, checked by :func:`validate_messages` (roles, str content), with a
    GGUF/HF chat template: the same arguments as :func:`render_chat` (``bos_token``,
    ``eos_token``, ``add_generation_prompt`` and extra template variables such as ``tools=...``).
    Template errors (syntax errors or a template calling ``raise_exception``) are raised as
    ValueError."""
    return render_chat(template, validate_messages(messages), *args, **kwargs)


def render_chat(
    template: Optional[str],
    messages: List[Dict[str, Any]],
    bos_token: str = "",
    eos_token: str = "",
    add_generation_prompt: bool = True,
    **extra: Any,
) -> str:
    """Render within the limits, taking the messages as they are (OpenAI's forms, with
    content None or a list of parts, as llama_cpp's Jinja2ChatFormatter takes them)."""
    if not isinstance(messages, (list, tuple)) or not all(isinstance(m, dict) for m in messages):
        raise ValueError("messages must be a list of dicts")
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
        messages=[dict(m) for m in messages],
        bos_token=bos_token or "",
        eos_token=eos_token or "",
        add_generation_prompt=bool(add_generation_prompt),
    )
    try:
        return _render(tmpl, variables)
    except jinja2.TemplateError as e:
        raise ValueError(f"chat template rendering failed: {e}") from e
    except RecursionError:
        raise TemplateLimitError("chat template recursion too deep (Python's recursion limit)") from None
    except (MemoryError, OverflowError) as e:
        raise TemplateLimitError(f"chat template rendering failed: {type(e).__name__}: {e}") from None


class LimitedChatFormatter(llama_chat_format.ChatFormatter):
    """llama_cpp's Jinja2ChatFormatter (same variables, same response), rendered within this
    module's limits: river_gguf.Llama builds its handlers for a file's chat templates from it, so
    the limits guard the server and every create_chat_completion, not only the CLI."""

    def __init__(self, template: str, eos_token: str, bos_token: str, add_generation_prompt: bool = True,
                 stop_token_ids: Optional[List[int]] = None):
        self.template, self.eos_token, self.bos_token = template, eos_token, bos_token
        self.add_generation_prompt = add_generation_prompt
        self.stop_token_ids = set(stop_token_ids) if stop_token_ids is not None else None
        try:
            _compile(template)  # a syntax error shows when the model loads, as in llama_cpp
        except jinja2.TemplateSyntaxError as e:
            # The template is the file's (tokenizer.chat_template*): a defect of the file, raised
            # as the file errors are (GGUFFormatError is a ValueError).
            raise native.GGUFFormatError(f"invalid chat template: {e}") from e

    def __call__(self, *, messages, functions=None, function_call=None, tools=None, tool_choice=None, **kwargs):
        prompt = render_chat(self.template, messages, self.bos_token, self.eos_token, self.add_generation_prompt,
                             functions=functions, function_call=function_call, tools=tools,
                             tool_choice=tool_choice, **kwargs)
        criteria = None
        if self.stop_token_ids is not None:
            ids = self.stop_token_ids

            def stop_on_last_token(tokens, logits) -> bool:
                return tokens[-1] in ids

            criteria = StoppingCriteriaList([stop_on_last_token])
        return llama_chat_format.ChatFormatterResponse(prompt=prompt, stop=[self.eos_token],
                                                       stopping_criteria=criteria, added_special=True)


def template_chat_handler(template: str, eos_token: str, bos_token: str, stop_token_ids: List[int]):
    """A llama_cpp chat-completion handler for a GGUF chat template, rendered within the limits."""
    formatter = LimitedChatFormatter(template, eos_token, bos_token, stop_token_ids=stop_token_ids)
    return llama_chat_format.chat_formatter_to_chat_completion_handler(formatter)
