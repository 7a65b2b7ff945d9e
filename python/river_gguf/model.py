"""The high-level model: load a GGUF (optionally with a river), tokenize, score, generate.

One Model may be used from one thread at a time: it owns one KV cache.
"""
import os
from dataclasses import replace
from typing import List, Optional, Sequence, Union

import numpy as np

from ._loader import native
from . import presets
from .options import ExitOptions
from .results import Generation, ScoreResult, log_softmax_at
from . import completions, generation
from .chat import format_chat

Prompt = Union[str, Sequence[int]]


def _default_threads() -> int:
    # llama-cpp-python's default: half the logical CPUs, at least one.
    return max((os.cpu_count() or 2) // 2, 1)


class Model:
    """A GGUF model on the river_gguf engine.

    model_path: a GGUF file (plain or River GGUF); None loads the default SmolLM2-135M-Instruct.
    river: a second GGUF of the same model at lower precision, used as the exit river.
    mode, threshold, min_exit_layer, river_head, prefill, tail: defaults for every call; a River
    GGUF supplies its own, and each call may override them.
    preset: one of the River GGUF's named settings ("fast", "balanced", "quality"; default: the
    file's default preset, "balanced"); explicit options override it.
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
        mode: Optional[str] = None,
        threshold: Optional[float] = None,
        min_exit_layer: Optional[int] = None,
        river_head: Optional[bool] = None,
        prefill: Optional[str] = None,
        tail: Optional[int] = None,
        preset: Optional[str] = None,
        verbose: bool = False,
    ):
        if model_path is None:
            from .default_model import default_model_path

            model_path = default_model_path()
        model_path = os.fspath(model_path)
        for p in [model_path] + ([os.fspath(river)] if river is not None else []):
            if not os.path.exists(p):
                raise FileNotFoundError(f"model file not found: {p}")
        for name, v, lo in (("n_ctx", n_ctx, 1), ("n_batch", n_batch, 1)):
            if not isinstance(v, int) or v < lo:
                raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
        if n_threads is None:
            n_threads = _default_threads()
        if not isinstance(n_threads, int) or n_threads < 1:
            raise ValueError(f"n_threads must be an int >= 1, got {n_threads!r}")
        if not isinstance(n_gpu_layers, int):
            raise ValueError(f"n_gpu_layers must be an int, got {n_gpu_layers!r}")
        n_gpu_layers = 1 << 30 if n_gpu_layers < 0 else n_gpu_layers  # -1: everything, as in llama.cpp

        import llama_cpp._logger as llama_logger

        llama_logger.set_verbose(verbose)  # libllama's vocab loader is chatty
        self.model_path = model_path
        self.river_path = os.fspath(river) if river is not None else None
        self._engine = native.Engine(model_path, self.river_path or "", n_ctx, n_threads, n_batch, n_gpu_layers)
        self._vocab = native.Vocab(model_path)
        self.hparams = self._engine.hparams
        self.metadata = self._engine.metadata
        self.n_threads = n_threads
        if self._vocab.n_tokens != self.n_vocab:
            raise native.GGUFFormatError(
                f"{model_path}: vocabulary has {self._vocab.n_tokens} tokens but token_embd has {self.n_vocab} rows"
            )
        self.exit_options = ExitOptions()  # backbone-only while the file's defaults are worked out
        self.presets = presets.parse(self.metadata) if self.has_river else {}
        if preset is not None and not self.presets:
            raise ValueError(f"preset={preset!r}, but {model_path} stores no presets "
                             "(calibrate it: river-gguf calibrate MODEL --write)")
        self.preset = preset if preset is not None else (
            self.metadata.get(presets.DEFAULT_KEY, presets.DEFAULT_PRESET) if self.presets else None)
        self._base_options = self._file_exit_options(profile=threshold is None and not self.presets)
        self.exit_options = self._with_preset(self._base_options, self.preset).with_overrides(
            mode=mode, threshold=threshold, min_exit_layer=min_exit_layer, river_head=river_head, prefill=prefill,
            tail=tail,
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
        if name not in self.presets:
            raise ValueError(f"unknown preset {name!r}; this file has: {', '.join(sorted(self.presets)) or 'none'}")
        opts = dict(self.presets[name]["options"])
        # A preset is a whole setting: what it leaves out takes the plain defaults, not the
        # previous preset's values.
        return replace(base, exit_layer=None, **opts)

    def _options(self, preset: Optional[str] = None, **overrides) -> ExitOptions:
        base = self.exit_options if preset is None else self._with_preset(self._base_options, preset)
        return base.with_overrides(**overrides).validate(self.n_layer, self.has_river)

    # ----- vocabulary -------------------------------------------------------------------
    def tokenize(self, text: Union[str, bytes], add_special: bool = True, parse_special: bool = False) -> List[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        if not isinstance(text, str):
            raise TypeError(f"text must be str or bytes, got {type(text).__name__}")
        return list(self._vocab.tokenize(text, add_special, parse_special))

    def detokenize(self, tokens: Sequence[int], special: bool = False) -> str:
        return self._vocab.detokenize(self._check_tokens(tokens), special).decode("utf-8", errors="replace")

    def token_to_piece(self, token: int, special: bool = False) -> bytes:
        return self._vocab.token_to_piece(int(token), special)

    def token_bos(self) -> int:
        return self._vocab.bos

    def token_eos(self) -> int:
        return self._vocab.eos

    def is_eog(self, token: int) -> bool:
        return self._vocab.is_eog(int(token))

    def _check_tokens(self, tokens) -> List[int]:
        out = [int(t) for t in tokens]
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
    def _eval(self, tokens: List[int], opts: ExitOptions, prompt: bool, all_logits=False, trace=False):
        return self._engine.eval(tokens, all_logits=all_logits, trace=trace, **opts.engine_args(prompt))

    def logits(self, tokens: Sequence[int], **options) -> np.ndarray:
        """Logits for every position of `tokens` in one batched pass: float32 [len(tokens), n_vocab]."""
        toks = self._check_tokens(tokens)
        if not toks:
            raise ValueError("no tokens")
        opts = self._options(**options)
        self._engine.truncate(0)
        out, _, _ = self._eval(toks, opts, prompt=True, all_logits=True)
        return out

    def score(self, tokens: Sequence[int], prefix: int = 1, **options) -> ScoreResult:
        """Teacher-forced scoring through the decode path: prefill tokens[:prefix], then feed the
        rest one at a time, with exits, and report log p of each actual next token."""
        toks = self._check_tokens(tokens)
        if not isinstance(prefix, int) or not 1 <= prefix < len(toks):
            raise ValueError(f"prefix must be an int in [1, {len(toks) - 1}], got {prefix!r}")
        if len(toks) > self.n_ctx:
            raise native.ContextOverflowError(f"{len(toks)} tokens do not fit in n_ctx={self.n_ctx}")
        opts = self._options(**options)
        self._engine.truncate(0)
        logits, exit_layer, _ = self._eval(toks[:prefix], opts, prompt=True)
        logprobs, exits = [], []
        for i in range(prefix, len(toks)):
            logprobs.append(log_softmax_at(logits[-1], toks[i]))
            exits.append(exit_layer)
            if i + 1 < len(toks):
                logits, exit_layer, _ = self._eval([toks[i]], opts, prompt=False)
        return ScoreResult(np.array(logprobs), np.array(exits, dtype=np.int32))

    def similarity_trace(self, tokens: Sequence[int], **options) -> List[List[float]]:
        """Per decode step, cos(h_in, h_out) of every backbone layer run (for analysis)."""
        toks = self._check_tokens(tokens)
        opts = self._options(**options)
        self._engine.truncate(0)
        traces = []
        self._eval(toks[:1], opts, prompt=True)
        for t in toks[1:]:
            _, _, sims = self._eval([t], opts, prompt=False, trace=True)
            traces.append(list(sims))
        return traces

    # ----- generation -------------------------------------------------------------------
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
        """Iterate over text pieces as they are generated; `.generation` holds the result after."""
        from .sampling import Sampler

        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 0):
            raise ValueError(f"max_tokens must be an int >= 0 or None, got {max_tokens!r}")
        sampler = Sampler(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                          repeat_penalty=repeat_penalty, seed=seed)
        opts = self._options(**options)
        toks = self._prompt_tokens(prompt)
        return generation.Stream(self, toks, max_tokens, sampler, opts, stop)

    # ----- OpenAI-style API (llama_cpp.Llama compatible shapes) -------------------------
    def create_completion(self, prompt: Prompt, max_tokens: Optional[int] = 16, temperature: float = 0.8,
                          top_p: float = 0.95, min_p: float = 0.05, top_k: int = 40, repeat_penalty: float = 1.0,
                          seed: Optional[int] = None, stop=None, stream: bool = False, **options):
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
        prompt = self.chat_prompt(messages)
        s = self.stream(prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p, min_p=min_p,
                        top_k=top_k, repeat_penalty=repeat_penalty, seed=seed, stop=stop, **options)
        cid, created, name = completions.new_id("chatcmpl"), completions.now(), self.model_path
        if stream:
            return completions.chat_chunks(cid, created, name, s, finish_reason=lambda: s.generation.finish_reason,
                                           extra=lambda: s.generation.stats)
        for _ in s:
            pass
        g = s.generation
        return completions.chat_response(cid, created, name, g.text, g.finish_reason,
                                         len(s.prompt_tokens), len(g.tokens), extra=g.stats)

