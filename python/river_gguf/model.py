"""The River-level handle, as llama-cpp-python's _internals are: one engine and its KV cache, the
vocabulary, the file's default exit setting and its presets, the options of a call resolved.
Everything that runs tokens through the cache is a policy on a Session (`Model.session`): text
generation is river_gguf.Llama's (llama.py), greedy decoding greedy.py's, and measurement
(teacher-forced scores, exit-rule traces, river tails) river_gguf.measure's. What stays here are
the one-shot passes no token loop expresses: logits and embeddings of a text, and the native
calibration passes (activations for the importance matrix, river tails, a backbone engine of
its own for the tau profile).

Threads: every call that runs the engine holds the Model's lock (see the Model docstring).
"""
import functools
import os
import threading
import warnings
from collections.abc import Sequence as _SequenceABC
from dataclasses import replace
from typing import Dict, List, Optional, Sequence, Union

import llama_cpp._logger as llama_logger
from llama_cpp._utils import suppress_stdout_stderr
import numpy as np

from . import presets, rpc
from ._loader import native
from .default_model import default_model_path
from .gguf.io import deferred_interrupts
from .options import EXIT_DECISIONS, LOSSLESS_KERNELS, ExitOptions, RiverOptions, check_river_options, is_bool, is_int, parse_bytes
from .measure.profile import default_threshold
from .batching import ModelLock, StepBatcher
from .session import NumericalError, Session, evaluate, evaluate_steps

#: Largest accepted n_ctx and n_batch. The engine counts positions in 32-bit ints; past about a
#: million positions the KV cache alone needs tens of GB for even a small model.
MAX_CTX = 1 << 20
#: ggml's thread pool holds at most GGML_MAX_N_THREADS (512) workers.
_GGML_MAX_THREADS = 512


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


def _choice_arg(name: str, v, choices) -> str:
    if v not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {v!r}")
    return v


def _bool_arg(name: str, v) -> bool:
    if not is_bool(v):
        raise ValueError(f"{name} must be a bool, got {v!r}")
    return bool(v)


def _repack_arg(v):
    """Model's repack: a bool, or "river" (the river's weights alone)."""
    if isinstance(v, str) and v == "river":
        return v
    if not is_bool(v):
        raise ValueError(f"repack must be a bool or 'river', got {v!r}")
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
    passes over an F16 lose little by it and hold no second copy of the model); "river": only
    the river's weights that a repacked layout takes get copies, none joined, and the backbone's
    are read in place (the converter's presets: the river runs on the kernels it runs on in use,
    the same logits, and nothing else is held twice).
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
    (logits, embed, the calibration passes, a session's evaluations) holds the Model's lock (a
    reentrant lock, `lock`), so calls from several threads are serialized. State kept in the
    cache across calls is a Session's (`session()`): each sequence of the cache holds one
    session's tokens at a time, and a session that another call displaced (another session on
    its sequence, or a one-shot call, which clears every sequence) evaluates what it needs again.
    Sessions on different sequences decoding in different threads share each decode step's
    batch (`step_window`). Different Models share no lock, and the native compute releases the
    GIL, so Models in different threads run in parallel.

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
        repack=True,
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
        repack = _repack_arg(repack)
        flash_attn = _bool_arg("flash_attn", flash_attn)
        self._exit_decision = _choice_arg("exit_decision", ro.exit_decision, EXIT_DECISIONS)
        #: Decode steps in the verify batch's kernels (RiverOptions.verify_kernels).
        self.verify_kernels = _bool_arg("verify_kernels", ro.verify_kernels)
        self._lossless_kernels = _choice_arg("lossless_kernels", ro.lossless_kernels, LOSSLESS_KERNELS)
        if preset is not None and not isinstance(preset, str):
            raise ValueError(f"preset must be a str, got {preset!r}")

        llama_logger.set_verbose(verbose)  # libllama's vocab loader is chatty
        self.model_path = model_path
        self.river_path = river
        self.n_threads = n_threads
        # A batch longer than the context never runs; the engine sizes a buffer by n_batch.
        self._n_batch = min(n_batch, n_ctx)
        self._n_gpu_layers = n_gpu_layers
        self._lock = ModelLock()
        self._holders: Dict[int, Session] = {}  # per sequence, the session whose tokens it holds

        # libllama logs through llama-cpp-python's ctypes callback, which drops a KeyboardInterrupt
        # raised inside it: hold Ctrl-C until the native load returns, then deliver it.
        draft_vocab = -1 if ro.draft_vocab is None else _int_arg("draft_vocab", ro.draft_vocab, 0, 1 << 30)
        with deferred_interrupts():
            self._engine = native.Engine(model_path, river or "", n_ctx=n_ctx, n_threads=n_threads,
                                         n_batch=self._n_batch, n_gpu_layers=n_gpu_layers, main_gpu=self._main_gpu, gpu_memory=self._gpu_memory,
                                         use_mmap=self._use_mmap, flash_attn=flash_attn,
                                         repack=bool(repack), repack_backbone=repack is True, fuse=repack is True,
                                         exit_decision=ro.exit_decision, draft_vocab=draft_vocab, **rpc_kw)
            # libllama's vocabulary loader warns on stderr whatever llama_cpp's log level (Qwen:
            # "control-looking token"); llama_cpp.Llama(verbose=False) silences its load the same way.
            with suppress_stdout_stderr(disable=verbose):
                self._vocab = native.Vocab(model_path)
        # The end-of-generation tokens stay draftable, so a draft can end the text.
        self._engine.pin_draft_tokens(self._vocab.eog_tokens)
        self._steps = StepBatcher(self._lock, functools.partial(evaluate_steps, self._engine))
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
        opts = self.presets[name].setting.named()
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
        return self._vocab.detokenize(self.check_tokens(tokens), _bool_arg("special", special)).decode(
            "utf-8", errors="replace")

    def token_to_piece(self, token: int, special: bool = False) -> bytes:
        return self._vocab.token_to_piece(self.check_token(token), _bool_arg("special", special))

    def token_bos(self) -> int:
        return self._vocab.bos

    def token_eos(self) -> int:
        return self._vocab.eos

    def is_eog(self, token: int) -> bool:
        return self._vocab.is_eog(self.check_token(token))

    def check_token(self, t) -> int:
        """`t` as a token id of this vocabulary, or ValueError."""
        if not is_int(t):
            raise ValueError(f"a token id must be an int (not a float or bool), got {t!r}")
        if not 0 <= t < self.n_vocab:
            raise ValueError(f"token id {t} is outside the vocabulary [0, {self.n_vocab})")
        return int(t)

    def check_tokens(self, tokens) -> List[int]:
        """`tokens` (a sequence or 1-D integer array) as a list of token ids of this vocabulary, or
        ValueError."""
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
    def lock(self) -> ModelLock:
        """Held by every call that runs the engine; hold it across calls that share the cache."""
        return self._lock

    @property
    def n_past(self) -> int:
        """Positions sequence 0 of the KV cache holds (cache_used: every sequence's)."""
        return self._engine.n_past

    @property
    def river_has_head(self) -> bool:
        return self._engine.river_has_head

    @property
    def lossless_kernels(self) -> str:
        """The kernels lossless verify batches use here: "decode" (each row a decode step's, so the
        text is plain decoding's bit for bit) where asked (lossless_kernels="decode") and the
        engine can (every layer on the CPU, no backbone weight repacked), else "batch"."""
        if self._lossless_kernels == "decode" and self._engine.decode_kernels_exact:
            return "decode"
        return "batch"

    # ----- sessions: who the cache holds ------------------------------------------------
    def session(self, options: Optional[ExitOptions] = None, *, seq: int = 0, keep_rows: bool = False,
                verify_kernels: Optional[bool] = None, **overrides) -> Session:
        """A Session over sequence `seq` of this Model's KV cache (river_gguf.session): the one
        token loop. options: resolved ExitOptions (from options()), or the keyword overrides
        options() takes. seq: an int in [0, n_ctx); sessions on different sequences keep their
        tokens side by side and, decoding at once from several threads, share each decode
        step's batch (a lossless session's rounds run alone, under the lock). keep_rows: keep every position's
        logits row. verify_kernels: where lossless_kernels is "batch", decode steps in the verify
        batch's kernels (each with a throwaway token), so that their text is lossless mode's bit
        for bit (default: the Model's verify_kernels option; with "decode" kernels every decode
        step is lossless mode's already)."""
        if options is not None and overrides:
            raise ValueError("give options or keyword overrides, not both")
        seq = _int_arg("seq", seq, 0, self.n_ctx - 1)
        opts = self.options(**overrides) if options is None else options
        if not isinstance(opts, ExitOptions):
            raise ValueError(f"options must be ExitOptions (from Model.options), got {type(opts).__name__}")
        return Session(self, self._engine, self._lock, opts, keep_rows=_bool_arg("keep_rows", keep_rows),
                       verify_kernels=self.verify_kernels if verify_kernels is None
                       else _bool_arg("verify_kernels", verify_kernels), seq=seq, batcher=self._steps,
                       decode_kernels=self.lossless_kernels == "decode")

    @property
    def step_window(self) -> float:
        """Seconds a decode step of a session waits for the other sessions decoding at once to
        submit theirs, before its batch runs without them (river_gguf.batching)."""
        return self._steps.window

    @step_window.setter
    def step_window(self, seconds: float) -> None:
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds <= 10:
            raise ValueError(f"step_window must be a number of seconds in [0, 10], got {seconds!r}")
        self._steps.window = float(seconds)

    @property
    def step_counts(self) -> dict:
        """The step batcher's counts: batches evaluated, the decode steps they held, and the
        sessions in a decode loop now (river_gguf.batching.StepBatcher.counts)."""
        return self._steps.counts

    def holds_cache(self, session: Session) -> bool:
        """Whether the cache holds `session`'s tokens (no other call used its sequence since)."""
        return self._holders.get(session.seq) is session

    def give_cache(self, session: Optional[Session], only_from: Optional[Session] = None) -> None:
        """Hand `session`'s sequence to it, cleared (None: the whole cache to one-shot calls,
        cleared). only_from: only when that session holds its sequence, and then without clearing
        sequence 0 (a session letting it go; another sequence's rows are freed)."""
        with self._lock:
            if only_from is not None:
                seq = only_from.seq
                if self._holders.get(seq) is only_from:
                    if session is None:
                        del self._holders[seq]
                        if seq != 0:
                            self._engine.truncate(0, seq=seq)
                    else:
                        self._holders[seq] = session
                return
            if session is None:
                self._clear()
                return
            self._engine.truncate(0, seq=session.seq)
            self._holders[session.seq] = session

    def _clear(self) -> None:
        self._holders.clear()
        for s in [0] + list(self._engine.sequences):
            self._engine.truncate(0, seq=s)

    @property
    def cache_used(self) -> int:
        """Cache rows that hold a token of any sequence."""
        return self._engine.cache_used

    @_locked
    def collect_activations(self, tokens: Sequence[int], stats) -> None:
        """One backbone pass over `tokens` from an empty cache, adding each mat-mul's input
        activations to `stats` (native.ActivationStats, for the importance matrix)."""
        toks = self.check_tokens(tokens)
        self._clear()
        self._engine.collect_activations(toks, stats)
        self._engine.truncate(0)

    @_locked
    def logits(self, tokens: Sequence[int], first_row: int = 0, **options) -> np.ndarray:
        """Logits for every position of `tokens` in one batched pass: float32 [len(tokens), n_vocab].
        first_row: only positions first_row.. (the head runs those alone; `tokens` must then fit
        one batch, n_batch)."""
        toks = self.check_batch(tokens) if first_row else self.check_tokens(tokens)
        if not toks:
            raise ValueError("no tokens")
        first_row = _int_arg("first_row", first_row, 0, len(toks) - 1)
        opts = self.options(**options)
        self._clear()
        out, _, _ = evaluate(self._engine, toks, opts, prompt=True, all_logits=True, first_row=first_row)
        return out

    @_locked
    def embed(self, tokens: Sequence[int]) -> np.ndarray:
        """The backbone's final-norm output for every position of `tokens`, in one pass from an
        empty cache: float32 [len(tokens), n_embd], llama.cpp's embeddings with pooling none
        (the rows the head reads). Embeddings are the precise model's, so no exit applies."""
        toks = self.check_tokens(tokens)
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


    def check_batch(self, tokens: Sequence[int]) -> List[int]:
        """The checked tokens of a call that runs them as one batch (at most n_batch, at least one)."""
        toks = self.check_tokens(tokens)
        if not toks:
            raise ValueError("no tokens")
        if len(toks) > self._n_batch:
            raise ValueError(f"{len(toks)} tokens do not fit in one batch (n_batch={self._n_batch})")
        return toks

    # ----- calibration passes: native passes that no decode loop can express ----------------
    @_locked
    def river_tails_pass(self, tokens: List[int], tails: List[int], backbone_attention: bool, river_head: bool,
                         first_row: int, start=None, keep: bool = False):
        """The native Engine.river_tails over checked arguments (river_gguf.measure.tails.river_tails
        checks them): one batched pass, from an empty cache, of the river layers the tails share,
        each tail then running its own backbone layers and the head on rows first_row..; the
        cache is left empty. start: (layer, hidden state entering that river layer), a state
        `keep` gave: the pass begins there. Refuses non-finite logits. Returns the rows per tail,
        and with keep also {layer: hidden state} of each branch."""
        layer, hidden = (0, None) if start is None else start
        self._clear()
        try:
            got = self._engine.river_tails(tokens, tails, backbone_attention=backbone_attention,
                                           river_head=river_head, first_row=first_row, start_layer=layer,
                                           start_hidden=hidden, keep_hidden=keep)
        finally:
            self._clear()
        rows = got[0] if keep else got
        for r in rows:
            if not np.isfinite(r).all():
                raise NumericalError("the model produced NaN or infinite logits (mode='river-only'); its weights or "
                                     "hyperparameters are broken, so no score is returned")
        return got

    def backbone_session(self, n_ctx: int, options: ExitOptions) -> Session:
        """A Session on a short-lived backbone engine of its own (this file, no river) with room for
        n_ctx positions: a profile's length does not depend on this Model's n_ctx, and this
        Model's KV cache (and any session on it) is left alone. The engine's weights map and KV
        cache go with the session's last reference."""
        n_ctx = _int_arg("n_ctx", n_ctx, 1, MAX_CTX)
        with deferred_interrupts():
            engine = native.Engine(self.model_path, "", n_ctx=n_ctx, n_threads=self.n_threads,
                                   n_batch=min(self._n_batch, n_ctx), n_gpu_layers=self._n_gpu_layers,
                                   use_mmap=self._use_mmap, flash_attn=self.flash_attn,
                                   exit_decision=self._exit_decision,
                                   main_gpu=self._main_gpu, gpu_memory=self._gpu_memory)
        # It counts positions against its own n_ctx and shares its cache with nobody.
        return Session(self, engine, threading.RLock(), options, own_cache=True)

    # ----- inspection: read-only facts of the engine, for diagnostics and tests ----------------
    @property
    def file_options(self) -> ExitOptions:
        """The exit setting the file stores (its river.* keys, as the engine read them; plain
        files: backbone), before any preset or override."""
        return self._base_options

    @property
    def gpu_offload(self) -> bool:
        """Whether any layer or the head runs on a GPU."""
        return self._engine.gpu_offload

    @property
    def gpu_layers(self) -> int:
        """Layers placed on the GPU: fewer than n_gpu_layers asked when they did not fit."""
        return self._engine.gpu_layers

    @property
    def flash_attn(self) -> bool:
        """Whether attention runs as llama.cpp's with flash attention on (the engine's setting)."""
        return self._engine.flash_attn

    @property
    def exits_on_graph(self) -> bool:
        """Whether the dynamic exit's test runs as graph ops on the layer's device (exit_decision
        "graph", or "auto" with offloaded layers) rather than as a CPU op."""
        return self._engine.exits_on_graph

    @property
    def graph_counts(self) -> dict:
        """How many compute graphs the engine built since it loaded ("built") and keeps for reuse
        ("kept"): a step whose shape matches a kept graph builds none."""
        return {"built": self._engine.graphs_built, "kept": self._engine.kept_graphs}

    def cache_rows(self, layer: int, values: bool, n: int) -> np.ndarray:
        """KV cache layer `layer`, positions [0, n) of K (values=False) or V, as float32 [n, width]:
        a read-only look at what the cache holds (every written slot is a real vector; see
        cache_poison for an unwritten one)."""
        layer = _int_arg("layer", layer, 0, self.n_layer - 1)
        n = _int_arg("n", n, 1, self.n_ctx)
        with self._lock:
            return self._engine.cache_rows(layer, _bool_arg("values", values), n)

    def cache_poison(self, layer: int) -> float:
        """What an unwritten entry of layer `layer`'s cache holds: NaN, or native
        Engine.POISON_NO_FLASH where attention spans masked rows (no flash attention, or a cache
        in device memory)."""
        return self._engine.cache_poison(_int_arg("layer", layer, 0, self.n_layer - 1))
