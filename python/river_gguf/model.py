"""The River-level handle: load a GGUF (optionally with a river), tokenize, evaluate and score
with exits. Text generation is river_gguf.Llama's (llama.py), which runs on this class.

Threads: every call that runs the engine holds the Model's lock (see the Model docstring).
"""
import functools
import os
import threading
import warnings
from collections.abc import Sequence as _SequenceABC
from dataclasses import replace
from typing import List, NamedTuple, Optional, Sequence, Tuple, Union

import llama_cpp._logger as llama_logger
from llama_cpp._utils import suppress_stdout_stderr
import numpy as np

from . import presets, rpc
from ._loader import native
from .default_model import default_model_path
from .gguf.io import deferred_interrupts
from .options import EXIT_DECISIONS, ExitOptions, RiverOptions, check_river_options, is_bool, is_int, parse_bytes
from .profile import default_threshold
from .results import ScoreResult, log_softmax_at
from .session import STOP, NumericalError, Session, evaluate

#: Largest accepted n_ctx and n_batch. The engine counts positions in 32-bit ints; past about a
#: million positions the KV cache alone needs tens of GB for even a small model.
MAX_CTX = 1 << 20
#: ggml's thread pool holds at most GGML_MAX_N_THREADS (512) workers.
_GGML_MAX_THREADS = 512


class Step(NamedTuple):
    """What one Model.eval returns."""
    logits: np.ndarray          # float32 [1, n_vocab], or [len(tokens), n_vocab] with all_logits
    exit_layer: int             # backbone layer after which the last token left (n_layer - 1: never)
    similarities: List[float]   # with trace: the exit rule's score (cosine: cos(h_in, h_out)) per backbone layer run


def default_threads() -> int:
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
    CPUs); n_gpu_layers: an int (negative: all); main_gpu: which GPU they go to, an index into
    river_gguf.devices.offload_gpus() (discrete GPUs first, then integrated ones, as llama.cpp
    orders them; without a GPU the layers stay on the CPU, as in llama.cpp). gpu_memory: the most
    the GPU placement may use, in bytes or as a size ("6GiB"; default: the GPU's free memory).
    With n_gpu_layers=-1 and a River model that does not fit it whole, the river, the head and
    the KV cache go to the GPU first and the backbone follows from its first layer for as long as
    it fits: the deep backbone layers, which tokens that exit early never run, stay in host
    memory (`placement` says what went where). A plain model, or a layer count asked for, takes
    the last layers that fit, as llama.cpp does. use_mmap: map the
    file (default) or read it into memory (also RIVER_GGUF_NO_MMAP=1), as llama.cpp's use_mmap.
    repack: give the CPU's mat-muls their own copies of the weights, in ggml's repacked layouts with
    Q/K/V and gate/up joined (default, what decode is fastest with); False reads every weight from
    the file's mapping as it is, with no copy, as llama.cpp's --no-repack (a conversion's batched
    passes over an F16 lose little by it and hold no second copy of the model).
    flash_attn: a bool; attention as llama.cpp computes it with flash attention on (True, the
    default: faster) or off (False: llama.cpp's KQ/softmax/KQV path over a transposed V cache).
    Each gives llama.cpp's logits with the same setting.
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

    exit_decision: where the dynamic exit's test (the exit rule's score) runs. "cpu": a CPU op after
    each tested layer (it reads the hidden states in place; with offloaded layers the graph
    splits there to bring them to the CPU); "graph": ggml ops on the layer's own device, one
    float per token read back through the scheduler's eval callback; "auto" (default): "graph"
    when layers are offloaded to a GPU or an RPC server, else "cpu". Both give the same exits
    up to float rounding of the score (the cosine's CPU op sums in double).

    Bad arguments (wrong type, bools for numbers, out of range, unknown options) raise ValueError.

    Exit options compose like this: a call's options override the Model's defaults (its preset,
    or the options given to the constructor), except that a call which names `mode` or
    `exit_layer` asks for that exit setting itself: it starts from the file's plain defaults
    (river.* keys), so no field of the default preset (a tail, backbone attention) stays in
    force unasked. `options(...)` returns the resolved ExitOptions of any call.

    Threads and the KV cache. A Model owns one KV cache. Every call that runs the engine
    (logits, score, similarity_trace, eval, begin, truncate) holds the Model's lock (a
    threading.RLock, `lock`), so calls from several threads are serialized. State kept in the
    cache across calls is a Session's (`session()`): the cache holds one session's tokens at a
    time, and a session that another call displaced evaluates what it needs again. Different
    Models share no lock, and the native compute releases the GIL, so Models in different
    threads run in parallel.

    NaN or infinite logits raise NumericalError (a RuntimeError) instead of producing text or
    scores; the Model stays usable.
    """

    def __init__(
        self,
        model_path: Optional[str] = None,
        *,
        n_ctx: int = 2048,
        n_threads: Optional[int] = None,
        n_batch: int = 512,
        n_gpu_layers: int = 0,
        main_gpu: int = 0,
        use_mmap: bool = True,
        flash_attn: bool = True,
        repack: bool = True,
        verbose: bool = False,
        river_options: Optional[RiverOptions] = None,
        **river_kw,
    ):
        ro = RiverOptions.of(river_options, **river_kw)
        river, preset = ro.river, ro.preset
        self._call_defaults: dict = {}
        if model_path is None:
            model_path = default_model_path()
        model_path = _path_arg("model_path", model_path)
        river = _path_arg("river", river) if river is not None else None
        for p in [model_path] + ([river] if river is not None else []):
            if not os.path.exists(p):
                raise FileNotFoundError(f"model file not found: {p}")
        n_ctx = _int_arg("n_ctx", n_ctx, 1, MAX_CTX)
        n_batch = _int_arg("n_batch", n_batch, 1, MAX_CTX)
        n_threads = default_threads() if n_threads is None else _int_arg("n_threads", n_threads, 1, max_threads())
        if not is_int(n_gpu_layers):
            raise ValueError(f"n_gpu_layers must be an int (negative: all layers), got {n_gpu_layers!r}")
        # -1 (any negative): everything, as in llama.cpp; clamped so it fits the native int.
        n_gpu_layers = 1 << 30 if n_gpu_layers < 0 else min(int(n_gpu_layers), 1 << 30)
        self._main_gpu = _int_arg("main_gpu", main_gpu, 0, 1 << 16)
        self._gpu_memory = 0 if ro.gpu_memory is None else parse_bytes("gpu_memory", ro.gpu_memory)
        verbose = _bool_arg("verbose", verbose)
        rpc_kw = rpc.engine_kwargs(ro.rpc_servers, ro.rpc_layers, ro.rpc_split, ro.rpc_weights, ro.rpc_timeout)
        self._use_mmap = _bool_arg("use_mmap", use_mmap)
        repack = _bool_arg("repack", repack)
        self.flash_attn = _bool_arg("flash_attn", flash_attn)
        if ro.exit_decision not in EXIT_DECISIONS:
            raise ValueError(f"exit_decision must be one of {', '.join(EXIT_DECISIONS)}, got {ro.exit_decision!r}")
        self._exit_decision = ro.exit_decision
        #: Decode steps in the verify batch's kernels (RiverOptions.verify_kernels).
        self.verify_kernels = _bool_arg("verify_kernels", ro.verify_kernels)
        if preset is not None and not isinstance(preset, str):
            raise ValueError(f"preset must be a str, got {preset!r}")

        llama_logger.set_verbose(verbose)  # libllama's vocab loader is chatty
        self.model_path = model_path
        self.river_path = river
        self.n_threads = n_threads
        # A batch longer than the context never runs; the engine sizes a buffer by n_batch.
        self._n_batch = min(n_batch, n_ctx)
        self._n_gpu_layers = n_gpu_layers
        self._lock = threading.RLock()
        self._holder: Optional[Session] = None  # the session whose tokens the cache holds

        # libllama logs through llama-cpp-python's ctypes callback, which drops a KeyboardInterrupt
        # raised inside it: hold Ctrl-C until the native load returns, then deliver it.
        draft_vocab = -1 if ro.draft_vocab is None else _int_arg("draft_vocab", ro.draft_vocab, 0, 1 << 30)
        with deferred_interrupts():
            self._engine = native.Engine(model_path, river or "", n_ctx=n_ctx, n_threads=n_threads,
                                         n_batch=self._n_batch, n_gpu_layers=n_gpu_layers, main_gpu=self._main_gpu, gpu_memory=self._gpu_memory,
                                         use_mmap=self._use_mmap, flash_attn=self.flash_attn,
                                         repack=repack, fuse=repack, exit_decision=ro.exit_decision,
                                         draft_vocab=draft_vocab, **rpc_kw)
            # libllama's vocabulary loader warns on stderr whatever llama_cpp's log level (Qwen:
            # "control-looking token"); llama_cpp.Llama(verbose=False) silences its load the same way.
            with suppress_stdout_stderr(disable=verbose):
                self._vocab = native.Vocab(model_path)
        # The end-of-generation tokens stay draftable, so a draft can end the text.
        self._engine.pin_draft_tokens(self._vocab.eog_tokens)
        asked = min(n_gpu_layers, self._engine.hparams["n_layer"])
        placed = self._engine.placement
        budget = (f"the GPU's budget ({placed['gpu_budget'] / 2**20:.0f} MiB: its free memory"
                  + (", capped by gpu_memory)" if self._gpu_memory else ")"))
        if placed["river_first"]:
            warnings.warn(f"{model_path}: the river, head and KV cache and {self._engine.gpu_layers} of the {asked} "
                          f"backbone layers fit in {budget}; the deeper backbone layers run on the CPU",
                          RuntimeWarning, stacklevel=2)
        elif 0 < self._engine.gpu_layers < asked or (asked and not self._engine.gpu_layers and native.offload_gpus()):
            warnings.warn(f"{model_path}: {self._engine.gpu_layers} of the {asked} layers asked for fit in {budget}; "
                          "the rest run on the CPU", RuntimeWarning, stacklevel=2)
        self.hparams = self._engine.hparams
        self.metadata = self._engine.metadata
        if self._vocab.n_tokens != self.n_vocab:
            raise native.GGUFFormatError(
                f"{model_path}: vocabulary has {self._vocab.n_tokens} tokens but token_embd has {self.n_vocab} rows"
            )
        ro.check_river(self.has_river, model_path)
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
        # The exit setting given at load: exit_layer names a setting of its own (as in a call),
        # the rest override the preset.
        overrides = {k: v for k, v in ro.exit_overrides().items() if k not in ("preset", "exit_layer")}
        self._call_defaults = {} if ro.exit_layer is None else {"exit_layer": ro.exit_layer}
        # Check the caller's options before a profile spends time on the defaults.
        ExitOptions(mode="river" if self.has_river else "backbone").with_overrides(
            **overrides, **self._call_defaults).validate(self.n_layer, self.has_river)
        self._base_options = self._file_exit_options(profile=ro.threshold is None and not self.presets)
        self.exit_options = self._with_preset(self._base_options, self.preset).with_overrides(
            **overrides).validate(self.n_layer, self.has_river)
        if self._call_defaults:
            self.exit_options = self.options()
        self.river_options = ro

    # ----- properties -------------------------------------------------------------------
    @property
    def n_layer(self) -> int:
        return self.hparams["n_layer"]

    @property
    def n_vocab(self) -> int:
        return self.hparams["n_vocab"]

    @property
    def n_embd(self) -> int:
        """Width of the hidden state (and of an embedding)."""
        return self.hparams["n_embd"]

    @property
    def n_batch(self) -> int:
        """Tokens one batch holds (a longer evaluation runs in batches of this many)."""
        return self._n_batch

    @property
    def n_ctx(self) -> int:
        return self._engine.n_ctx

    @property
    def has_river(self) -> bool:
        return self._engine.has_river

    @property
    def draft_vocab(self) -> List[int]:
        """The tokens a lossless draft may propose for good, ascending: the draft_vocab option's
        and the end-of-generation ones (empty: the whole vocabulary); besides them, draft_context."""
        return list(self._engine.draft_vocab)

    @property
    def draft_context(self) -> List[int]:
        """The tokens outside draft_vocab that this model has evaluated since it loaded (the
        latest, up to 512 less the end-of-generation tokens pinned in draft_vocab; oldest first):
        a draft may propose them too."""
        return list(self._engine.draft_context)

    @property
    def layer_devices(self) -> List[str]:
        """Where each layer's KV cache lives and its attention reads it: "CPU", "GPU" or an RPC
        server's host:port. A layer's weights can live elsewhere (`placement`)."""
        return list(self._engine.layer_devices)

    @property
    def placement(self) -> dict:
        """What went where: per layer, the device of its backbone weights ("backbone"), river
        weights ("river"; "" without a river) and KV cache ("kv_cache"); the head's device;
        "river_first" (the GPU budget held the river, head and KV cache but not the whole
        backbone); and, when a GPU was asked for, its free memory, the budget, the bytes placed on
        it (weights, KV cache and a compute reserve) and the bytes of each part."""
        return dict(self._engine.placement)

    def _file_exit_options(self, profile: bool) -> ExitOptions:
        """The default exit setting a River GGUF stores, as the engine read it from the river.*
        keys (native Engine.file_exit_setting, file_prefill); plain files never exit by default.
        A file without a stored threshold gets its rule's profile's with `profile`, else none
        that passes."""
        if not self.has_river:
            return ExitOptions(mode="backbone")
        opts = ExitOptions.from_setting(self._engine.file_exit_setting, prefill=self._engine.file_prefill)
        if profile and not self._engine.file_threshold_stored:
            # Two plain files carry no calibrated tau: profile the backbone, as the converter does.
            opts = replace(opts, threshold=default_threshold(self, exit_rule=opts.exit_rule)["threshold"])
        return opts

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

    def options(self, preset: Optional[str] = None, **overrides) -> ExitOptions:
        """The exit options a call with these arguments runs with (see the class docstring)."""
        overrides = {**self._call_defaults, **{k: v for k, v in overrides.items() if v is not None}}
        check_river_options(self.has_river, self.model_path, preset=preset, **overrides)
        if preset is not None:
            base = self._with_preset(self._base_options, preset)
        elif overrides.get("mode") is not None or overrides.get("exit_layer") is not None:
            base = self._base_options  # an explicit exit setting: no preset field stays unasked
        else:
            base = self.exit_options
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

    # ----- the KV cache and one evaluation ----------------------------------------------
    @property
    def lock(self) -> threading.RLock:
        """Held by every call that runs the engine; hold it across calls that share the cache."""
        return self._lock

    @property
    def n_past(self) -> int:
        """Positions the KV cache holds."""
        return self._engine.n_past

    @property
    def engine(self):
        """The native engine (river_gguf._native.Engine), for benchmarks and tools that drive it
        without this class's checks. Its calls do not take the lock or displace a session."""
        return self._engine

    @property
    def river_has_head(self) -> bool:
        return self._engine.river_has_head

    # ----- sessions: who the cache holds ------------------------------------------------
    def session(self, options: Optional[ExitOptions] = None, *, keep_rows: bool = False,
                verify_kernels: Optional[bool] = None, **overrides) -> Session:
        """A Session over this Model's KV cache (river_gguf.session): the one token loop. options:
        resolved ExitOptions (from options()), or the keyword overrides options() takes.
        keep_rows: keep every position's logits row. verify_kernels: decode steps in the verify
        batch's kernels (each with a throwaway token), so that their text is lossless mode's bit
        for bit (default: the Model's verify_kernels option)."""
        if options is not None and overrides:
            raise ValueError("give options or keyword overrides, not both")
        opts = self.options(**overrides) if options is None else options
        if not isinstance(opts, ExitOptions):
            raise ValueError(f"options must be ExitOptions (from Model.options), got {type(opts).__name__}")
        return Session(self, self._engine, self._lock, opts, keep_rows=_bool_arg("keep_rows", keep_rows),
                       verify_kernels=self.verify_kernels if verify_kernels is None
                       else _bool_arg("verify_kernels", verify_kernels))

    def holds_cache(self, session: Session) -> bool:
        """Whether the cache holds `session`'s tokens (no other call used it since)."""
        return self._holder is session

    def give_cache(self, session: Optional[Session], only_from: Optional[Session] = None) -> None:
        """Hand the cache to `session`, cleared (None: to one-shot calls). only_from: only when
        that session holds it, and then without clearing (a session letting it go)."""
        with self._lock:
            if only_from is not None:
                if self._holder is only_from:
                    self._holder = session
                return
            self._clear()
            self._holder = session

    @_locked
    def begin(self) -> None:
        """Clear the KV cache for raw calls (eval, truncate, draft); a session holding it is
        displaced."""
        self._clear()

    def _clear(self) -> None:
        self._holder = None
        self._engine.truncate(0)

    @_locked
    def truncate(self, n_past: int) -> None:
        """Keep the first n_past positions of the KV cache (a session holding it is displaced)."""
        if not is_int(n_past) or not 0 <= n_past <= self._engine.n_past:
            raise ValueError(f"n_past must be an int in [0, {self._engine.n_past}], got {n_past!r}")
        self._holder = None
        self._engine.truncate(int(n_past))

    @_locked
    def eval(self, tokens: Sequence[int], options: Optional[ExitOptions] = None, *, prompt: bool = True,
             all_logits: bool = False, trace: bool = False) -> Step:
        """Evaluate `tokens` after the n_past the KV cache holds: a prompt batch (prompt=True:
        the prefill policy applies) or one decode step (prompt=False: exits are live). options:
        resolved ExitOptions (default: the Model's). Logits of the last token, or of every
        token with all_logits."""
        toks = self._check_tokens(tokens)
        if not toks:
            raise ValueError("no tokens")
        if not prompt and len(toks) != 1:
            raise ValueError(f"a decode step takes one token, got {len(toks)}")
        if self._engine.n_past + len(toks) > self.n_ctx:
            raise native.ContextOverflowError(
                f"{len(toks)} tokens after {self._engine.n_past} need more than n_ctx={self.n_ctx} positions")
        opts = self.exit_options if options is None else options
        if not isinstance(opts, ExitOptions):
            raise ValueError(f"options must be ExitOptions (from Model.options), got {type(opts).__name__}")
        opts.validate(self.n_layer, self.has_river)
        self._holder = None
        return Step(*self._eval(toks, opts, _bool_arg("prompt", prompt), _bool_arg("all_logits", all_logits),
                                _bool_arg("trace", trace)))

    @_locked
    def draft(self, token: int, options: Optional[ExitOptions] = None,
              with_probs: bool = True, pick=None) -> Tuple[List[int], List[float]]:
        """Lossless decoding's draft: `token` goes at position n_past, and the river proposes up to
        options.draft_max greedy tokens after it (drafted as options.draft_mode says), each kept
        while its probability under the draft is >= options.draft_p_min. The KV cache still holds
        n_past positions on return; the rows the drafts wrote beyond it are the verify batch's to
        overwrite. Returns (draft tokens, their probabilities under the draft); with_probs=False
        returns no probabilities, and at draft_p_min 0 spares the softmax over the vocabulary that
        each would cost. pick(logits, tokens) -> token, when given, chooses each draft instead of
        the greedy rule (-1: stop), from the draft's logits and the token of each (None: the
        whole vocabulary in order; read-only arrays valid during the call); draft_p_min and the
        probabilities then do not apply."""
        tok = self._check_token(token)
        if self._engine.n_past + 1 > self.n_ctx:
            raise native.ContextOverflowError(f"no room after {self._engine.n_past} positions in n_ctx={self.n_ctx}")
        opts = self.exit_options if options is None else options
        if not isinstance(opts, ExitOptions):
            raise ValueError(f"options must be ExitOptions (from Model.options), got {type(opts).__name__}")
        if not self.has_river:
            raise ValueError(f"{self.model_path} has no river to draft with")
        opts.validate(self.n_layer, self.has_river)
        if pick is not None and not callable(pick):
            raise ValueError(f"pick must be callable, got {type(pick).__name__}")
        self._holder = None
        tokens, probs = self._engine.draft(tok, **opts.draft_args(), with_probs=_bool_arg("with_probs", with_probs),
                                           pick=pick)
        return list(tokens), list(probs)

    @_locked
    def collect_activations(self, tokens: Sequence[int], stats) -> None:
        """One backbone pass over `tokens` from an empty cache, adding each mat-mul's input
        activations to `stats` (native.ActivationStats, for the importance matrix)."""
        toks = self._check_tokens(tokens)
        self._clear()
        self._engine.collect_activations(toks, stats)
        self._engine.truncate(0)

    def _eval(self, tokens: List[int], opts: ExitOptions, prompt: bool, all_logits=False, trace=False, first_row=0):
        return evaluate(self._engine, tokens, opts, prompt, all_logits, trace, first_row)

    @_locked
    def logits(self, tokens: Sequence[int], first_row: int = 0, **options) -> np.ndarray:
        """Logits for every position of `tokens` in one batched pass: float32 [len(tokens), n_vocab].
        first_row: only positions first_row.. (the head runs those alone; `tokens` must then fit
        one batch, n_batch)."""
        toks = self._one_batch(tokens) if first_row else self._check_tokens(tokens)
        if not toks:
            raise ValueError("no tokens")
        first_row = _int_arg("first_row", first_row, 0, len(toks) - 1)
        opts = self.options(**options)
        self._clear()
        out, _, _ = self._eval(toks, opts, prompt=True, all_logits=True, first_row=first_row)
        return out

    @_locked
    def embed(self, tokens: Sequence[int]) -> np.ndarray:
        """The backbone's final-norm output for every position of `tokens`, in one pass from an
        empty cache: float32 [len(tokens), n_embd], llama.cpp's embeddings with pooling none
        (the rows the head reads). Embeddings are the precise model's, so no exit applies."""
        toks = self._check_tokens(tokens)
        if not toks:
            raise ValueError("no tokens")
        if len(toks) > self.n_ctx:
            raise native.ContextOverflowError(f"{len(toks)} tokens do not fit in n_ctx={self.n_ctx}")
        self._clear()
        try:
            rows = self._engine.eval(toks, mode=native.EXIT_MODES["backbone"], embeddings=True)[0]
        finally:
            self._clear()  # the cache holds the text's rows; nothing may continue from them
        if not np.isfinite(rows).all():
            raise NumericalError("the model produced NaN or infinite hidden states; its weights or "
                                 "hyperparameters are broken, so no embedding is returned")
        return rows

    @_locked
    def score(self, tokens: Sequence[int], prefix: int = 1, keep_logits: bool = False, **options) -> ScoreResult:
        """Teacher-forced scoring through the decode path: prefill tokens[:prefix], then decode the
        rest with exits, the text choosing each token, and report log p of each actual next token.
        In lossless mode the river drafts and the backbone verifies, and a draft is kept while it
        equals the text, as lossless generation keeps it when the text is what it samples.
        keep_logits: also return the logits that predicted each scored token (float32
        [n_scored, n_vocab]), for divergence from a reference model."""
        keep_logits = _bool_arg("keep_logits", keep_logits)
        toks = self._check_tokens(tokens)
        if not is_int(prefix) or not 1 <= prefix < len(toks):
            raise ValueError(f"prefix must be an int in [1, {len(toks) - 1}], got {prefix!r}")
        if len(toks) > self.n_ctx:
            raise native.ContextOverflowError(f"{len(toks)} tokens do not fit in n_ctx={self.n_ctx}")
        logprobs, exits, kept = [], [], []
        text = iter(toks[prefix:])
        with self.session(self.options(**options)) as s:
            s.prefill(toks[:prefix])
            for step in s.decode(lambda row, seen: next(text), limit=len(toks) - prefix):
                logprobs.append(log_softmax_at(step.row, step.token))
                exits.append(step.exit_layer)
                if keep_logits:
                    kept.append(np.array(step.row, dtype=np.float32))
        return ScoreResult(np.array(logprobs), np.array(exits, dtype=np.int32),
                           np.stack(kept) if keep_logits else None)

    @_locked
    def similarity_trace(self, tokens: Sequence[int], **options) -> List[List[float]]:
        """Per decode step, the exit rule's score of every backbone layer run (cosine, the
        default: cos(h_in, h_out)), for analysis."""
        toks = self._check_tokens(tokens)
        if not toks:
            raise ValueError("no tokens")
        if len(toks) > self.n_ctx:
            raise native.ContextOverflowError(f"{len(toks)} tokens do not fit in n_ctx={self.n_ctx}")
        with self.session(self.options(**options)) as s:
            return _trace(s, toks)

    def _one_batch(self, tokens: Sequence[int]) -> List[int]:
        """The checked tokens of a call that runs them as one batch (at most n_batch, at least one)."""
        toks = self._check_tokens(tokens)
        if not toks:
            raise ValueError("no tokens")
        if len(toks) > self._n_batch:
            raise ValueError(f"{len(toks)} tokens do not fit in one batch (n_batch={self._n_batch})")
        return toks

    @_locked
    def similarity_rows(self, tokens: Sequence[int], exit_rule: Optional[str] = None) -> np.ndarray:
        """The exit rule's score of every backbone layer for every token, from one batched
        backbone pass over `tokens` (from an empty cache): float32 [len(tokens), n_layer]. Row i
        is what similarity_trace reports for the decode step of tokens[i], up to the batched
        kernels' rounding (the first token has no decode step there). exit_rule: that rule's
        scores (default: the model's rule)."""
        toks = self._one_batch(tokens)
        self._clear()
        try:
            opts = self.options(mode="backbone")
            if exit_rule is not None:  # the scores of this rule (a plain model refuses it as an option)
                opts = replace(opts, exit_rule=exit_rule).validate(self.n_layer, self.has_river)
            _, _, sims = self._eval(toks, opts, prompt=True, all_logits=True, trace=True)
        finally:
            self._clear()  # the cache holds the text's rows; nothing may continue from them
        return np.asarray(sims, dtype=np.float32).reshape(self.n_layer, len(toks)).T

    @_locked
    def river_tails(self, tokens: Sequence[int], tails: Sequence[int], river_attention: str = "river",
                    river_head: bool = True, first_row: int = 0) -> List[np.ndarray]:
        """logits(tokens, mode="river-only", tail=t, ...)[first_row:] for each tail t, from one
        batched pass (from an empty cache) of the river layers the tails share: each tail runs
        only its own backbone layers and the head, on rows first_row.. (native
        Engine.river_tails). float32 [len(tokens) - first_row, n_vocab] per tail, in the order
        given."""
        toks = self._one_batch(tokens)
        if river_attention not in ("river", "backbone"):
            raise ValueError(f"river_attention must be 'river' or 'backbone', got {river_attention!r}")
        tails = [_int_arg("tail", t, 0, self.n_layer - 1) for t in tails]
        first_row = _int_arg("first_row", first_row, 0, len(toks) - 1)
        self._clear()
        try:
            rows = self._engine.river_tails(toks, tails, backbone_attention=river_attention == "backbone",
                                            river_head=_bool_arg("river_head", river_head), first_row=first_row)
        finally:
            self._clear()
        for r in rows:
            if not np.isfinite(r).all():
                raise NumericalError("the model produced NaN or infinite logits (mode='river-only'); its weights or "
                                     "hyperparameters are broken, so no score is returned")
        return rows

    def backbone_trace(self, tokens: Sequence[int], exit_rule: Optional[str] = None) -> List[List[float]]:
        """similarity_trace of backbone decode in a short-lived engine of its own: the profile's
        length does not depend on this Model's n_ctx, and its KV cache (and any stream on it)
        is left alone. exit_rule: that rule's scores (default: the default rule)."""
        toks = self._check_tokens(tokens)
        if not toks:
            raise ValueError("no tokens to profile")

        with deferred_interrupts():
            engine = native.Engine(self.model_path, "", n_ctx=len(toks), n_threads=self.n_threads,
                                   n_batch=min(self._n_batch, len(toks)), n_gpu_layers=self._n_gpu_layers,
                                   use_mmap=self._use_mmap, flash_attn=self.flash_attn,
                                   exit_decision=self._exit_decision,
                                   main_gpu=self._main_gpu, gpu_memory=self._gpu_memory)
        try:
            opts = ExitOptions(mode="backbone") if exit_rule is None else ExitOptions(mode="backbone", exit_rule=exit_rule)
            # The short-lived engine's session: it counts positions against its own n_ctx.
            session = Session(self, engine, threading.RLock(), opts, own_cache=True)
            return _trace(session, toks)
        finally:
            del engine  # its weights map and KV cache go now, not at the next GC


def _trace(session: Session, toks: List[int]) -> List[List[float]]:
    """The exit rule's scores of the decode step of each token after the first, the text choosing."""
    session.prefill(toks[:1])
    text = iter(toks[1:])
    steps = [step.scores for step in session.decode(lambda row, seen: next(text, STOP), trace=True)]
    return [list(sc) for sc in steps[1:] + [session.scores]] if len(toks) > 1 else []
