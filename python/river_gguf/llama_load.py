"""What river_gguf.Llama's constructor checks and loads before the engine: llama_cpp's arguments
that the engine cannot honour (refused), the numbers and flags it checks, and llama.cpp's own
vocabulary and metadata of the file (a vocab-only libllama model)."""
from typing import Any, Dict, List

import llama_cpp._logger as llama_logger
import numpy as np
from llama_cpp import _internals as internals
from llama_cpp import llama_cpp as lib
from llama_cpp._utils import suppress_stdout_stderr

from ._loader import native
from .options import is_int


#: llama_cpp constructor parameters that change what llama.cpp computes and that the engine
#: cannot honour: refused when given a non-default value. name -> default.
REFUSED = {
    "lora_base": None, "lora_path": None, "kv_overrides": None,
    "rope_scaling_type": lib.LLAMA_ROPE_SCALING_TYPE_UNSPECIFIED, "rope_freq_base": 0.0, "rope_freq_scale": 0.0,
    "yarn_ext_factor": -1.0, "yarn_attn_factor": 1.0, "yarn_beta_fast": 32.0, "yarn_beta_slow": 1.0,
    "yarn_orig_ctx": 0,
}


def refuse_unsupported(given: Dict[str, Any]) -> None:
    """llama_cpp arguments the engine cannot apply raise, where ignoring them would change the output."""
    for name, default in REFUSED.items():
        v = given[name]
        if v is not None and v != default and not (name == "rope_scaling_type" and v is None):
            raise NotImplementedError(
                f"river_gguf.Llama does not support {name}={v!r}: the river_gguf engine cannot apply it, and "
                "ignoring it would change the output. Bake it into the GGUF (merge the LoRA, edit the metadata) "
                "and load that file")


def check_numbers(n_ctx, n_batch, last_n_tokens_size, seed, flags: Dict[str, Any]) -> None:
    for name, v in flags.items():
        check_bool(name, v)
    if not is_int(n_ctx) or n_ctx < 0:
        raise ValueError(f"n_ctx must be an int >= 0 (0: the model's training context), got {n_ctx!r}")
    if not is_int(n_batch) or n_batch < 1:
        raise ValueError(f"n_batch must be an int >= 1, got {n_batch!r}")
    if not is_int(last_n_tokens_size) or last_n_tokens_size < -1:
        raise ValueError(f"last_n_tokens_size must be an int >= -1, got {last_n_tokens_size!r}")
    if not is_int(seed):
        raise ValueError(f"seed must be an int, got {seed!r}")


def load_vocab(model_path: str, verbose: bool):
    """llama.cpp's vocabulary and metadata of the file (a vocab-only LlamaModel): tokenizer,
    special tokens, chat templates, and the vocab pointer the grammar sampler needs."""
    params = lib.llama_model_default_params()
    params.vocab_only = True
    llama_logger.set_verbose(verbose)  # as llama_cpp.Llama: libllama's loader logs only when verbose
    # The engine's own checks first: libllama aborts the process on some malformed
    # vocabularies (a token with a NUL byte) that the engine refuses with GGUFFormatError.
    with suppress_stdout_stderr(disable=verbose):  # its warnings, as Model's load
        native.Vocab(model_path)
    try:
        model = internals.LlamaModel(path_model=model_path, params=params, verbose=verbose)
        # llama-cpp-python decodes every key and string value as UTF-8 (UnicodeDecodeError
        # is a ValueError too): a damaged file is named as such.
        return model, model.metadata()
    except ValueError as e:
        raise native.GGUFFormatError(f"libllama could not load {model_path}: {e}") from None


class ModelPathError(FileNotFoundError, ValueError):
    """The model file does not exist. A FileNotFoundError (river_gguf's promise) that is also the
    ValueError llama_cpp.Llama raises, so code written for either catches it."""


def check_bool(name: str, v) -> bool:
    if not isinstance(v, (bool, np.bool_)):
        raise ValueError(f"{name} must be a bool, got {v!r}")
    return bool(v)


def check_token_ids(tokens, n_vocab: int) -> List[int]:
    """Token ids as a list of ints in [0, n_vocab) (TypeError or ValueError else)."""
    if isinstance(tokens, (str, bytes, bytearray)) or not hasattr(tokens, "__iter__"):
        raise TypeError(f"tokens must be a sequence of int token ids, got {type(tokens).__name__}")
    out = list(tokens.tolist() if isinstance(tokens, np.ndarray) else tokens)
    for t in out:
        if not is_int(t):
            raise ValueError(f"token ids must be ints, got {t!r}")
        if not 0 <= t < n_vocab:
            # libllama aborts the process on an id outside the vocabulary.
            raise ValueError(f"token id {t} is outside the vocabulary [0, {n_vocab})")
    return [int(t) for t in out]


def n_ctx_train(metadata: Dict[str, str]) -> int:
    """The training context from the metadata (a vocab-only libllama model reports 0)."""
    value = metadata.get(f"{metadata.get('general.architecture', '')}.context_length", "")
    if not value.isdigit() or int(value) <= 0:
        raise ValueError("n_ctx=0 asks for the model's training context, but the file does not give one "
                         "(<arch>.context_length); pass n_ctx")
    return int(value)
