"""What the server needs of a model object, so any conforming class can serve.

river_gguf.Model conforms, and so does a llama_cpp.Llama-style class (river_gguf.Llama):
both return OpenAI-style dicts, or iterators of chunk dicts with stream=True. Keyword
arguments a method does not name in its signature are treated as unsupported, so the server
answers 400 instead of passing them on (see params.py).
"""
import inspect
from typing import Any, Dict, Iterator, List, Protocol, Union, runtime_checkable

Response = Union[Dict[str, Any], Iterator[Dict[str, Any]]]


@runtime_checkable
class ServedModel(Protocol):
    model_path: str

    def create_completion(self, prompt, **kwargs) -> Response: ...

    def create_chat_completion(self, messages, **kwargs) -> Response: ...

    def tokenize(self, text: bytes, *args, **kwargs) -> List[int]:
        """Must not touch the KV cache: the server calls it outside the model's queue."""
        ...


def accepts(method, name: str) -> bool:
    """Whether `method` names the parameter `name` itself (a **kwargs catch-all does not count:
    river_gguf.Model's catch-all takes exit options, not OpenAI parameters)."""
    try:
        params = inspect.signature(method).parameters
    except (TypeError, ValueError):
        return False
    p = params.get(name)
    return p is not None and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)


def check_model(model: Any) -> None:
    if not isinstance(model, ServedModel):
        raise TypeError(f"{type(model).__name__} cannot be served: it needs model_path, create_completion, "
                        "create_chat_completion and tokenize")
