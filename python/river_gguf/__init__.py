"""river_gguf: River-LLM seamless token-level early exit for GGUF models.

    from river_gguf import Model
    m = Model("model.river.gguf")
    print(m.generate("Hello", max_tokens=32).text)

    from river_gguf import Llama   # in place of `from llama_cpp import Llama`
"""
from ._loader import native as _native  # checks the ggml build before anything else runs

from .model import Model, NumericalError, StreamInvalidatedError
from .results import Generation, ScoreResult
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
    "Generation",
    "ScoreResult",
    "GGUFFormatError",
    "UnsupportedModelError",
    "RiverMismatchError",
    "ContextOverflowError",
    "NumericalError",
    "StreamInvalidatedError",
]
