"""river_gguf: River-LLM seamless token-level early exit for GGUF models.

    from river_gguf import Llama   # in place of `from llama_cpp import Llama`
    llm = Llama("model.river.gguf", preset="balanced")
    print(llm("Hello", max_tokens=32)["choices"][0]["text"], llm.last_stats)

    from river_gguf import Model   # the River-level handle: the engine, vocabulary, exit options
    with Model("model.river.gguf").session() as s:   # a decode cursor: prefill, extend, decode(choose)
"""
from ._loader import native as _native  # checks the ggml build before anything else runs

from .model import Model, NumericalError
from .session import Session, Step  # a decode cursor over a Model's cache, and one token of its loop
from .results import ScoreResult
from .llama import Llama, LlamaGrammar  # the drop-in for llama_cpp.Llama

GGUFFormatError = _native.GGUFFormatError
UnsupportedModelError = _native.UnsupportedModelError
RiverMismatchError = _native.RiverMismatchError
ContextOverflowError = _native.ContextOverflowError

__version__ = "0.1.0"
__all__ = [
    "Model",
    "Llama",
    "LlamaGrammar",
    "Session",
    "Step",
    "ScoreResult",
    "GGUFFormatError",
    "UnsupportedModelError",
    "RiverMismatchError",
    "ContextOverflowError",
    "NumericalError",
]
