"""river_gguf.Llama: a drop-in for llama_cpp.Llama (llama-cpp-python 0.3.36) on the river_gguf engine.

    from river_gguf.llama import Llama          # instead of: from llama_cpp import Llama
    llm = Llama("model.river.gguf", n_ctx=2048, preset="fast")
    llm("Q: Name the planets. A:", max_tokens=32, stop=["Q:"])
    llm.create_chat_completion(messages=[...], response_format={"type": "json_object"})
    llm.last_stats                              # River statistics of the last call

What is llama_cpp's and what is ours:
  - The logits come from river_gguf's engine (a river_gguf.Model, `llm.river_model`), with
    River's early exit. Everything around them is llama.cpp's own: the tokenizer and metadata
    come from a vocab-only libllama model of the same file (`llm._model`, llama_cpp's
    LlamaModel, also the vocabulary the grammar sampler needs); sampling is libllama's sampler
    chain, built in llama_cpp's order (river_gguf.llama_sampling); grammars, JSON schemas
    (llama_cpp.llama_grammar.json_schema_to_gbnf) and chat handlers (templates, tools,
    functions) are llama_cpp's, called with this object as their `llama`.
  - The completion loop reproduces llama_cpp's observable behaviour: prompt tokens (BOS/EOS
    rules), max_tokens <= 0 or None meaning "until the context is full", the default seed
    sequence (each call without `seed` draws the next seed from the previous one), stop strings,
    the delay on incomplete UTF-8, stream chunk boundaries, logprobs/echo offsets and the
    prompt-prefix reuse of `generate`. Same logits, seed and parameters give the same text.

Constructor: llama_cpp's parameters are all accepted.
  - Used: model_path (None: the default SmolLM2 model), n_ctx (0: the model's training
    context), n_batch, n_threads, n_gpu_layers, main_gpu, use_mmap, flash_attn (default False, as in
    llama_cpp: same setting, same logits; True is faster, and what river-gguf's CLI and server
    use), seed, logits_all, vocab_only,
    embedding, pooling_type (none, mean, cls, last; unspecified: the file's, else none, as libllama),
    last_n_tokens_size, chat_format, chat_handler, tokenizer, spm_infill, verbose.
  - Accepted without effect, because they only tune llama.cpp's own context or memory and do
    not change results here: n_ubatch, n_threads_batch (the engine has one thread count:
    n_threads), split_mode, tensor_split, use_mlock, offload_kqv,
    op_offload, swa_full, no_perf, numa, type_k/type_v (the engine keeps its own KV
    type), draft_model (speculative decoding does not change the tokens),
    attention_type. Per call, tfs_z and penalize_nl are accepted and ignored, as in llama_cpp
    0.3.36.
  - Refused with NotImplementedError when set, because silently ignoring them would change the
    output: lora_path/lora_base, kv_overrides, rope_scaling_type, rope_freq_base/scale and the
    yarn_* overrides.
  - River exit options (keyword-only, passed to river_gguf.Model): river (a second GGUF as the
    exit river), preset, mode, threshold, min_exit_layer, exit_layer, river_head, prefill, tail;
    and gpu_memory, the GPU placement's budget (river_gguf.Model).
    create_completion, __call__, create_chat_completion and generate take the same options per
    call. Other unknown keyword arguments are ignored with a RuntimeWarning (llama_cpp ignores
    them silently).

Differences from llama_cpp.Llama (each for the reason given):
  - Per-call River statistics are in `last_stats` (prefill/decode tokens and tok/s, tokens
    reused from the KV cache, exit layers...), never in the OpenAI dicts.
  - save_state()/load_state(): the engine's KV cache cannot be copied out, so a state holds the
    tokens (and the logits llama_cpp keeps) and load_state recomputes the KV cache from them
    on the next evaluation. Restored text equals what the tokens give; in River mode the
    recomputed cache comes from a prompt pass, not from the decode steps that made it. A state
    saved by llama_cpp.Llama (raw llama.cpp KV bytes) is refused with ValueError.
  - logprobs also work with logits_all=False (llama_cpp raises ValueError): the call keeps the
    rows it needs. Log-probabilities have llama_cpp's types: numpy.float32 in a whole
    completion, Python floats in a stream's chunks (the server sends both as JSON numbers).
  - suffix: llama_cpp 0.3.36 builds infill prompts with token 0 as the FIM markers (its
    "TODO: Fix") and never appends the suffix. Here a vocabulary with FIM tokens gets a real
    prefix/suffix/middle prompt; otherwise the suffix is appended to the text, as documented.
  - logit_bias together with logits_processor: llama_cpp drops both (list.extend returns None);
    here both apply, the processors first.
  - sample() always builds a fresh chain from its arguments (llama_cpp reuses the chain of the
    last generate() once one ran). stopping_criteria receives the logits the token was sampled
    from (llama_cpp passes an unrelated, usually uninitialized row).
  - Argument errors of a streamed completion raise when it is created, not at the first next().
    A prompt without tokens ("" on a model that adds no BOS) raises ValueError (llama_cpp fails
    an assert). echo with a token-list prompt echoes its text (llama_cpp raises TypeError).
    A grammar may also be a GBNF string; one libllama cannot parse raises ValueError (llama_cpp
    hands libllama's NULL sampler on).
  - embed/create_embedding: the backbone's final-norm output, as llama.cpp's embeddings (no exit
    applies; they are the precise model's). Each input is its own pass. With pooling none and a
    list of inputs, llama_cpp 0.3.36 reads every input after the first at the wrong offset
    (`pos += size` counts tokens, not floats); here each input gets its own rows. Rank pooling
    (rerankers) raises NotImplementedError.
  - Not available: from_pretrained,
    LoRA, multimodal chat handlers (they drive llama.cpp's context directly, `llama._ctx`).
One Llama owns one KV cache: use it from one thread at a time (a server queues requests).
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import sys
import threading
import time
import uuid
import warnings
from collections import deque
from typing import Any, Dict, Iterator, List, Optional, Sequence, Union

import llama_cpp
import llama_cpp._logger as llama_logger
import llama_cpp.llama_chat_format as llama_chat_format
import numpy as np
from llama_cpp import _internals as internals
from llama_cpp._utils import suppress_stdout_stderr
from llama_cpp import llama_cpp as lib
from llama_cpp.llama import Llama as _LlamaCpp
from llama_cpp.llama import LlamaState, LogitsProcessorList, StoppingCriteriaList  # noqa: F401 (re-exported)
from llama_cpp.llama_grammar import LlamaGrammar
from llama_cpp.llama_tokenizer import LlamaTokenizer

from ._loader import native
from .chat import template_chat_handler
from .completion import Completion, cut_at_stop, utf8_wait
from .default_model import default_model_path
from .llama_sampling import SamplerChain, SamplingError, apply_processors, check_grammar, logit_bias_processor
from .model import Model
from .options import EXIT_FIELDS
from .options import NAMES as RIVER_NAMES
from .options import RiverOptions, is_int
from .results import exit_stats, lossless_stats
from .session import Session, common_prefix

__all__ = ["Llama", "LlamaGrammar", "LlamaState", "LogitsProcessorList", "StoppingCriteriaList",
           "ModelPathError"]

#: First bytes of a river_gguf state's `llama_state` (then the tokens as little-endian int32).
STATE_MAGIC = b"RIVERGGUF-STATE1"


#: llama_cpp constructor parameters that change what llama.cpp computes and that the engine
#: cannot honour: refused when given a non-default value. name -> default.
_REFUSED = {
    "lora_base": None, "lora_path": None, "kv_overrides": None,
    "rope_scaling_type": lib.LLAMA_ROPE_SCALING_TYPE_UNSPECIFIED, "rope_freq_base": 0.0, "rope_freq_scale": 0.0,
    "yarn_ext_factor": -1.0, "yarn_attn_factor": 1.0, "yarn_beta_fast": 32.0, "yarn_beta_slow": 1.0,
    "yarn_orig_ctx": 0,
}


def _refuse_unsupported(given: Dict[str, Any]) -> None:
    """llama_cpp arguments the engine cannot apply raise, where ignoring them would change the output."""
    for name, default in _REFUSED.items():
        v = given[name]
        if v is not None and v != default and not (name == "rope_scaling_type" and v is None):
            raise NotImplementedError(
                f"river_gguf.Llama does not support {name}={v!r}: the river_gguf engine cannot apply it, and "
                "ignoring it would change the output. Bake it into the GGUF (merge the LoRA, edit the metadata) "
                "and load that file")


def _check_numbers(n_ctx, n_batch, last_n_tokens_size, seed, flags: Dict[str, Any]) -> None:
    for name, v in flags.items():
        _bool(name, v)
    if not is_int(n_ctx) or n_ctx < 0:
        raise ValueError(f"n_ctx must be an int >= 0 (0: the model's training context), got {n_ctx!r}")
    if not is_int(n_batch) or n_batch < 1:
        raise ValueError(f"n_batch must be an int >= 1, got {n_batch!r}")
    if not is_int(last_n_tokens_size) or last_n_tokens_size < -1:
        raise ValueError(f"last_n_tokens_size must be an int >= -1, got {last_n_tokens_size!r}")
    if not is_int(seed):
        raise ValueError(f"seed must be an int, got {seed!r}")


def _load_vocab(model_path: str, verbose: bool):
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


def _stop_list(stop) -> List[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop):
        return list(stop)
    raise ValueError(f"stop must be a str or a list of str, got {stop!r}")


def _bool(name: str, v) -> bool:
    if not isinstance(v, (bool, np.bool_)):
        raise ValueError(f"{name} must be a bool, got {v!r}")
    return bool(v)


def _pick_draft(chain: SamplerChain, logits: np.ndarray, tokens: Optional[np.ndarray]) -> int:
    """A lossless draft drawn by a copy of the call's sampler chain (Model.draft's `pick`). In
    the same random state and history as the chain that will sample the backbone's row, it draws
    the same token wherever the river's distribution is the backbone's: a coupling that keeps
    sampled drafts accepted about as often as greedy ones against greedy text. The backbone's row
    is still what the real chain samples, so the text does not change. -1 (stop drafting) where
    the copy can draw nothing."""
    try:
        return chain.sample(logits) if tokens is None else chain.sample_from(tokens, logits)
    except SamplingError:
        return -1


@contextlib.contextmanager
def _draft_picker(chain: SamplerChain):
    """A round's draft picker: a clone of the chain in its current state samples the drafts, so
    they follow the sampler's randomness and penalties as far as the backbone's tokens do."""
    twin = chain.clone()
    try:
        yield functools.partial(_pick_draft, twin)
    finally:
        twin.close()


class _WithRiverOptions:
    """A Llama seen by llama_cpp's chat handler for one call: the handler calls create_completion
    with its own arguments, and the call's River options go down with them. Everything else is
    the Llama's."""

    def __init__(self, llama: "Llama", river_options: Dict[str, Any]):
        self._llama = llama
        self._river_options = river_options

    def create_completion(self, *args, **kwargs):
        return self._llama.create_completion(*args, **kwargs, **self._river_options)

    def __call__(self, *args, **kwargs):
        return self._llama(*args, **kwargs, **self._river_options)

    def __getattr__(self, name: str):
        return getattr(self._llama, name)


class Llama:
    """A drop-in for llama_cpp.Llama on river_gguf's engine (see the module docstring)."""

    def __init__(
        self,
        model_path: Optional[str] = None,
        *,
        # Model params
        n_gpu_layers: int = 0,
        split_mode: int = lib.LLAMA_SPLIT_MODE_LAYER,
        main_gpu: int = 0,
        tensor_split: Optional[List[float]] = None,
        vocab_only: bool = False,
        use_mmap: bool = True,
        use_mlock: bool = False,
        kv_overrides: Optional[Dict[str, Union[bool, int, float, str]]] = None,
        # Context params
        seed: int = lib.LLAMA_DEFAULT_SEED,
        n_ctx: int = 512,
        n_batch: int = 512,
        n_ubatch: int = 512,
        n_threads: Optional[int] = None,
        n_threads_batch: Optional[int] = None,
        rope_scaling_type: Optional[int] = lib.LLAMA_ROPE_SCALING_TYPE_UNSPECIFIED,
        pooling_type: int = lib.LLAMA_POOLING_TYPE_UNSPECIFIED,
        attention_type: int = lib.LLAMA_ATTENTION_TYPE_UNSPECIFIED,
        rope_freq_base: float = 0.0,
        rope_freq_scale: float = 0.0,
        yarn_ext_factor: float = -1.0,
        yarn_attn_factor: float = 1.0,
        yarn_beta_fast: float = 32.0,
        yarn_beta_slow: float = 1.0,
        yarn_orig_ctx: int = 0,
        logits_all: bool = False,
        embedding: bool = False,
        offload_kqv: bool = True,
        flash_attn: bool = False,
        op_offload: Optional[bool] = None,
        swa_full: Optional[bool] = None,
        # Sampling params
        no_perf: bool = False,
        last_n_tokens_size: int = 64,
        # LoRA params
        lora_base: Optional[str] = None,
        lora_scale: float = 1.0,
        lora_path: Optional[str] = None,
        # Backend params
        numa: Union[bool, int] = False,
        # Chat format params
        chat_format: Optional[str] = None,
        chat_handler: Optional[Any] = None,
        # Speculative decoding
        draft_model: Optional[Any] = None,
        # Tokenizer override
        tokenizer: Optional[Any] = None,
        # KV cache quantization
        type_k: Optional[int] = None,
        type_v: Optional[int] = None,
        # Misc
        spm_infill: bool = False,
        verbose: bool = True,
        # River (river_gguf.options.RiverOptions; its fields are taken as keyword arguments too)
        river_options: Optional[RiverOptions] = None,
        **kwargs,
    ):
        self._closed = True  # until the end of __init__: close() and __del__ tolerate a half-made object
        self._init_kwargs = {k: v for k, v in locals().items() if k not in ("self", "kwargs", "__class__")}
        self._init_kwargs.update(kwargs)
        ro = RiverOptions.of(river_options, **{k: kwargs.pop(k) for k in list(kwargs) if k in RIVER_NAMES})
        given = dict(lora_base=lora_base, lora_path=lora_path, kv_overrides=kv_overrides,
                     rope_scaling_type=rope_scaling_type, rope_freq_base=rope_freq_base,
                     rope_freq_scale=rope_freq_scale, yarn_ext_factor=yarn_ext_factor,
                     yarn_attn_factor=yarn_attn_factor, yarn_beta_fast=yarn_beta_fast,
                     yarn_beta_slow=yarn_beta_slow, yarn_orig_ctx=yarn_orig_ctx)
        _refuse_unsupported(given)
        if kwargs:
            warnings.warn(f"river_gguf.Llama: ignoring unknown keyword arguments {sorted(kwargs)}", RuntimeWarning,
                          stacklevel=2)
        self.verbose = _bool("verbose", verbose)
        _check_numbers(n_ctx=n_ctx, n_batch=n_batch, last_n_tokens_size=last_n_tokens_size, seed=seed,
                       flags=dict(logits_all=logits_all, embedding=embedding, vocab_only=vocab_only,
                                  spm_infill=spm_infill))

        if model_path is None:
            model_path = default_model_path()
        model_path = os.fsdecode(os.fspath(model_path))
        if not os.path.exists(model_path):
            raise ModelPathError(f"Model path does not exist: {model_path}")
        self.model_path = model_path
        self._lock = threading.RLock()

        self._model, self.metadata = _load_vocab(model_path, self.verbose)
        self.tokenizer_ = tokenizer or LlamaTokenizer(self)
        self._n_vocab = self._model.n_vocab()

        if n_ctx == 0:
            n_ctx = self._n_ctx_train()
        self.n_batch = min(n_ctx, n_batch)
        self.n_threads = n_threads or max((os.cpu_count() or 2) // 2, 1)
        self.n_threads_batch = n_threads_batch or (os.cpu_count() or 1)
        self._seed = seed or lib.LLAMA_DEFAULT_SEED
        self._logits_all = bool(logits_all)
        self._embedding = bool(embedding)
        self._pooling = self._resolve_pooling(pooling_type)
        self._vocab_only = bool(vocab_only)
        self.last_n_tokens_size = last_n_tokens_size
        self.spm_infill = bool(spm_infill)
        self.draft_model = draft_model
        self.lora_base, self.lora_path, self.lora_scale = lora_base, lora_path, lora_scale
        self.cache = None

        self.river_model = None
        if not self._vocab_only:
            self._load_engine(n_ctx, n_threads, n_gpu_layers, main_gpu, _bool("use_mmap", use_mmap),
                              _bool("flash_attn", flash_attn), ro)
        elif ro != RiverOptions():
            raise ValueError("River options need the engine; this Llama is vocab_only")
        self._n_ctx = n_ctx

        # llama_cpp's state: the evaluated tokens. They mirror what the session's KV cache holds
        # after every evaluation; a caller may lower n_tokens (reset) or load a state, and the
        # next evaluation makes the cache follow.
        self.n_tokens = 0
        self.input_ids = np.zeros((n_ctx,), dtype=np.intc)
        self._scores_buf: Optional[np.ndarray] = None
        self._session: Optional[Session] = None  # the decode cursor, for the exit options it runs
        self._requires_eval = True      # restored or truncated state must evaluate before sampling
        # A loaded state's rows (and its last row), read until the next evaluation.
        self._state_rows: Optional[np.ndarray] = None
        self._state_last: Optional[np.ndarray] = None
        self.last_stats: Dict[str, Any] = {}

        self.chat_format = chat_format
        self.chat_handler = chat_handler
        self._chat_handlers: Dict[str, Any] = {}
        self._setup_chat_handlers()
        self._closed = False
        if self.verbose:
            desc = "vocab only" if self.river_model is None else (
                f"n_ctx={n_ctx}, threads={self.n_threads}, exit options {self._default_opts}")
            print(f"river_gguf.Llama: {model_path} ({desc}); chat format {self.chat_format!r}", file=sys.stderr)

    def _load_engine(self, n_ctx, n_threads, n_gpu_layers, main_gpu, use_mmap, flash_attn, ro) -> None:
        """The engine. River options left None take the file's defaults (a River GGUF's preset)."""
        self.river_model = Model(self.model_path, n_ctx=n_ctx, n_threads=n_threads, n_batch=self.n_batch,
                                 n_gpu_layers=n_gpu_layers, main_gpu=main_gpu, use_mmap=use_mmap,
                                 flash_attn=flash_attn, verbose=self.verbose, river_options=ro)
        if self.river_model.n_vocab != self._n_vocab:
            raise ValueError(f"{self.model_path}: libllama's vocabulary has {self._n_vocab} tokens, the engine's "
                             f"{self.river_model.n_vocab}")
        self._lock = self.river_model.lock
        self._default_opts = self._resolve_options({})

    def _setup_chat_handlers(self) -> None:
        """llama_cpp's choice: a handler per chat template in the metadata; chat_format guessed
        from the default template, else that template itself, else "llama-2"."""
        eos_id, bos_id = self.token_eos(), self.token_bos()
        eos_token = self._model.token_get_text(eos_id) if eos_id != -1 else ""
        bos_token = self._model.token_get_text(bos_id) if bos_id != -1 else ""
        templates = {name[len("tokenizer."):]: t for name, t in self.metadata.items()
                     if name.startswith("tokenizer.chat_template.")}
        if "tokenizer.chat_template" in self.metadata:
            templates["chat_template.default"] = self.metadata["tokenizer.chat_template"]
        for name, template in templates.items():
            # llama_cpp's Jinja2ChatFormatter, rendered within chat.py's limits: templates come
            # from downloaded files.
            self._chat_handlers[name] = template_chat_handler(template, eos_token, bos_token, [eos_id])
        if self.chat_format is None and self.chat_handler is None and "chat_template.default" in templates:
            self.chat_format = (llama_chat_format.guess_chat_format_from_gguf_metadata(self.metadata)
                                or "chat_template.default")
        if self.chat_format is None and self.chat_handler is None:
            self.chat_format = "llama-2"

    # ----- state that llama_cpp exposes ---------------------------------------------------------
    @property
    def scores(self) -> np.ndarray:
        """Logits rows [n_ctx, n_vocab]; rows of evaluated tokens are filled when kept
        (logits_all=True, or a call with logprobs): the session's buffer of kept rows.
        Allocated on first use."""
        if self._scores_buf is None:
            self._scores_buf = (self._session.kept_rows(allocate=True) if self._session is not None
                                else np.zeros((self._n_ctx, self._n_vocab), dtype=np.single))
        return self._scores_buf

    @scores.setter
    def scores(self, value: np.ndarray) -> None:
        self._scores_buf = value

    @property
    def _input_ids(self) -> np.ndarray:
        return self.input_ids[: self.n_tokens]

    @property
    def _scores(self) -> np.ndarray:
        return self.scores[: self.n_tokens, :]

    @property
    def eval_tokens(self):
        return deque(self.input_ids[: self.n_tokens].tolist(), maxlen=self._n_ctx)

    @property
    def eval_logits(self):
        return deque(self.scores[: self._rows_valid(), :].tolist(), maxlen=self._n_ctx if self._logits_all else 1)

    @property
    def model(self):
        """libllama's llama_model pointer of the vocab-only model (vocabulary and metadata only;
        llama_cpp's `model` is the full model)."""
        return self._vocab().model

    @property
    def session(self) -> Optional[Session]:
        """The river_gguf Session whose KV cache this Llama decodes on (None before the first
        evaluation): what the cache holds and the exit options it ran under."""
        return self._session

    @property
    def exit_options(self):
        """The River exit options calls use by default (river_gguf.options.ExitOptions)."""
        self._require_engine()
        return self._default_opts

    # ----- vocabulary ------------------------------------------------------------------------
    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> List[int]:
        """Tokenize UTF-8 bytes (a str is encoded) with llama.cpp's tokenizer."""
        self._vocab()
        if isinstance(text, str):
            text = text.encode("utf-8")
        if not isinstance(text, (bytes, bytearray)):
            raise TypeError(f"text must be bytes (or str), got {type(text).__name__}")
        return self.tokenizer_.tokenize(bytes(text), _bool("add_bos", add_bos), _bool("special", special))

    def detokenize(self, tokens: List[int], prev_tokens: Optional[List[int]] = None, special: bool = False) -> bytes:
        """Token ids to bytes (llama.cpp's pieces; a leading BOS drops the first space)."""
        self._vocab()
        return self.tokenizer_.detokenize(self._check_tokens(tokens), prev_tokens=prev_tokens,
                                          special=_bool("special", special))

    def _check_tokens(self, tokens) -> List[int]:
        if isinstance(tokens, (str, bytes, bytearray)) or not hasattr(tokens, "__iter__"):
            raise TypeError(f"tokens must be a sequence of int token ids, got {type(tokens).__name__}")
        out = list(tokens.tolist() if isinstance(tokens, np.ndarray) else tokens)
        for t in out:
            if not is_int(t):
                raise ValueError(f"token ids must be ints, got {t!r}")
            if not 0 <= t < self._n_vocab:
                # libllama aborts the process on an id outside the vocabulary.
                raise ValueError(f"token id {t} is outside the vocabulary [0, {self._n_vocab})")
        return [int(t) for t in out]

    def tokenizer(self) -> LlamaTokenizer:
        return LlamaTokenizer(self)

    def n_ctx(self) -> int:
        return self._n_ctx

    def n_embd(self) -> int:
        if self.river_model is not None:
            return int(self.river_model.hparams["n_embd"])
        return int(self.metadata.get(f"{self.metadata.get('general.architecture', '')}.embedding_length", 0))

    def _n_ctx_train(self) -> int:
        """The training context from the metadata (a vocab-only libllama model reports 0)."""
        value = self.metadata.get(f"{self.metadata.get('general.architecture', '')}.context_length", "")
        if not value.isdigit() or int(value) <= 0:
            raise ValueError("n_ctx=0 asks for the model's training context, but the file does not give one "
                             "(<arch>.context_length); pass n_ctx")
        return int(value)

    def n_vocab(self) -> int:
        return self._n_vocab

    def token_bos(self) -> int:
        return self._vocab().token_bos()

    def token_eos(self) -> int:
        return self._vocab().token_eos()

    def token_nl(self) -> int:
        return self._vocab().token_nl()

    def _vocab(self):
        """llama_cpp's vocab-only LlamaModel of the file (RuntimeError once closed: its pointers
        are freed, and libllama would read freed memory)."""
        if self._model is None:
            raise RuntimeError("this Llama is closed")
        return self._model

    def pooling_type(self) -> int:
        return self._pooling

    def _is_eog(self, token: int) -> bool:
        return bool(lib.llama_vocab_is_eog(self._vocab().vocab, token))

    # ----- seeds, caches, state --------------------------------------------------------------
    def set_seed(self, seed: int) -> None:
        if not is_int(seed):
            raise ValueError(f"seed must be an int, got {seed!r}")
        self._seed = int(seed)

    def set_cache(self, cache) -> None:
        """A llama_cpp cache (LlamaRAMCache, LlamaDiskCache): completions load the longest cached
        prefix state and store their final state, as llama_cpp does."""
        self.cache = cache

    def reset(self) -> None:
        """Forget the evaluated tokens (the KV cache is reused or cleared at the next eval)."""
        self.n_tokens = 0
        self._requires_eval = True

    def save_state(self) -> LlamaState:
        """The evaluated tokens, their kept logits and the seed, as a llama_cpp LlamaState.
        `llama_state` holds the tokens (STATE_MAGIC + int32), not KV bytes: load_state
        recomputes the KV cache from them."""
        n = self.n_tokens
        rows = (self.scores[:n].copy() if n > 0 and self._rows_valid() >= n
                else np.zeros((0, self._n_vocab), dtype=np.single))
        blob = STATE_MAGIC + np.asarray(self.input_ids[:n], dtype="<i4").tobytes()
        state = LlamaState(input_ids=self.input_ids.copy(), scores=rows, n_tokens=n, llama_state=blob,
                           llama_state_size=len(blob), seed=self._seed)
        # The logits of the last position, so sample() works right after load_state as in llama_cpp.
        last = self._row_at(n - 1) if n > 0 else None
        state.river_last_logits = None if last is None else np.array(last, dtype=np.single)
        return state

    def load_state(self, state: LlamaState) -> None:
        blob = getattr(state, "llama_state", None)
        if not isinstance(blob, (bytes, bytearray)) or not bytes(blob).startswith(STATE_MAGIC):
            raise ValueError("this state was not saved by river_gguf.Llama.save_state (llama_cpp's states hold "
                             "llama.cpp KV bytes, which the river_gguf engine cannot load)")
        n = state.n_tokens
        if not is_int(n) or not 0 <= n <= self._n_ctx:
            raise ValueError(f"the state holds {n!r} tokens, which does not fit n_ctx={self._n_ctx}")
        tokens = np.frombuffer(bytes(blob)[len(STATE_MAGIC):], dtype="<i4")
        if len(tokens) != n:
            raise ValueError(f"corrupt state: {len(tokens)} stored tokens for n_tokens={n}")
        self._check_tokens(tokens)
        ids = np.zeros((self._n_ctx,), dtype=np.intc)
        src = np.asarray(state.input_ids, dtype=np.intc)
        m = min(len(src), self._n_ctx)
        ids[:m] = src[:m]
        ids[:n] = tokens
        self.input_ids = ids
        self.n_tokens = int(n)
        rows = np.asarray(state.scores)
        keep = n > 0 and rows.ndim == 2 and rows.shape == (n, self._n_vocab)
        self._state_rows = np.array(rows, dtype=np.single) if keep else None
        last = getattr(state, "river_last_logits", None)
        self._state_last = None if last is None else np.array(last, dtype=np.single)
        self._requires_eval = True
        self._seed = state.seed

    # ----- the engine ------------------------------------------------------------------------
    def _require_engine(self):
        if self._closed:
            raise RuntimeError("this Llama is closed")
        if self.river_model is None:
            raise RuntimeError("this Llama was created with vocab_only=True: it can tokenize but not evaluate")
        return self.river_model

    def _resolve_options(self, river_options: Dict[str, Any]):
        """Exit options of one call: the constructor's, with the call's overrides."""
        m = self._require_engine() if self.river_model is None else self.river_model
        unknown = sorted(set(river_options) - set(EXIT_FIELDS))
        if unknown:
            raise TypeError(f"unexpected keyword argument {unknown[0]!r} (River options per call are: "
                            f"{', '.join(EXIT_FIELDS)})")
        return m.options(**river_options)

    def _sync(self, opts, want_rows: bool) -> Session:
        """The session for `opts` (a new one, with an empty cache, when the exit options changed),
        holding no more than the evaluated tokens input_ids[:n_tokens]: llama_cpp's n_tokens
        says what the cache may be reused for."""
        s = self._session
        if s is None or s.options != opts:
            if s is not None:
                s.close()
            s = self._session = self.river_model.session(opts)
            self._scores_buf = None
        s.keep_rows = want_rows
        known = self.input_ids[: self.n_tokens].tolist()
        keep = common_prefix(s.tokens, known)
        if self._requires_eval:  # the last row must come from an evaluation, not a restored state
            keep = min(keep, max(self.n_tokens - 1, 0))
        s.truncate(keep)
        return s

    def _mirror(self) -> None:
        """input_ids and n_tokens follow the tokens the session's cache holds."""
        n, tail = self._session.changes()
        self.input_ids[n:n + len(tail)] = tail
        self.n_tokens = n + len(tail)
        self._requires_eval = False
        self._state_rows = self._state_last = None

    def _prefill(self, tokens: List[int], opts, want_rows: bool, count_afresh: bool = False) -> Session:
        """Evaluate `tokens` after the n_tokens evaluated (reusing what the cache holds of them)
        as a prompt batch. count_afresh: the session's counters start from this call (a
        generation's statistics)."""
        m = self._require_engine()
        n = self.n_tokens
        if n + len(tokens) > self._n_ctx:
            raise native.ContextOverflowError(
                f"{len(tokens)} new tokens after {n} evaluated need {n + len(tokens)} positions, "
                f"but n_ctx is {self._n_ctx}")
        with m.lock:
            s = self._sync(opts, want_rows)
            if count_afresh:
                s.reset_counters()
            s.prefill(self.input_ids[:n].tolist() + tokens, all_logits=want_rows)
            self._mirror()
        return s

    def eval(self, tokens: Sequence[int]) -> None:
        """Evaluate `tokens` after the n_tokens already evaluated. One token after others is a
        decode step, with River's exits live, exactly as in generate(); anything else is a prompt
        pass (River's prefill policy applies). Logits rows are kept when logits_all=True."""
        m = self._require_engine()
        toks = self._check_tokens(tokens)
        if not toks:
            return
        if len(toks) != 1 or self.n_tokens == 0:
            self._prefill(toks, self._default_opts, self._logits_all)
            return
        n = self.n_tokens
        if n + 1 > self._n_ctx:
            raise native.ContextOverflowError(f"1 new token after {n} evaluated needs {n + 1} positions, "
                                              f"but n_ctx is {self._n_ctx}")
        with m.lock:
            s = self._sync(self._default_opts, self._logits_all)
            s.prefill(self.input_ids[:n].tolist(), all_logits=self._logits_all, need_row=False)
            s.extend(toks, decode=True, all_logits=self._logits_all)
            self._mirror()

    def _rows_valid(self) -> int:
        return self._session.rows_valid() if self._session is not None else 0

    def _row_at(self, pos: int) -> Optional[np.ndarray]:
        """The logits row that follows position `pos`, or None when it was not kept."""
        if self._state_last is not None and pos == self.n_tokens - 1:
            return self._state_last
        if self._state_rows is not None and pos < len(self._state_rows):
            return self._state_rows[pos]
        if self._state_rows is None and self._state_last is None and self._session is not None:
            return self._session.row(pos)
        return None

    def _logits_row(self, idx: Optional[int]) -> np.ndarray:
        if self.n_tokens <= 0:
            raise RuntimeError("nothing has been evaluated: call eval() before sample()")
        pos = self.n_tokens - 1 if idx is None else idx
        if not is_int(pos) or not 0 <= pos < self.n_tokens:
            raise ValueError(f"idx must be an evaluated position in [0, {self.n_tokens}), got {idx!r}")
        row = self._row_at(pos)
        if row is None:
            raise ValueError(f"the logits of position {pos} were not kept: create the Llama with logits_all=True "
                             "to sample from any evaluated position")
        return row

    def _sample_row(self, chain: SamplerChain, logits: np.ndarray, processors, n_seen: Optional[int] = None) -> int:
        """Sample from `logits`, the row that follows the first n_seen tokens (default: all
        evaluated); logits processors see those tokens, as they do in llama_cpp."""
        if processors:
            seen = self.input_ids[: self.n_tokens if n_seen is None else n_seen]
            logits = apply_processors(processors, seen, np.array(logits, copy=True))
        return chain.sample(logits)

    def _chain(self, *, top_k, top_p, min_p, typical_p, temp, repeat_penalty, frequency_penalty, presence_penalty,
               mirostat_mode, mirostat_tau, mirostat_eta, grammar) -> SamplerChain:
        return SamplerChain(self._n_vocab, seed=self._seed, temp=temp, top_k=top_k, top_p=top_p, min_p=min_p,
                            typical_p=typical_p, repeat_penalty=repeat_penalty, frequency_penalty=frequency_penalty,
                            presence_penalty=presence_penalty, penalty_last_n=self.last_n_tokens_size,
                            mirostat_mode=mirostat_mode, mirostat_tau=mirostat_tau, mirostat_eta=mirostat_eta,
                            grammar=grammar, vocab=self._model.vocab)

    @staticmethod
    def _processors(logits_processor, logit_bias, n_vocab) -> list:
        procs = list(logits_processor) if logits_processor is not None else []
        for p in procs:
            if not callable(p):
                raise TypeError(f"logits_processor entries must be callables (input_ids, scores) -> scores, got {p!r}")
        if logit_bias:
            if not isinstance(logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict token id -> bias, got {logit_bias!r}")
            procs.append(logit_bias_processor(logit_bias, n_vocab))
        return procs

    def sample(self, top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05, typical_p: float = 1.0,
               temp: float = 0.80, repeat_penalty: float = 1.0, frequency_penalty: float = 0.0,
               presence_penalty: float = 0.0, tfs_z: float = 1.0, mirostat_mode: int = 0, mirostat_eta: float = 0.1,
               mirostat_tau: float = 5.0, penalize_nl: bool = True, logits_processor=None, grammar=None,
               idx: Optional[int] = None) -> int:
        """Sample one token from the logits of position `idx` (default: the last evaluated) with
        a fresh libllama chain of these parameters (seeded with the current seed)."""
        self._require_engine()
        logits = self._logits_row(idx)
        procs = self._processors(logits_processor, None, self._n_vocab)
        with self._chain(top_k=top_k, top_p=top_p, min_p=min_p, typical_p=typical_p, temp=temp,
                         repeat_penalty=repeat_penalty, frequency_penalty=frequency_penalty,
                         presence_penalty=presence_penalty, mirostat_mode=mirostat_mode, mirostat_tau=mirostat_tau,
                         mirostat_eta=mirostat_eta, grammar=grammar) as chain:
            return self._sample_row(chain, logits, procs)

    # ----- generation ------------------------------------------------------------------------
    def _stats(self, opts, cached: int) -> None:
        """last_stats from the session's counters of this call."""
        c = self._session.counters if self._session is not None else None
        if c is None:
            return
        stats = {
            "prompt_tokens_cached": cached,
            "prefill_tokens": c.prefill_tokens,
            "prefill_tok_s": c.prefill_tokens / c.prefill_s if c.prefill_s > 0 else 0.0,
            "decode_tokens": c.decode_tokens,
            "decode_tok_s": c.decode_tokens / c.decode_s if c.decode_s > 0 else 0.0,
            "mode": opts.label,
            "threshold": opts.threshold,
            "tail": opts.tail,
        }
        stats.update(exit_stats(c.exit_layers, self.river_model.n_layer, opts.tail))
        if opts.lossless:
            stats.update(lossless_stats(c.rounds, c.drafted, c.accepted, c.draft_s, c.verify_s),
                         draft_max=opts.draft_max, draft_p_min=opts.draft_p_min, draft_mode=opts.draft_mode,
                         ngram_rounds=c.ngram_rounds, ngram_drafted=c.ngram_drafted, ngram_accepted=c.ngram_accepted)
        self.last_stats = stats

    def _run(self, tokens: List[int], reset: bool, chain: SamplerChain, processors, stopping_criteria, opts,
             want_rows: bool):
        """llama_cpp's generate loop on the session: reuse the evaluated prefix, evaluate the
        prompt, then Session.decode with the sampler chain (and logits processors) choosing each
        token; tokens sent in are evaluated after the token they answer."""
        self._require_engine()
        if reset and self.n_tokens > 0:
            # Keep the evaluated tokens the prompt starts with: the session reuses them. The
            # last prompt token is evaluated again unless the cache ends there (its row is live).
            common = common_prefix(self.input_ids[: self.n_tokens].tolist(), tokens)
            if common == len(tokens) and self.n_tokens != len(tokens):
                common -= 1
            self.n_tokens = common
            tokens = tokens[common:]
        elif reset:
            self.reset()
        if not tokens and self.n_tokens == 0:
            raise ValueError("no tokens to evaluate")
        s = self._prefill(tokens, opts, want_rows, count_afresh=True)
        cached = s.n_past - s.counters.prefill_tokens
        # Logits processors change the rows the chain samples: drafts then stay greedy.
        pick = None if processors or chain.greedy or chain.has_grammar else functools.partial(_draft_picker, chain)

        def choose(row, seen):
            self._mirror()
            return self._sample_row(chain, row, processors, seen)

        try:
            while True:
                more = None
                steps = s.decode(choose, pick=pick)
                try:
                    for step in steps:
                        if stopping_criteria is not None and stopping_criteria(self.input_ids[:step.seen], step.row):
                            return
                        more = yield step.token
                        if more is not None:
                            break
                finally:
                    steps.close()
                    self._mirror()
                if more is None:
                    return
                # Tokens sent in follow the token they answer, in one prompt batch.
                self._prefill([step.token] + self._check_tokens(more), opts, want_rows)
        finally:
            self._stats(opts, cached)

    def generate(self, tokens: Sequence[int], top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05,
                 typical_p: float = 1.0, temp: float = 0.80, repeat_penalty: float = 1.0, reset: bool = True,
                 frequency_penalty: float = 0.0, presence_penalty: float = 0.0, tfs_z: float = 1.0,
                 mirostat_mode: int = 0, mirostat_tau: float = 5.0, mirostat_eta: float = 0.1,
                 penalize_nl: bool = True, logits_processor=None, stopping_criteria=None, grammar=None,
                 **river_options) -> Iterator[int]:
        """Generator of sampled tokens after `tokens` (llama_cpp.Llama.generate): the evaluated
        prefix shared with `tokens` is reused; send() a list of tokens to append to the next
        evaluation. Runs until the caller stops or the context is full (ContextOverflowError)."""
        self._require_engine()
        tokens = self._check_tokens(tokens)
        opts = self._resolve_options(river_options)
        procs = self._processors(logits_processor, None, self._n_vocab)
        chain = self._chain(top_k=top_k, top_p=top_p, min_p=min_p, typical_p=typical_p, temp=temp,
                            repeat_penalty=repeat_penalty, frequency_penalty=frequency_penalty,
                            presence_penalty=presence_penalty, mirostat_mode=mirostat_mode,
                            mirostat_tau=mirostat_tau, mirostat_eta=mirostat_eta, grammar=grammar)
        return self._generate(tokens, _bool("reset", reset), chain, procs, stopping_criteria, opts)

    def _generate(self, tokens, reset, chain, procs, stopping_criteria, opts):
        try:
            yield from self._run(tokens, reset, chain, procs, stopping_criteria, opts, self._logits_all)
        finally:
            chain.close()

    # ----- completions -----------------------------------------------------------------------
    def _completion_prompt(self, prompt, suffix) -> tuple:
        """Prompt tokens as llama_cpp builds them, and the text to append to the output (None,
        or the suffix when the vocabulary has no FIM tokens)."""
        is_list = not isinstance(prompt, str)
        if is_list:
            body = self._check_tokens(prompt)
        else:
            body = self.tokenize(prompt.encode("utf-8"), add_bos=False, special=suffix is None) if prompt else []
        cls_id, sep_id = self._model.token_cls(), self._model.token_sep()
        bos_id = cls_id if cls_id != -1 else self.token_bos()
        eos_id = sep_id if sep_id != -1 else self.token_eos()
        head = [] if (is_list and suffix is None) or not self._model.add_bos_token() or bos_id == -1 else [bos_id]
        tail = [] if (is_list and suffix is None) or (not self._model.add_eos_token() and sep_id == -1) else [eos_id]
        append = None
        if suffix is not None:
            vocab = self._model.vocab
            pre, suf, mid = (lib.llama_vocab_fim_pre(vocab), lib.llama_vocab_fim_suf(vocab),
                             lib.llama_vocab_fim_mid(vocab))
            if min(pre, suf, mid) >= 0:
                stoks = self.tokenize(suffix.encode("utf-8"), add_bos=False, special=False) if suffix else []
                body = ([suf] + stoks + [pre] + body + [mid]) if self.spm_infill else ([pre] + body + [suf] + stoks + [mid])
            else:
                append = suffix
        return head + body + tail, append

    def create_completion(
        self,
        prompt: Union[str, List[int]],
        suffix: Optional[str] = None,
        max_tokens: Optional[int] = 16,
        temperature: float = 0.8,
        top_p: float = 0.95,
        min_p: float = 0.05,
        typical_p: float = 1.0,
        logprobs: Optional[int] = None,
        echo: bool = False,
        stop: Optional[Union[str, List[str]]] = [],
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        repeat_penalty: float = 1.0,
        top_k: int = 40,
        stream: bool = False,
        seed: Optional[int] = None,
        tfs_z: float = 1.0,
        mirostat_mode: int = 0,
        mirostat_tau: float = 5.0,
        mirostat_eta: float = 0.1,
        model: Optional[str] = None,
        stopping_criteria=None,
        logits_processor=None,
        grammar=None,
        logit_bias: Optional[Dict[int, float]] = None,
        **river_options,
    ):
        """llama_cpp.Llama.create_completion: a completion dict, or with stream=True an iterator
        of chunk dicts. River options (mode=, threshold=, preset=, ...) apply to this call only;
        its statistics land in `last_stats`."""
        self._require_engine()
        if not isinstance(prompt, str):
            prompt = self._check_tokens(prompt)
        if suffix is not None and not isinstance(suffix, str):
            raise ValueError(f"suffix must be a str or None, got {suffix!r}")
        if max_tokens is not None and not is_int(max_tokens):
            raise ValueError(f"max_tokens must be an int or None, got {max_tokens!r}")
        if logprobs is not None and (not is_int(logprobs) or logprobs < 0):
            raise ValueError(f"logprobs must be an int >= 0 or None, got {logprobs!r}")
        if seed is not None and not is_int(seed):
            raise ValueError(f"seed must be an int or None, got {seed!r}")
        echo, stream = _bool("echo", echo), _bool("stream", stream)
        stops = _stop_list(stop)
        opts = self._resolve_options(river_options)
        procs = self._processors(logits_processor, logit_bias, self._n_vocab)
        if grammar is not None:
            check_grammar(self._model.vocab, grammar)
        # The chain checks its numbers now; the real one is built once the seed is drawn.
        self._chain(top_k=top_k, top_p=top_p, min_p=min_p, typical_p=typical_p, temp=temperature,
                    repeat_penalty=repeat_penalty, frequency_penalty=frequency_penalty,
                    presence_penalty=presence_penalty, mirostat_mode=mirostat_mode, mirostat_tau=mirostat_tau,
                    mirostat_eta=mirostat_eta, grammar=None).close()
        prompt_tokens, append = self._completion_prompt(prompt, suffix)
        if not prompt_tokens:
            raise ValueError("the prompt is empty: it has no tokens (and this model adds no BOS token)")
        if len(prompt_tokens) >= self._n_ctx:
            # A ValueError, as llama_cpp raises; its own class lets a caller tell it from bad arguments.
            raise native.ContextOverflowError(
                f"Requested tokens ({len(prompt_tokens)}) exceed context window of {self._n_ctx}")
        sampling = dict(top_k=top_k, top_p=top_p, min_p=min_p, typical_p=typical_p, temp=temperature,
                        repeat_penalty=repeat_penalty, frequency_penalty=frequency_penalty,
                        presence_penalty=presence_penalty, mirostat_mode=mirostat_mode, mirostat_tau=mirostat_tau,
                        mirostat_eta=mirostat_eta, grammar=grammar)
        chunks = self._completion(prompt, prompt_tokens, append, max_tokens, logprobs, echo, stops, stream, seed,
                                  model, stopping_criteria, procs, sampling, opts)
        if stream:
            return chunks
        with self._lock:  # a whole completion at a time (the state below is this object's)
            return next(chunks)

    def _completion(self, prompt, prompt_tokens, append, max_tokens, logprobs, echo, stops, stream, seed, model,
                    stopping_criteria, procs, sampling, opts):
        """The completion's chunks (or, without stream, its one dict): the generate loop's tokens
        handed to a Completion (river_gguf.completion), which turns them into text."""
        bos_id = self.token_bos()
        detok = self.detokenize
        done = Completion(f"cmpl-{uuid.uuid4()}", int(time.time()), model if model is not None else self.model_path,
                          detok, lambda i: self.scores[i], prompt, prompt_tokens, bos_id, stops, logprobs)
        if prompt_tokens[:2] == [bos_id] * 2:
            warnings.warn(f'Detected duplicate leading "{self._model.token_get_text(bos_id)}" in prompt, this will '
                          "likely reduce response quality, consider removing it...", RuntimeWarning)
        if max_tokens is None or max_tokens <= 0:
            max_tokens = self._n_ctx - len(prompt_tokens)  # until the context is full
        max_tokens = min(max_tokens, self._n_ctx - len(prompt_tokens))
        self._load_cached_state(prompt_tokens)
        self.set_seed(seed if seed is not None else random.Random(self._seed).randint(0, 2 ** 32))
        chain = self._chain(**sampling)

        finish_reason, text, wait = "length", b"", 0
        gen = self._run(prompt_tokens, True, chain, procs, stopping_criteria, opts,
                        self._logits_all or logprobs is not None)
        try:
            for token in gen:
                if self._is_eog(token):
                    text, finish_reason = detok(done.tokens), "stop"
                    break
                done.tokens.append(token)
                all_text = detok(done.tokens)
                wait = utf8_wait(all_text, wait)
                if wait > 0:
                    wait -= 1
                    continue
                cut = cut_at_stop(all_text, done.stops)
                if cut is not None:
                    text, finish_reason = cut, "stop"
                    break
                if stream:
                    yield from done.ready()
                if len(done.tokens) >= max_tokens:
                    text, finish_reason = detok(done.tokens), "length"
                    break
        finally:
            gen.close()
            chain.close()

        if stopping_criteria is not None and stopping_criteria(self._input_ids, self._row_at(self.n_tokens - 1)):
            text, finish_reason = detok(done.tokens), "stop"
        if self.last_stats:
            self.last_stats.update(completion_tokens=len(done.tokens), finish_reason=finish_reason)
        if stream:
            yield from done.rest(finish_reason)
        if self.cache:
            self.cache[prompt_tokens + done.tokens] = self.save_state()
        if not stream:
            yield done.whole(text, finish_reason, echo, append, self.n_tokens)

    def _load_cached_state(self, prompt_tokens: List[int]) -> None:
        """With a cache (set_cache): load the cached state that shares more of the prompt than
        the evaluated tokens do, as llama_cpp does."""
        if not self.cache:
            return
        try:
            item = self.cache[prompt_tokens]
        except KeyError:
            return
        if (_LlamaCpp.longest_token_prefix(item.input_ids.tolist(), prompt_tokens)
                > _LlamaCpp.longest_token_prefix(self._input_ids.tolist(), prompt_tokens)):
            self.load_state(item)

    def __call__(self, prompt: Union[str, List[int]], suffix: Optional[str] = None, max_tokens: Optional[int] = 16,
                 temperature: float = 0.8, top_p: float = 0.95, min_p: float = 0.05, typical_p: float = 1.0,
                 logprobs: Optional[int] = None, echo: bool = False, stop: Optional[Union[str, List[str]]] = [],
                 frequency_penalty: float = 0.0, presence_penalty: float = 0.0, repeat_penalty: float = 1.0,
                 top_k: int = 40, stream: bool = False, seed: Optional[int] = None, tfs_z: float = 1.0,
                 mirostat_mode: int = 0, mirostat_tau: float = 5.0, mirostat_eta: float = 0.1,
                 model: Optional[str] = None, stopping_criteria=None, logits_processor=None, grammar=None,
                 logit_bias: Optional[Dict[int, float]] = None, **river_options):
        """create_completion (llama_cpp.Llama.__call__)."""
        return self.create_completion(
            prompt=prompt, suffix=suffix, max_tokens=max_tokens, temperature=temperature, top_p=top_p, min_p=min_p,
            typical_p=typical_p, logprobs=logprobs, echo=echo, stop=stop, frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty, repeat_penalty=repeat_penalty, top_k=top_k, stream=stream, seed=seed,
            tfs_z=tfs_z, mirostat_mode=mirostat_mode, mirostat_tau=mirostat_tau, mirostat_eta=mirostat_eta,
            model=model, stopping_criteria=stopping_criteria, logits_processor=logits_processor, grammar=grammar,
            logit_bias=logit_bias, **river_options)

    # ----- chat ------------------------------------------------------------------------------
    def create_chat_completion(
        self,
        messages: List[Dict[str, Any]],
        functions: Optional[List[Dict[str, Any]]] = None,
        function_call=None,
        tools: Optional[List[Dict[str, Any]]] = None,
        tool_choice=None,
        temperature: float = 0.2,
        top_p: float = 0.95,
        top_k: int = 40,
        min_p: float = 0.05,
        typical_p: float = 1.0,
        stream: bool = False,
        stop: Optional[Union[str, List[str]]] = [],
        seed: Optional[int] = None,
        response_format: Optional[Dict[str, Any]] = None,
        max_tokens: Optional[int] = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repeat_penalty: float = 1.0,
        tfs_z: float = 1.0,
        mirostat_mode: int = 0,
        mirostat_tau: float = 5.0,
        mirostat_eta: float = 0.1,
        model: Optional[str] = None,
        logits_processor=None,
        grammar=None,
        logit_bias: Optional[Dict[int, float]] = None,
        logprobs: Optional[bool] = None,
        top_logprobs: Optional[int] = None,
        **river_options,
    ):
        """llama_cpp.Llama.create_chat_completion through llama_cpp's chat handlers (the file's
        chat template, a named chat_format such as "chatml-function-calling", or chat_handler).

        response_format: {"type": "json_object"} (optionally with "schema"), handled by
        llama_cpp's handler; and {"type": "json_schema", "json_schema": {"schema": {...}}} (the
        OpenAI form, which llama_cpp 0.3.36 ignores), turned into a grammar here with
        llama_cpp.llama_grammar.json_schema_to_gbnf. River options apply to every completion the
        handler makes."""
        self._require_engine()
        if not isinstance(messages, list):
            raise ValueError(f"messages must be a list of message dicts, got {type(messages).__name__}")
        if isinstance(response_format, dict) and response_format.get("type") == "json_schema":
            spec = response_format.get("json_schema") or {}
            schema = spec.get("schema", response_format.get("schema")) if isinstance(spec, dict) else None
            if schema is None:
                raise ValueError('response_format {"type": "json_schema"} needs a schema: '
                                 '{"type": "json_schema", "json_schema": {"schema": {...}}}')
            if grammar is None:
                grammar = LlamaGrammar.from_json_schema(json.dumps(schema), verbose=self.verbose)
            response_format = None
        elif response_format is not None and (not isinstance(response_format, dict) or "type" not in response_format):
            raise ValueError(f'response_format must be a dict with a "type", got {response_format!r}')
        self._resolve_options(river_options)  # unknown or bad options raise before the handler runs
        handler = (self.chat_handler or self._chat_handlers.get(self.chat_format)
                   or llama_chat_format.get_chat_completion_handler(self.chat_format))
        return handler(
            llama=_WithRiverOptions(self, river_options) if river_options else self, messages=messages,
            functions=functions, function_call=function_call, tools=tools, tool_choice=tool_choice,
            temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, typical_p=typical_p, logprobs=logprobs,
            top_logprobs=top_logprobs, stream=stream, stop=stop, seed=seed, response_format=response_format,
            max_tokens=max_tokens, presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
            repeat_penalty=repeat_penalty, tfs_z=tfs_z, mirostat_mode=mirostat_mode, mirostat_tau=mirostat_tau,
            mirostat_eta=mirostat_eta, model=model, logits_processor=logits_processor, grammar=grammar,
            logit_bias=logit_bias)

    def create_chat_completion_openai_v1(self, *args: Any, **kwargs: Any):
        """create_chat_completion as openai.types.chat objects (needs the openai package)."""
        try:
            from openai.types.chat import ChatCompletion, ChatCompletionChunk
        except ImportError:
            raise ImportError("To use create_chat_completion_openai_v1, you must install the openai package. "
                              "You can install it with `pip install openai`.") from None
        if kwargs.get("stream", False):
            return (ChatCompletionChunk(**chunk) for chunk in self.create_chat_completion(*args, **kwargs))
        return ChatCompletion(**self.create_chat_completion(*args, **kwargs))

    # ----- embeddings --------------------------------------------------------------------------
    _POOLINGS = (lib.LLAMA_POOLING_TYPE_NONE, lib.LLAMA_POOLING_TYPE_MEAN, lib.LLAMA_POOLING_TYPE_CLS,
                 lib.LLAMA_POOLING_TYPE_LAST)

    def _resolve_pooling(self, pooling_type) -> int:
        """libllama's rule: an unspecified pooling is the file's `{arch}.pooling_type`, else none."""
        if not is_int(pooling_type):
            raise ValueError(f"pooling_type must be an int (llama_pooling_type), got {pooling_type!r}")
        p = int(pooling_type)
        if p == lib.LLAMA_POOLING_TYPE_UNSPECIFIED:
            arch = self.metadata.get("general.architecture", "")
            try:
                p = int(self.metadata.get(f"{arch}.pooling_type", lib.LLAMA_POOLING_TYPE_NONE))
            except ValueError:
                raise native.GGUFFormatError(f"{self.model_path}: {arch}.pooling_type is not an integer") from None
        if p == lib.LLAMA_POOLING_TYPE_RANK:
            if self._embedding:
                raise NotImplementedError("river_gguf.Llama does not do rank pooling (a reranker's classifier head)")
        elif p not in self._POOLINGS:
            raise ValueError(f"unknown pooling_type {p} (none 0, mean 1, cls 2, last 3, rank 4)")
        return p

    def _pool(self, rows: np.ndarray, normalize: bool):
        if self._pooling == lib.LLAMA_POOLING_TYPE_NONE:
            out = rows
        elif self._pooling == lib.LLAMA_POOLING_TYPE_MEAN:
            out = rows.mean(axis=0, dtype=np.float32)[None]
        elif self._pooling == lib.LLAMA_POOLING_TYPE_CLS:
            out = rows[:1]
        else:  # LAST
            out = rows[-1:]
        if normalize:
            norms = np.linalg.norm(out.astype(np.float64), axis=1, keepdims=True)
            out = np.where(norms > 0, out / np.where(norms > 0, norms, 1.0), out)
        lists = [[float(v) for v in r] for r in out]
        return lists if self._pooling == lib.LLAMA_POOLING_TYPE_NONE else lists[0]

    def create_embedding(self, input: Union[str, List[str]], model: Optional[str] = None):
        """OpenAI-style embeddings of a string or a list of strings (llama_cpp's response)."""
        inputs = input if isinstance(input, list) else [input]
        embeds, total_tokens = self.embed(inputs, return_count=True)
        return {
            "object": "list",
            "data": [{"object": "embedding", "embedding": e, "index": i} for i, e in enumerate(embeds)],
            "model": model if model is not None else self.model_path,
            "usage": {"prompt_tokens": total_tokens, "total_tokens": total_tokens},
        }

    def embed(self, input: Union[str, List[str]], normalize: bool = False, truncate: bool = True,
              return_count: bool = False):
        """Embeddings of a string (or of each string of a list): with pooling none, one list of
        n_embd floats per token; otherwise one per input. normalize: unit L2 norm. truncate: keep
        the first n_batch tokens (else more raise ValueError). The KV cache is cleared."""
        if not self._embedding:
            raise RuntimeError("Llama model must be created with embedding=True to call this method")
        inputs = [input] if isinstance(input, str) else input
        if not isinstance(inputs, list) or not all(isinstance(t, str) for t in inputs):
            raise TypeError("input must be a str or a list of str")
        normalize, truncate = _bool("normalize", normalize), _bool("truncate", truncate)
        m = self._require_engine()
        data, total_tokens = [], 0
        with self._lock:
            for text in inputs:
                tokens = self.tokenize(text.encode("utf-8"))
                if truncate:
                    tokens = tokens[:self.n_batch]
                if len(tokens) > self.n_batch:
                    raise ValueError(f"Requested tokens ({len(tokens)}) exceed batch size of {self.n_batch}")
                if not tokens:
                    raise ValueError(f"no tokens to embed in {text!r}")
                total_tokens += len(tokens)
                data.append(self._pool(m.embed(tokens), normalize))
            self.reset()
        output = data[0] if isinstance(input, str) else data
        return (output, total_tokens) if return_count else output

    @classmethod
    def from_pretrained(cls, repo_id: str, filename: Optional[str], **kwargs):
        raise NotImplementedError("river_gguf.Llama.from_pretrained is not available: download the GGUF "
                                  "(huggingface_hub.hf_hub_download) and pass its path as model_path")

    logits_to_logprobs = staticmethod(_LlamaCpp.logits_to_logprobs)
    longest_token_prefix = staticmethod(_LlamaCpp.longest_token_prefix)

    # ----- lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        """Free the engine and the vocabulary now (later calls raise RuntimeError)."""
        if getattr(self, "_closed", True) and getattr(self, "_model", None) is None:
            return
        self._closed = True
        self._session = None  # it holds the engine too
        self.river_model = None  # the engine goes with its last reference
        model, self._model = getattr(self, "_model", None), None
        if model is not None:
            model.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __enter__(self) -> "Llama":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getstate__(self):
        return dict(self._init_kwargs)

    def __setstate__(self, state):
        kwargs = dict(state)
        self.__init__(**kwargs)
