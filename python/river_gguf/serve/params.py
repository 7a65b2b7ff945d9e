"""Turn a validated request into keyword arguments of the model's create_* method.

Only fields the client set are passed (the model keeps its own defaults for the rest), and a
field at its no-op value (presence_penalty=0, echo=false, ...) is dropped. What is left must
be a parameter the model's method names; otherwise the request gets a 400 that says so.
"""
from typing import Any, Dict, List

from .errors import APIError
from .protocol import accepts
from .schemas import ChatCompletionRequest, ChatMessage, CompletionRequest

#: Fields the server itself handles; never passed to the model.
_SERVER_FIELDS = {"model", "stream", "stream_options", "user", "n", "best_of", "max_completion_tokens",
                  "parallel_tool_calls"}

#: Values that ask for nothing: dropped, so a model without the feature still serves them.
_NO_OP = {"echo": False, "presence_penalty": 0.0, "frequency_penalty": 0.0, "logit_bias": {},
          "typical_p": 1.0, "mirostat_mode": 0, "min_tokens": 0, "grammar": "", "suffix": "",
          "response_format": {"type": "text"}, "tools": [], "functions": []}

#: Structured output needs a grammar sampler; named in the error so the user knows why.
_STRUCTURED = ("response_format", "grammar", "tools", "tool_choice", "functions", "function_call")


def completion_kwargs(req: CompletionRequest, method) -> Dict[str, Any]:
    kw = _common(req, method)
    kw["prompt"] = _one_prompt(req.prompt)
    _check_best_of(req)
    return _checked(kw, method)


def chat_kwargs(req: ChatCompletionRequest, method) -> Dict[str, Any]:
    kw = _common(req, method)
    kw["messages"] = [_message(m, i) for i, m in enumerate(req.messages)]
    if "max_completion_tokens" in req.model_fields_set and req.max_completion_tokens is not None:
        if req.max_tokens is not None and req.max_tokens != req.max_completion_tokens:
            raise APIError(400, "max_tokens and max_completion_tokens differ; send one of them",
                           param="max_completion_tokens", code="invalid_value")
        kw["max_tokens"] = req.max_completion_tokens
    if not req.logprobs:
        kw.pop("logprobs", None)
        if kw.get("top_logprobs") is not None:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs", code="invalid_value")
    return _checked(kw, method)


def _common(req, method) -> Dict[str, Any]:
    if req.n is not None and req.n != 1:
        raise APIError(400, f"n={req.n}: this server returns one choice per request (n=1)", param="n",
                       code="unsupported_parameter")
    opts = req.stream_options
    if opts is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed with stream=true", param="stream_options",
                       code="invalid_value")
    if opts is not None and opts.include_usage:
        raise APIError(400, "stream_options.include_usage is not supported: the streamed chunks carry no "
                            "token counts (a non-streamed request returns usage)",
                       param="stream_options.include_usage", code="unsupported_parameter")
    # Only what the client sent: the model's own defaults apply to the rest.
    kw = {k: getattr(req, k) for k in req.model_fields_set if k not in _SERVER_FIELDS}
    kw = {k: v for k, v in kw.items() if v is not None and not (k in _NO_OP and v == _NO_OP[k])}
    if not kw.get("mirostat_mode"):
        kw.pop("mirostat_tau", None)  # they only tune mirostat
        kw.pop("mirostat_eta", None)
    if "logit_bias" in kw:
        kw["logit_bias"] = _token_bias(kw["logit_bias"])
    if req.stream:
        kw["stream"] = True
    return kw


def _token_bias(bias: Dict[str, float]) -> Dict[int, float]:
    """OpenAI sends token ids as JSON object keys (strings); llama_cpp takes int keys."""
    out = {}
    for k, v in bias.items():
        try:
            out[int(k)] = v
        except ValueError:
            raise APIError(400, f"logit_bias keys must be token ids, got {k!r}", param="logit_bias",
                           code="invalid_value") from None
    return out


def _checked(kw: Dict[str, Any], method) -> Dict[str, Any]:
    for name in sorted(kw):
        if name in ("prompt", "messages") or accepts(method, name):
            continue
        owner = getattr(method, "__self__", None)
        what = type(owner).__name__ if owner is not None else "this model"
        if name in _STRUCTURED:
            raise APIError(400, f"'{name}' is not supported by the served model ({what} has no grammar "
                                "sampler; structured output needs river_gguf.Llama)",
                           param=name, code="unsupported_parameter")
        raise APIError(400, f"'{name}' is not supported by the served model ({what})", param=name,
                       code="unsupported_parameter")
    return kw


def _one_prompt(prompt) -> Any:
    if isinstance(prompt, str):
        return prompt
    if not prompt:
        raise APIError(400, "the prompt is empty", param="prompt", code="invalid_value")
    if isinstance(prompt[0], (str, list)):  # a batch: list of texts or of token lists
        if len(prompt) != 1:
            raise APIError(400, f"a batch of {len(prompt)} prompts: this server takes one prompt per request",
                           param="prompt", code="unsupported_parameter")
        return prompt[0]
    return list(prompt)  # token ids


def _check_best_of(req: CompletionRequest) -> None:
    if req.best_of is not None and req.best_of != 1:
        raise APIError(400, f"best_of={req.best_of}: this server generates one completion per request",
                       param="best_of", code="unsupported_parameter")


def _message(m: ChatMessage, i: int) -> Dict[str, Any]:
    content = m.content
    if isinstance(content, list):
        texts: List[str] = []
        for part in content:
            if part.type != "text":
                raise APIError(400, f"messages[{i}]: '{part.type}' content is not supported (text only)",
                               param=f"messages.{i}.content", code="unsupported_parameter")
            texts.append(part.text)
        content = "".join(texts)
    out: Dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                           "content": "" if content is None else content}
    for key in ("name", "tool_calls", "tool_call_id", "function_call"):
        value = getattr(m, key)
        if value is not None:
            out[key] = value
    return out
