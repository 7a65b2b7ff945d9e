"""The high-level model: load a GGUF (optionally with a river), tokenize, score, generate.

Threads: every call that runs the engine holds the Model's lock (see the Model docstring).
"""
import functools
import os
import threading
from collections.abc import Sequence as _SequenceABC
from dataclasses import replace
from typing import List, Optional, Sequence, Union

import numpy as np

from ._loader import native
from . import presets
from .options import ExitOptions, check_river_options, is_bool, is_int
from .results import Generation, ScoreResult, log_softmax_at
from . import completions, generation
from . import rpc
from .generation import StreamInvalidatedError  # noqa: F401  (re-exported by river_gguf)
from .chat import format_chat

Prompt = Union[str, Sequence[int]]

#: Largest accepted n_ctx and n_batch. The engine counts positions in 32-bit ints; past about a
#: million positions the KV cache alone needs tens of GB for even a small model.
MAX_CTX = 1 << 20
#: ggml's thread pool holds at most GGML_MAX_N_THREADS (512) workers.
_GGML_MAX_THREADS = 512


class NumericalError(RuntimeError):
    """The model produced NaN or infinite logits: its weights or hyperparameters are broken (or
    overflow in this precision). Raised instead of returning text or scores computed from them."""


def _default_threads() -> int:
    # llama-cpp-python's default: half the logical CPUs, at least one.
    return max((os.cpu_count() or 2) // 2, 1)


def max_threads() -> int:
    """The most threads a Model accepts: 4x the logical CPUs (at least 8), at most ggml's 512.
    More threads than that only contend; 10**6 used to exhaust memory while creating the pool."""
    return min(_GGML_MAX_THREADS, max(8, 4 * (os.cpu_count() or 1)))


def _path_arg(name: str, p) -> str:
    try:
        p = os.fspath(p)
    except TypeError:
        raise ValueError(f"{name} must be a path (str or os.PathLike), got {p!r}") from None
    return os.fsdecode(p) if isinstance(p, bytes) else p


def _int_arg(name: str, v, lo: int, hi: int) -> int:
    if not is_int(v) or not lo <= v <= hi:
        raise ValueError(f"{name} must be an int in [{lo}, {hi}], got {v!r}")
    return int(v)


def _bool_arg(name: str, v) -> bool:
    if not is_bool(v):
        raise ValueError(f"{name} must be a bool, got {v!r}")
    return bool(v)


def _locked(method):
    """Run the method holding the Model's lock: one engine call at a time per Model."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper


class Model:
    """A GGUF model on the river_gguf engine.

    model_path: a GGUF file (plain or River GGUF); None loads the default SmolLM2-135M-Instruct.
    river: a second GGUF of the same model at lower precision, used as the exit river.
    n_ctx, n_batch: ints in [1, 2**20]; n_threads: an int in [1, max_threads()] (None: half the
    CPUs); n_gpu_layers: an int (negative: all). use_mmap: map the file (default) or read it into
    memory (also RIVER_GGUF_NO_MMAP=1), as llama.cpp's use_mmap.
    mode, threshold, min_exit_layer, river_head, prefill, tail: defaults for every call; a River
    GGUF supplies its own, and each call may override them. River options given to a model
    without a river raise ValueError.
    preset: one of the River GGUF's named settings ("fast", "balanced", "quality"; default: the
    file's default preset, "balanced"); explicit options override it.

    rpc_servers: layers on other machines through ggml's RPC backend: "host:port" strings (or
    one comma-separated string) of `river-gguf rpc-server`s or llama.cpp rpc-servers, trusted
    networks only. rpc_layers: which layers go there: None (all), n (the last n) or a list of
    layer indices; each layer keeps its KV cache on its device, so an exit never moves it.
    rpc_split: each remote device's share of those layers (default: by free memory, as
    llama.cpp's tensor_split). rpc_weights: "all" (a remote layer's backbone and river weights
    go with it), "backbone" or "river" (only that model's; the other's layer runs here on the
    remote cache). rpc_timeout: seconds a server may take to answer (None: no limit). A server
    that is down, busy with another client, stops answering or dies raises ConnectionError
    naming it; after a failure mid-generation the Model refuses work: load it again.

    Bad arguments (wrong type, bools for numbers, out of range, unknown options) raise ValueError.

    Threads and streams. A Model owns one KV cache. Every call that runs the engine (generate,
    logits, score, similarity_trace, create_completion and create_chat_completion without
    stream=True) holds the Model's lock (a threading.RLock) from start to end, so calls from
    several threads are serialized and each returns what it would return alone. A stream() holds
    the lock only while it computes its next piece, and owns the cache from its first step until
    another call clears it: once any other call (another stream's first step, generate, logits,
    score, ...) has used the cache, advancing the older stream raises StreamInvalidatedError (a
    RuntimeError), and keeps raising it. Finish (or drop) a stream before the next call, or use
    one Model per concurrent conversation. Different Models share no lock, and the native
    compute releases the GIL, so Models in different threads run in parallel.

    NaN or infinite logits raise NumericalError (a RuntimeError) instead of producing text or
    scores; the Model stays usable.
    """

    def __init__(
        self,
        model_path: Optional[str] = None,
        *,
        river: Optional[str] = None,
        n_ctx: int = 2048,
        n_threads: Optional[int] = None,
        n_batch: int = 512,
        n_gpu_layers: int = 0,
        use_mmap: bool = True,
        mode: Optional[str] = None,
        threshold: Optional[float] = None,
        min_exit_layer: Optional[int] = None,
        river_head: Optional[bool] = None,
        prefill: Optional[str] = None,
        tail: Optional[int] = None,
        river_attention: Optional[str] = None,
        preset: Optional[str] = None,
        verbose: bool = False,
        rpc_servers: Optional[Union[str, Sequence[str]]] = None,
        rpc_layers: Optional[Union[int, Sequence[int]]] = None,
        rpc_split: Optional[Sequence[float]] = None,
        rpc_weights: str = "all",
        rpc_timeout: Optional[float] = rpc.DEFAULT_TIMEOUT,
    ):
        if model_path is None:
            from .default_model import default_model_path

            model_path = default_model_path()
        model_path = _path_arg("model_path", model_path)
        river = _path_arg("river", river) if river is not None else None
        for p in [model_path] + ([river] if river is not None else []):
            if not os.path.exists(p):
                raise FileNotFoundError(f"model file not found: {p}")
        n_ctx = _int_arg("n_ctx", n_ctx, 1, MAX_CTX)
        n_batch = _int_arg("n_batch", n_batch, 1, MAX_CTX)
        n_threads = _default_threads() if n_threads is None else _int_arg("n_threads", n_threads, 1, max_threads())
        if not is_int(n_gpu_layers):
            raise ValueError(f"n_gpu_layers must be an int (negative: all layers), got {n_gpu_layers!r}")
        # -1 (any negative): everything, as in llama.cpp; clamped so it fits the native int.
        n_gpu_layers = 1 << 30 if n_gpu_layers < 0 else min(int(n_gpu_layers), 1 << 30)
        verbose = _bool_arg("verbose", verbose)
        rpc_kw = rpc.engine_kwargs(rpc_servers, rpc_layers, rpc_split, rpc_weights, rpc_timeout)
        self._use_mmap = _bool_arg("use_mmap", use_mmap)
        if preset is not None and not isinstance(preset, str):
            raise ValueError(f"preset must be a str, got {preset!r}")

        import llama_cpp._logger as llama_logger

        llama_logger.set_verbose(verbose)  # libllama's vocab loader is chatty
        self.model_path = model_path
        self.river_path = river
        self.n_threads = n_threads
        # A batch longer than the context never runs; the engine sizes a buffer by n_batch.
        self._n_batch = min(n_batch, n_ctx)
        self._n_gpu_layers = n_gpu_layers
        self._lock = threading.RLock()
        self._epoch = 0  # bumped whenever a call clears the KV cache; a stream keeps the value it made
        from .gguf_io import deferred_interrupts

        # libllama logs through llama-cpp-python's ctypes callback, which drops a KeyboardInterrupt
        # raised inside it: hold Ctrl-C until the native load returns, then deliver it.
        with deferred_interrupts():
            self._engine = native.Engine(model_path, river or "", n_ctx, n_threads, self._n_batch, n_gpu_layers,
                                         use_mmap=self._use_mmap, **rpc_kw)
            self._vocab = native.Vocab(model_path)
        self.hparams = self._engine.hparams
        self.metadata = self._engine.metadata
        if self._vocab.n_tokens != self.n_vocab:
            raise native.GGUFFormatError(
                f"{model_path}: vocabulary has {self._vocab.n_tokens} tokens but token_embd has {self.n_vocab} rows"
            )
        check_river_options(self.has_river, model_path, threshold=threshold, min_exit_layer=min_exit_layer,
                            river_head=river_head, prefill=prefill, tail=tail, river_attention=river_attention,
                            preset=preset)
        self.exit_options = ExitOptions()  # backbone-only while the file's defaults are worked out
        try:
            self.presets = presets.parse(self.metadata) if self.has_river else {}
        except ValueError as e:  # a malformed river.presets is a damaged file, not a bad argument
            raise native.GGUFFormatError(f"{model_path}: {e}") from None
        if preset is not None and not self.presets:
            raise ValueError(f"preset={preset!r}, but {model_path} stores no presets "
                             "(calibrate it: river-gguf calibrate MODEL --write)")
        self.preset = preset if preset is not None else (
            self.metadata.get(presets.DEFAULT_KEY, presets.DEFAULT_PRESET) if self.presets else None)
        # Check the caller's options before a profile spends time on the defaults.
        ExitOptions(mode="river" if self.has_river else "backbone").with_overrides(
            mode=mode, threshold=threshold, min_exit_layer=min_exit_layer, river_head=river_head, prefill=prefill,
            tail=tail, river_attention=river_attention,
        ).validate(self.n_layer, self.has_river)
        self._base_options = self._file_exit_options(profile=threshold is None and not self.presets)
        self.exit_options = self._with_preset(self._base_options, self.preset).with_overrides(
            mode=mode, threshold=threshold, min_exit_layer=min_exit_layer, river_head=river_head, prefill=prefill,
            tail=tail, river_attention=river_attention,
        ).validate(self.n_layer, self.has_river)

    # ----- properties -------------------------------------------------------------------
    @property
    def n_layer(self) -> int:
        return self.hparams["n_layer"]

    @property
    def n_vocab(self) -> int:
        return self.hparams["n_vocab"]

    @property
    def n_ctx(self) -> int:
        return self._engine.n_ctx

    @property
    def has_river(self) -> bool:
        return self._engine.has_river

    @property
    def layer_devices(self) -> List[str]:
        """Where each layer and its KV cache live: "CPU", "GPU" or an RPC server's host:port."""
        return list(self._engine.layer_devices)

    def _file_exit_options(self, profile: bool) -> ExitOptions:
        """Defaults stored in a River GGUF (river.* keys); plain files never exit by default."""
        md = self.metadata
        if not self.has_river:
            return ExitOptions(mode="backbone")
        threshold = md.get("river.threshold", 2.0)
        if "river.threshold" not in md and profile:
            # Two plain files carry no calibrated tau: profile the backbone, as the converter does.
            from .profile import default_threshold

            threshold = default_threshold(self)["threshold"]
        return ExitOptions(
            mode="river",
            threshold=float(threshold),
            min_exit_layer=int(md.get("river.min_exit_layer", 0)),
            river_head=bool(md.get("river.head", False)) and self._engine.river_has_head,
            prefill=str(md.get("river.prefill", "backbone")),
            tail=int(md.get("river.tail", 0)),
        )

    def _with_preset(self, base: ExitOptions, name: Optional[str]) -> ExitOptions:
        if name is None:
            return base
        if not isinstance(name, str):
            raise ValueError(f"preset must be a str, got {name!r}")
        if name not in self.presets:
            raise ValueError(f"unknown preset {name!r}; this file has: {', '.join(sorted(self.presets)) or 'none'}")
        opts = dict(self.presets[name]["options"])
        # A preset is a whole setting: what it leaves out takes the plain defaults, not the
        # previous preset's values.
        return replace(base, exit_layer=None, **opts)

    def _options(self, preset: Optional[str] = None, **overrides) -> ExitOptions:
        check_river_options(self.has_river, self.model_path, preset=preset, **overrides)
        base = self.exit_options if preset is None else self._with_preset(self._base_options, preset)
        return base.with_overrides(**overrides).validate(self.n_layer, self.has_river)

    # ----- vocabulary -------------------------------------------------------------------
    # The vocabulary is read-only after load and its native calls keep the GIL: no lock needed.
    def tokenize(self, text: Union[str, bytes], add_special: bool = True, parse_special: bool = False) -> List[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        if not isinstance(text, str):
            raise ValueError(f"text must be str or bytes, got {type(text).__name__}")
        return list(self._vocab.tokenize(text, _bool_arg("add_special", add_special),
                                         _bool_arg("parse_special", parse_special)))

    def detokenize(self, tokens: Sequence[int], special: bool = False) -> str:
        return self._vocab.detokenize(self._check_tokens(tokens), _bool_arg("special", special)).decode(
            "utf-8", errors="replace")

    def token_to_piece(self, token: int, special: bool = False) -> bytes:
        return self._vocab.token_to_piece(self._check_token(token), _bool_arg("special", special))

    def token_bos(self) -> int:
        return self._vocab.bos

    def token_eos(self) -> int:
        return self._vocab.eos

    def is_eog(self, token: int) -> bool:
        return self._vocab.is_eog(self._check_token(token))

    def _check_token(self, t) -> int:
        if not is_int(t):
            raise ValueError(f"a token id must be an int (not a float or bool), got {t!r}")
        if not 0 <= t < self.n_vocab:
            raise ValueError(f"token id {t} is outside the vocabulary [0, {self.n_vocab})")
        return int(t)

    def _check_tokens(self, tokens) -> List[int]:
        if isinstance(tokens, np.ndarray):
            if tokens.ndim != 1 or not (np.issubdtype(tokens.dtype, np.integer) or tokens.size == 0):
                raise ValueError(f"tokens must be a 1-D array of ints, got shape {tokens.shape} of {tokens.dtype}")
            out = tokens.tolist()
        elif isinstance(tokens, _SequenceABC) and not isinstance(tokens, (str, bytes, bytearray)):
            out = list(tokens)
            bad_type = [t for t in out if not is_int(t)]
            if bad_type:
                raise ValueError(f"token ids must be ints (not floats or bools), got {bad_type[0]!r}")
            out = [int(t) for t in out]
        else:
            raise ValueError(f"tokens must be a list of int token ids, got {type(tokens).__name__}")
        bad = [t for t in out if not 0 <= t < self.n_vocab]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.n_vocab})")
        return out

    def _prompt_tokens(self, prompt: Prompt) -> List[int]:
        if isinstance(prompt, (str, bytes)):
            toks = self.tokenize(prompt, add_special=True, parse_special=True)
        else:
            toks = self._check_tokens(prompt)
        if not toks:
            raise ValueError("the prompt is empty")
        if len(toks) >= self.n_ctx:
            raise native.ContextOverflowError(
                f"the prompt has {len(toks)} tokens, which leaves no room in n_ctx={self.n_ctx}"
            )
        return toks

    # ----- evaluation -------------------------------------------------------------------
    def _begin(self) -> int:
        """Clear the KV cache for a new computation and own it (the caller holds the lock). Any
        stream that was using the cache sees the new epoch and refuses its next step."""
        self._epoch += 1
        self._engine.truncate(0)
        return self._epoch

    def _check_owner(self, epoch: int, n_past: int) -> None:
        """Raise StreamInvalidatedError unless the cache is still the one a stream left: no call
        cleared it since (epoch), and it holds exactly the stream's tokens (n_past; this also
        catches tools that drive model._engine directly)."""
        if epoch != self._epoch or self._engine.n_past != n_past:
            raise StreamInvalidatedError(
                "this stream can no longer be advanced: another call on the same Model (generate, "
                "stream, logits, score, ...) has reused its KV cache since the stream started. Finish "
                "a stream before the next call, or use one Model per concurrent stream"
            )

    def _eval(self, tokens: List[int], opts: ExitOptions, prompt: bool, all_logits=False, trace=False):
        return self._eval_on(self._engine, tokens, opts, prompt, all_logits, trace)

    def _eval_on(self, engine, tokens: List[int], opts: ExitOptions, prompt: bool, all_logits=False, trace=False):
        out = engine.eval(tokens, all_logits=all_logits, trace=trace, **opts.engine_args(prompt))
        # Only the rows a caller reads are checked: the last one per step costs ~n_vocab compares.
        rows = out[0] if all_logits else out[0][-1:]
        if not np.isfinite(rows).all():
            raise NumericalError(
                f"the model produced NaN or infinite logits (after {engine.n_past} positions, "
                f"mode={opts.mode!r}); its weights or hyperparameters are broken, so no text or score is returned"
            )
        return out

    @_locked
    def logits(self, tokens: Sequence[int], **options) -> np.ndarray:
        """Logits for every position of `tokens` in one batched pass: float32 [len(tokens), n_vocab]."""
        toks = self._check_tokens(tokens)
        if not toks:
            raise ValueError("no tokens")
        opts = self._options(**options)
        self._begin()
        out, _, _ = self._eval(toks, opts, prompt=True, all_logits=True)
        return out

    @_locked
    def score(self, tokens: Sequence[int], prefix: int = 1, keep_logits: bool = False, **options) -> ScoreResult:
        """Teacher-forced scoring through the decode path: prefill tokens[:prefix], then feed the
        rest one at a time, with exits, and report log p of each actual next token. keep_logits:
        also return the logits that predicted each scored token (float32 [n_scored, n_vocab]),
        for divergence from a reference model."""
        keep_logits = _bool_arg("keep_logits", keep_logits)
        toks = self._check_tokens(tokens)
        if not is_int(prefix) or not 1 <= prefix < len(toks):
            raise ValueError(f"prefix must be an int in [1, {len(toks) - 1}], got {prefix!r}")
        if len(toks) > self.n_ctx:
            raise native.ContextOverflowError(f"{len(toks)} tokens do not fit in n_ctx={self.n_ctx}")
        opts = self._options(**options)
        self._begin()
        logits, exit_layer, _ = self._eval(toks[:prefix], opts, prompt=True)
        logprobs, exits, kept = [], [], []
        for i in range(prefix, len(toks)):
            logprobs.append(log_softmax_at(logits[-1], toks[i]))
            exits.append(exit_layer)
            if keep_logits:
                kept.append(np.array(logits[-1], dtype=np.float32))
            if i + 1 < len(toks):
                logits, exit_layer, _ = self._eval([toks[i]], opts, prompt=False)
        return ScoreResult(np.array(logprobs), np.array(exits, dtype=np.int32),
                           np.stack(kept) if keep_logits else None)

    @_locked
    def similarity_trace(self, tokens: Sequence[int], **options) -> List[List[float]]:
        """Per decode step, cos(h_in, h_out) of every backbone layer run (for analysis)."""
        toks = self._check_tokens(tokens)
        if not toks:
            raise ValueError("no tokens")
        if len(toks) > self.n_ctx:
            raise native.ContextOverflowError(f"{len(toks)} tokens do not fit in n_ctx={self.n_ctx}")
        opts = self._options(**options)
        self._begin()
        return self._trace_on(self._engine, toks, opts)

    def _trace_on(self, engine, toks: List[int], opts: ExitOptions) -> List[List[float]]:
        engine.truncate(0)
        traces = []
        self._eval_on(engine, toks[:1], opts, prompt=True)
        for t in toks[1:]:
            _, _, sims = self._eval_on(engine, [t], opts, prompt=False, trace=True)
            traces.append(list(sims))
        return traces

    def _profile_trace(self, tokens: Sequence[int]) -> List[List[float]]:
        """similarity_trace of backbone decode in a short-lived engine of its own: the profile's
        length does not depend on this Model's n_ctx, and its KV cache (and any stream on it)
        is left alone."""
        toks = self._check_tokens(tokens)
        if not toks:
            raise ValueError("no tokens to profile")
        from .gguf_io import deferred_interrupts

        with deferred_interrupts():
            engine = native.Engine(self.model_path, "", len(toks), self.n_threads, min(self._n_batch, len(toks)),
                                   self._n_gpu_layers, use_mmap=self._use_mmap)
        try:
            return self._trace_on(engine, toks, ExitOptions(mode="backbone"))
        finally:
            del engine  # its weights map and KV cache go now, not at the next GC

    # ----- generation -------------------------------------------------------------------
    @_locked
    def generate(self, prompt: Prompt, max_tokens: int = 128, **kwargs) -> Generation:
        s = self.stream(prompt, max_tokens=max_tokens, **kwargs)
        for _ in s:
            pass
        return s.generation

    def stream(
        self,
        prompt: Prompt,
        max_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 40,
        top_p: float = 0.95,
        min_p: float = 0.05,
        repeat_penalty: float = 1.0,
        seed: Optional[int] = None,
        stop: Union[str, List[str], None] = None,
        **options,
    ) -> "generation.Stream":
        """Iterate over text pieces as they are generated; `.generation` holds the result after.

        The stream computes nothing until it is first advanced; from then on it owns the Model's
        KV cache until another call uses it (then it raises StreamInvalidatedError)."""
        from .sampling import Sampler

        if max_tokens is not None and (not is_int(max_tokens) or max_tokens < 0):
            raise ValueError(f"max_tokens must be an int >= 0 or None, got {max_tokens!r}")
        if stop is not None and not isinstance(stop, str) and (
            not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop)
        ):
            raise ValueError(f"stop must be a str or a list of str, got {stop!r}")
        sampler = Sampler(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                          repeat_penalty=repeat_penalty, seed=seed)
        opts = self._options(**options)
        toks = self._prompt_tokens(prompt)
        return generation.Stream(self, toks, max_tokens, sampler, opts, stop)

    # ----- OpenAI-style API (llama_cpp.Llama compatible shapes) -------------------------
    def create_completion(self, prompt: Prompt, max_tokens: Optional[int] = 16, temperature: float = 0.8,
                          top_p: float = 0.95, min_p: float = 0.05, top_k: int = 40, repeat_penalty: float = 1.0,
                          seed: Optional[int] = None, stop=None, stream: bool = False, **options):
        stream = _bool_arg("stream", stream)
        with self._lock:
            s = self.stream(prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p, min_p=min_p,
                            top_k=top_k, repeat_penalty=repeat_penalty, seed=seed, stop=stop, **options)
            cid, created, name = completions.new_id("cmpl"), completions.now(), self.model_path
            if stream:
                def chunks():
                    for piece in s:
                        if piece:
                            yield completions.completion_chunk(cid, created, name, piece)
                    g = s.generation
                    yield completions.completion_chunk(cid, created, name, "", g.finish_reason, extra=g.stats)
                return chunks()
            for _ in s:
                pass
        g = s.generation
        return completions.completion_response(cid, created, name, g.text, g.finish_reason,
                                               len(s.prompt_tokens), len(g.tokens), extra=g.stats)

    def chat_prompt(self, messages) -> str:
        """The prompt text the GGUF's chat template makes of `messages`."""
        return format_chat(self._vocab.chat_template(), messages,
                           bos_token=self.token_to_piece(self.token_bos(), True).decode("utf-8", "replace"),
                           eos_token=self.token_to_piece(self.token_eos(), True).decode("utf-8", "replace"))

    def create_chat_completion(self, messages, max_tokens: Optional[int] = None, temperature: float = 0.2,
                               top_p: float = 0.95, min_p: float = 0.05, top_k: int = 40,
                               repeat_penalty: float = 1.0, seed: Optional[int] = None, stop=None,
                               stream: bool = False, **options):
        stream = _bool_arg("stream", stream)
        prompt = self.chat_prompt(messages)
        with self._lock:
            s = self.stream(prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p, min_p=min_p,
                            top_k=top_k, repeat_penalty=repeat_penalty, seed=seed, stop=stop, **options)
            cid, created, name = completions.new_id("chatcmpl"), completions.now(), self.model_path
            if stream:
                return completions.chat_chunks(cid, created, name, s,
                                               finish_reason=lambda: s.generation.finish_reason,
                                               extra=lambda: s.generation.stats)
            for _ in s:
                pass
        g = s.generation
        return completions.chat_response(cid, created, name, g.text, g.finish_reason,
                                         len(s.prompt_tokens), len(g.tokens), extra=g.stats)
