"""Which model class serves, and the name it is served under."""
import os

from ..llama import Llama


def model_class():
    """The class `river-gguf serve` loads: the llama_cpp-compatible Llama, so grammar,
    response_format, tools and llama-cpp-python's sampling parameters work as on its server. The
    server needs only what protocol.ServedModel names, and refuses (400) parameters the class
    does not take."""

    return Llama


def model_id(model, alias=None) -> str:
    """--alias if given, else the model's file name (clients see this in /v1/models)."""
    return alias or os.path.basename(model.model_path)
