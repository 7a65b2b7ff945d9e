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

Its constructor's parameters (used, accepted without effect, refused) and each difference from
llama_cpp.Llama, with its reason: docs/usage.md, "The drop-in Llama". The rooms around this class:
llama_load (the constructor's checks and libllama's vocab-only model), llama_chat (chat handlers,
response_format), llama_sampling and llama_draft (libllama's sampler chain, and drafts drawn by
it), completion (stop strings, UTF-8 holdback, logprobs, OpenAI dicts), llama_state (saved
states), llama_embed (pooling).
One Llama decodes one sequence of its Model's KV cache: use it from one thread at a time.
`slots(n)` gives n Llama objects over one loaded model, slot i decoding sequence i, for a thread
each: their decode steps share each step's batch (river_gguf.batching).
"""
from __future__ import annotations

import functools
import os
import random
import sys
import threading
import time
import uuid
import warnings
import weakref
from collections import deque
from typing import Any, Dict, Iterator, List, Optional, Sequence, Union

import llama_cpp.llama_chat_format as llama_chat_format
import numpy as np
from llama_cpp import llama_cpp as lib
from llama_cpp.llama import Llama as _LlamaCpp
from llama_cpp.llama import LlamaState, LogitsProcessorList, StoppingCriteriaList  # noqa: F401 (re-exported)
from llama_cpp.llama_grammar import LlamaGrammar
from llama_cpp.llama_tokenizer import LlamaTokenizer

from ._loader import native
from .completion import Completion, cut_at_stop, stop_list, utf8_wait
from .default_model import default_model_path
from .llama_chat import WithRiverOptions, as_openai_v1, chat_handlers, schema_grammar
from .llama_draft import draft_picker
from . import llama_state
from .llama_embed import embedding_response, embedding_tokens, pool, resolve_pooling
from .llama_load import (ModelPathError, check_bool, check_numbers, check_token_ids, load_vocab, n_ctx_train,
                         refuse_unsupported)
from .llama_state import STATE_MAGIC  # noqa: F401 (re-exported)
from .llama_params import call_stats, check_completion_args, logits_processors
from .llama_prompt import completion_prompt
from .llama_sampling import SamplerChain, apply_processors, check_grammar
from .model import Model
from .options import EXIT_FIELDS
from .options import NAMES as RIVER_NAMES
from .options import RiverOptions, is_int
from .session import Session, common_prefix

__all__ = ["Llama", "LlamaGrammar", "LlamaState", "LogitsProcessorList", "StoppingCriteriaList",
           "ModelPathError"]



class Llama:
    """A drop-in for llama_cpp.Llama on river_gguf's engine (see the module docstring)."""

    _seq = 0                              # the sequence of the Model's KV cache this object decodes
    _slot_of: Optional["Llama"] = None    # for a slot (slots()), the Llama that made it (kept alive)
    _slots: tuple = ()                    # weak references to the slots this Llama made, closed with it

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
        refuse_unsupported(self._init_kwargs)
        if kwargs:
            warnings.warn(f"river_gguf.Llama: ignoring unknown keyword arguments {sorted(kwargs)}", RuntimeWarning,
                          stacklevel=2)
        self.verbose = check_bool("verbose", verbose)
        check_numbers(n_ctx=n_ctx, n_batch=n_batch, last_n_tokens_size=last_n_tokens_size, seed=seed,
                       flags=dict(logits_all=logits_all, embedding=embedding, vocab_only=vocab_only,
                                  spm_infill=spm_infill))

        if model_path is None:
            model_path = default_model_path()
        model_path = os.fsdecode(os.fspath(model_path))
        if not os.path.exists(model_path):
            raise ModelPathError(f"Model path does not exist: {model_path}")
        self.model_path = model_path
        self._lock = threading.RLock()

        self._model, self.metadata = load_vocab(model_path, self.verbose)
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
        self._pooling = resolve_pooling(pooling_type, self.metadata, model_path, self._embedding)
        self._vocab_only = bool(vocab_only)
        self.last_n_tokens_size = last_n_tokens_size
        self.spm_infill = bool(spm_infill)
        self.draft_model = draft_model
        self.lora_base, self.lora_path, self.lora_scale = lora_base, lora_path, lora_scale
        self.cache = None

        self.river_model = None
        if not self._vocab_only:
            self._load_engine(n_ctx, n_threads, n_gpu_layers, main_gpu, check_bool("use_mmap", use_mmap),
                              check_bool("flash_attn", flash_attn), ro)
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

        self.chat_handler = chat_handler
        self._chat_handlers, self.chat_format = chat_handlers(self._model, self.metadata, self.token_eos(),
                                                              self.token_bos(), chat_format, chat_handler)
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
        return self.tokenizer_.tokenize(bytes(text), check_bool("add_bos", add_bos), check_bool("special", special))

    def detokenize(self, tokens: List[int], prev_tokens: Optional[List[int]] = None, special: bool = False) -> bytes:
        """Token ids to bytes (llama.cpp's pieces; a leading BOS drops the first space)."""
        self._vocab()
        return self.tokenizer_.detokenize(self._check_tokens(tokens), prev_tokens=prev_tokens,
                                          special=check_bool("special", special))

    def _check_tokens(self, tokens) -> List[int]:
        return check_token_ids(tokens, self._n_vocab)

    def tokenizer(self) -> LlamaTokenizer:
        return LlamaTokenizer(self)

    def n_ctx(self) -> int:
        return self._n_ctx

    def n_embd(self) -> int:
        if self.river_model is not None:
            return int(self.river_model.hparams["n_embd"])
        return int(self.metadata.get(f"{self.metadata.get('general.architecture', '')}.embedding_length", 0))

    def _n_ctx_train(self) -> int:
        return n_ctx_train(self.metadata)

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
        rows = self.scores[:n] if n > 0 and self._rows_valid() >= n else None
        return llama_state.save(self.input_ids, n, rows, self._row_at(n - 1) if n > 0 else None, self._seed,
                                self._n_vocab)

    def load_state(self, state: LlamaState) -> None:
        """A state from save_state: its tokens are evaluated again at the next evaluation (a
        state of llama_cpp.Llama, raw llama.cpp KV bytes, raises ValueError)."""
        r = llama_state.restore(state, self._n_ctx, self._n_vocab, self._check_tokens)
        self.input_ids, self.n_tokens = r.input_ids, r.n_tokens
        self._state_rows, self._state_last = r.rows, r.last_row
        self._requires_eval = True
        self._seed = r.seed

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
            s = self._session = self.river_model.session(opts, seq=self._seq)
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

    def sample(self, top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05, typical_p: float = 1.0,
               temp: float = 0.80, repeat_penalty: float = 1.0, frequency_penalty: float = 0.0,
               presence_penalty: float = 0.0, tfs_z: float = 1.0, mirostat_mode: int = 0, mirostat_eta: float = 0.1,
               mirostat_tau: float = 5.0, penalize_nl: bool = True, logits_processor=None, grammar=None,
               idx: Optional[int] = None) -> int:
        """Sample one token from the logits of position `idx` (default: the last evaluated) with
        a fresh libllama chain of these parameters (seeded with the current seed)."""
        self._require_engine()
        logits = self._logits_row(idx)
        procs = logits_processors(logits_processor, None, self._n_vocab)
        with self._chain(top_k=top_k, top_p=top_p, min_p=min_p, typical_p=typical_p, temp=temp,
                         repeat_penalty=repeat_penalty, frequency_penalty=frequency_penalty,
                         presence_penalty=presence_penalty, mirostat_mode=mirostat_mode, mirostat_tau=mirostat_tau,
                         mirostat_eta=mirostat_eta, grammar=grammar) as chain:
            return self._sample_row(chain, logits, procs)

    # ----- generation ------------------------------------------------------------------------
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
        pick = None if processors or chain.greedy or chain.has_grammar else functools.partial(draft_picker, chain)

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
            if self._session is not None:
                self.last_stats = call_stats(self._session.counters, opts, self.river_model.n_layer, cached)

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
        procs = logits_processors(logits_processor, None, self._n_vocab)
        chain = self._chain(top_k=top_k, top_p=top_p, min_p=min_p, typical_p=typical_p, temp=temp,
                            repeat_penalty=repeat_penalty, frequency_penalty=frequency_penalty,
                            presence_penalty=presence_penalty, mirostat_mode=mirostat_mode,
                            mirostat_tau=mirostat_tau, mirostat_eta=mirostat_eta, grammar=grammar)
        return self._generate(tokens, check_bool("reset", reset), chain, procs, stopping_criteria, opts)

    def _generate(self, tokens, reset, chain, procs, stopping_criteria, opts):
        try:
            yield from self._run(tokens, reset, chain, procs, stopping_criteria, opts, self._logits_all)
        finally:
            chain.close()

    # ----- completions -----------------------------------------------------------------------
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
        check_completion_args(suffix, max_tokens, logprobs, seed)
        echo, stream = check_bool("echo", echo), check_bool("stream", stream)
        stops = stop_list(stop)
        opts = self._resolve_options(river_options)
        procs = logits_processors(logits_processor, logit_bias, self._n_vocab)
        if grammar is not None:
            check_grammar(self._model.vocab, grammar)
        sampling = dict(top_k=top_k, top_p=top_p, min_p=min_p, typical_p=typical_p, temp=temperature,
                        repeat_penalty=repeat_penalty, frequency_penalty=frequency_penalty,
                        presence_penalty=presence_penalty, mirostat_mode=mirostat_mode, mirostat_tau=mirostat_tau,
                        mirostat_eta=mirostat_eta, grammar=grammar)
        self._chain(**{**sampling, "grammar": None}).close()  # its numbers checked now; the real chain once seeded
        prompt_tokens, append = completion_prompt(self._model, self.tokenize, prompt, suffix, self.spm_infill)
        if not prompt_tokens:
            raise ValueError("the prompt is empty: it has no tokens (and this model adds no BOS token)")
        if len(prompt_tokens) >= self._n_ctx:
            # A ValueError, as llama_cpp raises; its own class lets a caller tell it from bad arguments.
            raise native.ContextOverflowError(
                f"Requested tokens ({len(prompt_tokens)}) exceed context window of {self._n_ctx}")
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
        response_format, grammar = schema_grammar(response_format, grammar, self.verbose)
        self._resolve_options(river_options)  # unknown or bad options raise before the handler runs
        handler = (self.chat_handler or self._chat_handlers.get(self.chat_format)
                   or llama_chat_format.get_chat_completion_handler(self.chat_format))
        return handler(
            llama=WithRiverOptions(self, river_options) if river_options else self, messages=messages,
            functions=functions, function_call=function_call, tools=tools, tool_choice=tool_choice,
            temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, typical_p=typical_p, logprobs=logprobs,
            top_logprobs=top_logprobs, stream=stream, stop=stop, seed=seed, response_format=response_format,
            max_tokens=max_tokens, presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
            repeat_penalty=repeat_penalty, tfs_z=tfs_z, mirostat_mode=mirostat_mode, mirostat_tau=mirostat_tau,
            mirostat_eta=mirostat_eta, model=model, logits_processor=logits_processor, grammar=grammar,
            logit_bias=logit_bias)

    def create_chat_completion_openai_v1(self, *args: Any, **kwargs: Any):
        """create_chat_completion as openai.types.chat objects (needs the openai package)."""
        return as_openai_v1(self.create_chat_completion(*args, **kwargs), kwargs.get("stream", False))

    # ----- embeddings --------------------------------------------------------------------------
    def create_embedding(self, input: Union[str, List[str]], model: Optional[str] = None):
        """OpenAI-style embeddings of a string or a list of strings (llama_cpp's response)."""
        embeds, total_tokens = self.embed(input if isinstance(input, list) else [input], return_count=True)
        return embedding_response(embeds, total_tokens, model if model is not None else self.model_path)

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
        normalize, truncate = check_bool("normalize", normalize), check_bool("truncate", truncate)
        m = self._require_engine()
        data, total_tokens = [], 0
        with self._lock:
            for text in inputs:
                tokens = embedding_tokens(self.tokenize(text.encode("utf-8")), text, self.n_batch, truncate)
                total_tokens += len(tokens)
                data.append(pool(m.embed(tokens), self._pooling, normalize))
            self.reset()
        output = data[0] if isinstance(input, str) else data
        return (output, total_tokens) if return_count else output

    @classmethod
    def from_pretrained(cls, repo_id: str, filename: Optional[str], **kwargs):
        raise NotImplementedError("river_gguf.Llama.from_pretrained is not available: download the GGUF "
                                  "(huggingface_hub.hf_hub_download) and pass its path as model_path")

    logits_to_logprobs = staticmethod(_LlamaCpp.logits_to_logprobs)
    longest_token_prefix = staticmethod(_LlamaCpp.longest_token_prefix)

    # ----- slots: several sequences of one loaded model --------------------------------------
    def slots(self, n: int, n_ctx: Optional[int] = None) -> List["Llama"]:
        """n Llama objects sharing this one's loaded model (engine, KV cache, vocabulary, chat
        handlers), slot i decoding sequence i of the KV cache, for a thread each. n_ctx: the
        most positions one slot's prompt and reply may take (default: this object's n_ctx, the
        whole cache, which the slots share). Each keeps a
        Llama's one-sequence behaviour (completions, chat, streaming, stop strings, sampling,
        prefix reuse within its own sequence); run from several threads at once, their decode
        steps are evaluated together in one batch. Slot 0 shares sequence 0 with this object
        (using both displaces one another, which costs re-evaluation, not correctness). A slot in
        lossless mode drafts and verifies on its own sequence, each round alone under the Model's
        lock (its verify batch is not joined with the other slots' steps). The slots are closed
        with this object; closing a slot frees its sequence's rows."""
        self._require_engine()
        if self._slot_of is not None:
            raise ValueError("a slot makes no slots: call slots() on the Llama that loaded the model")
        if not is_int(n) or not 1 <= n <= self._n_ctx:
            raise ValueError(f"n must be an int in [1, n_ctx={self._n_ctx}], got {n!r}")
        if n_ctx is None:
            n_ctx = self._n_ctx
        if not is_int(n_ctx) or not 1 <= n_ctx <= self._n_ctx:
            raise ValueError(f"n_ctx must be an int in [1, {self._n_ctx}], got {n_ctx!r}")
        made = [self._slot(i) for i in range(int(n))]
        for slot in made:
            slot._n_ctx = int(n_ctx)
        self._slots = self._slots + tuple(weakref.ref(s) for s in made)  # no cycle: a slot keeps its maker
        return made

    def _slot(self, seq: int) -> "Llama":
        """A copy of this object with a state of its own, on sequence `seq`."""
        # Not copy.copy: pickling (__getstate__) makes a Llama load its model again.
        slot = object.__new__(type(self))
        slot.__dict__.update(self.__dict__)
        slot._seq, slot._slot_of, slot._slots = seq, self, ()
        slot._lock = threading.RLock()  # its completions, not the Model's lock: the slots decode at once
        slot.cache, slot.last_stats = None, {}
        slot.n_tokens, slot.input_ids = 0, np.zeros_like(self.input_ids)
        slot._scores_buf = slot._session = slot._state_rows = slot._state_last = None
        slot._requires_eval = True
        return slot

    # ----- lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        """Free the engine and the vocabulary now (later calls raise RuntimeError); a slot frees
        its sequence, and the Llama that made slots closes them too."""
        if getattr(self, "_closed", True) and getattr(self, "_model", None) is None:
            return
        self._closed = True
        for ref in self._slots:
            slot = ref()
            if slot is not None:
                slot.close()
        if self._slot_of is not None:
            session, self._session = self._session, None
            if session is not None:
                session.close()
            self.river_model = self._model = None  # the loaded model stays its maker's
            return
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
