"""Request bodies of the OpenAI endpoints, validated by pydantic.

Every field OpenAI (and llama-cpp-python's server) defines is known here; a field that is not
is refused (extra="forbid" -> 400 "Unrecognized request argument"). Knowing a field does not
mean the model supports it: params.py passes only what the client set, and refuses what the
model's methods do not take.
"""
from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

Stop = Union[StrictStr, List[StrictStr], None]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Request):
    include_usage: Optional[bool] = None
    include_obfuscation: Optional[bool] = None


class _Sampling(_Request):
    """Fields both endpoints share."""
    model: Optional[str] = None  # one model per server: any name is answered by it
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stop: Stop = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    seed: Optional[int] = None
    n: Optional[int] = None
    user: Optional[str] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[Dict[str, float]] = None
    # llama.cpp's own sampling parameters, as llama-cpp-python's server takes them
    min_p: Optional[float] = None
    top_k: Optional[int] = None
    repeat_penalty: Optional[float] = None
    typical_p: Optional[float] = None
    mirostat_mode: Optional[int] = None
    mirostat_tau: Optional[float] = None
    mirostat_eta: Optional[float] = None
    min_tokens: Optional[int] = None
    grammar: Optional[str] = None


class CompletionRequest(_Sampling):
    # One prompt: text, or token ids; a list of one of these is accepted as that one.
    prompt: Union[StrictStr, List[StrictInt], List[StrictStr], List[List[StrictInt]]]
    # OpenAI's default for completions; a negative count is refused, as llama-cpp-python's server
    # refuses it (its field has ge=0), rather than read as "to the end of the context".
    max_tokens: Optional[int] = Field(16, ge=0)
    suffix: Optional[str] = None
    echo: Optional[bool] = None
    logprobs: Optional[int] = None
    best_of: Optional[int] = None


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ImagePart(BaseModel):
    type: Literal["image_url", "input_audio", "file"]  # known but unsupported: refused in params


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Union[str, List[Union[TextPart, ImagePart]], None] = None
    name: Optional[str] = None
    tool_calls: Optional[List[Dict[str, Any]]] = None
    tool_call_id: Optional[str] = None
    function_call: Optional[Dict[str, Any]] = None
    # Sent back by clients that replay an assistant message as they received it.
    refusal: Optional[str] = None
    annotations: Optional[List[Any]] = None
    audio: Optional[Any] = None


class ChatCompletionRequest(_Sampling):
    messages: List[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = None  # newer OpenAI name of max_tokens
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None
    response_format: Optional[Dict[str, Any]] = None
    tools: Optional[List[Dict[str, Any]]] = None
    tool_choice: Union[str, Dict[str, Any], None] = None
    parallel_tool_calls: Optional[bool] = None
    functions: Optional[List[Dict[str, Any]]] = None
    function_call: Union[str, Dict[str, Any], None] = None


class EmbeddingRequest(_Request):
    model: Optional[str] = None
    input: Union[StrictStr, List[StrictStr]]
    encoding_format: Optional[Literal["float"]] = None  # base64 is not offered
    user: Optional[str] = None


class TokenizeRequest(_Request):
    model: Optional[str] = None
    input: str
