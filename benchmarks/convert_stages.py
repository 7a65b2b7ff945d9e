"""Where a conversion's CPU time goes, stage by stage, and how much work each stage does, in
one process: CPU seconds (time.process_time: every thread of the process, so a shared,
noisy machine inflates it far less than wall time) and counts of the work (tokens through
the backbone and the river, layer passes, head rows, reference rows read back, KLD rows).

    .venv/bin/python benchmarks/convert_stages.py MODEL [--tokens 256] [--threads 1]
        [--river-type q4_k_m] [--json OUT.json]

MODEL is an F16 path, a model_zoo name (its F16) or a name in river_gguf.eval.random_model's
RANDOM_SHAPES (a random-weight F16 of that shape). The conversion is build_river_gguf with its
defaults (and --tokens as calibration_tokens: a cut-down calibration keeps the counts honest at a
fraction of the time). Each stage is the converter's own step function, timed exclusively (a
stage inside another counts only in the inner one); the work counters wrap the Model's batched
passes, so they count what the engine was asked to do, not what a plan predicts.
"""
import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from collections import defaultdict

try:  # an installed river_gguf (the checkout's python/ has no native module)
    import river_gguf  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/convert_cost.py
from river_gguf.calibrate import preset_grid  # noqa: E402
from river_gguf.convert import build  # noqa: E402
from river_gguf.measure import divergence, tails  # noqa: E402
from river_gguf.model import Model  # noqa: E402


class StageClock:
    """Exclusive CPU seconds and wall seconds per named stage (a stack: an inner stage's time
    is not its caller's), and work counters per stage."""

    def __init__(self):
        self.cpu = defaultdict(float)
        self.wall = defaultdict(float)
        self.calls = defaultdict(int)
        self.work = defaultdict(lambda: defaultdict(int))
        self._stack = []  # [name, cpu at entry, wall at entry, children's cpu, children's wall]

    @contextlib.contextmanager
    def stage(self, name):
        self._stack.append([name, time.process_time(), time.perf_counter(), 0.0, 0.0])
        try:
            yield
        finally:
            name, c0, w0, cc, cw = self._stack.pop()
            dc, dw = time.process_time() - c0, time.perf_counter() - w0
            self.cpu[name] += dc - cc
            self.wall[name] += dw - cw
            self.calls[name] += 1
            if self._stack:
                self._stack[-1][3] += dc
                self._stack[-1][4] += dw

    def current(self):
        """The innermost stage of the converter's own (an engine pass's caller)."""
        return self._stack[-1][0].split(" /")[0] if self._stack else "(outside)"

    def count(self, what, n):
        self.work[self.current()][what] += int(n)


def _wrap(owner, attr, clock, name, counter=None):
    """Time owner.attr as stage `name`; a name starting with "/" is a pass of the engine, named
    after the stage that asked for it ("presets /logits")."""
    fn = getattr(owner, attr)

    def wrapped(*args, **kwargs):
        with clock.stage(clock.current() + " " + name if name.startswith("/") else name):
            if counter is not None:
                counter(*args, **kwargs)
            return fn(*args, **kwargs)

    setattr(owner, attr, wrapped)


def instrument(clock):
    """Time the converter's steps and count the Model's passes (monkeypatched: this process only)."""
    for attr, name in (("_open_model", "open model"), ("disk_plan", "disk plan"), ("sha256_file", "sha256"),
                       ("draft_token_ranking", "draft vocabulary"), ("_quantize", "backbone quantize"),
                       ("_write_staged", "write"), ("compare_models", "compare models"),
                       ("similarity_profile", "threshold profile"), ("default_threshold", "threshold"),
                       ("calibration_selection", "calibration items"), ("open_reader", "gguf reader")):
        _wrap(build, attr, clock, name)
    _wrap(build.imx, "collect_on", clock, "imatrix")
    _wrap(build.imx, "llama_quantize", clock, "river quantize")
    _wrap(build, "_measure_presets", clock, "presets")
    _wrap(build._CalibrationPass, "_run", clock, "one pass over the input")
    _wrap(build.divergence, "config_logits", clock, "/config_logits")
    _wrap(preset_grid._Scorer, "measure", clock, "presets",
          lambda self, settings: clock.count("settings measured", len(settings)) or clock.count("rounds", 1))
    _wrap(preset_grid, "river_tails", clock, "/river_tails")
    _wrap(preset_grid._Scorer, "_reference", clock, "/reference read")
    _wrap(divergence, "compare_many", clock, "/KLD compare",
          lambda ref, qs, t: clock.count("KLD rows", len(t) * len(qs)) or clock.count("reference softmax rows", len(t)))

    def logits_work(self, tokens, first_row=0, **options):
        n = len(tokens)
        mode = options.get("mode", "backbone")
        tail = int(options.get("tail", 0) or 0)
        clock.count(f"tokens: {mode}", n)
        if mode == "backbone":
            clock.count("backbone layer-tokens", n * self.n_layer)
        else:
            clock.count("river layer-tokens", n * (self.n_layer - tail))
            clock.count("backbone layer-tokens", n * tail)
        clock.count("head rows", n - first_row)

    def tails_work(self, tokens, tails, backbone_attention, river_head, first_row):
        n = len(tokens)
        clock.count("tokens: river tails pass", n)
        clock.count("river layer-tokens", n * (self.n_layer - min(tails)))
        clock.count("backbone layer-tokens", n * sum(tails))
        clock.count("head rows", (n - first_row) * len(tails))

    def activations_work(self, tokens, stats):
        clock.count("tokens: imatrix", len(tokens))
        clock.count("backbone layer-tokens", len(tokens) * self.n_layer)
        clock.count("final-norm rows (the head's input, no head)", len(tokens))

    _wrap(divergence, "score", clock, "/decode", lambda model, tokens, prefix=1, **o: clock.count(
        "decode steps", len(tokens) - prefix))
    _wrap(Model, "logits", clock, "/logits", logits_work)
    _wrap(Model, "river_tails_pass", clock, "/river_tails_pass", tails_work)
    _wrap(Model, "collect_activations", clock, "/collect_activations", activations_work)
    _wrap(divergence.ReferenceRows, "__getitem__", clock, "/reference rows read",
          lambda self, i: clock.count("reference rows read", self._index[i][1][0]))
    _wrap(divergence.ReferenceRows, "add", clock, "/reference rows write",
          lambda self, rows: clock.count("reference rows written", len(rows)))


def f16_of(name):
    if os.path.isfile(name):
        return os.path.abspath(name)
    from convert_cost import f16_of as cost_f16_of

    return cost_f16_of(name, 2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=None, help="calibration_tokens (default: the converter's)")
    ap.add_argument("-t", "--threads", type=int, default=1)
    ap.add_argument("--river-type", default="q4_k_m")
    ap.add_argument("--out", default=None, help="keep the output here (default: a temp file, removed)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    f16 = f16_of(a.model)
    clock = StageClock()
    instrument(clock)
    lines = []
    with tempfile.TemporaryDirectory(prefix="convert-stages-", dir=os.path.dirname(f16)) as tmp:
        out = a.out or os.path.join(tmp, "model.river.gguf")
        c0, w0 = time.process_time(), time.perf_counter()
        with clock.stage("convert (other)"):
            meta = build.build_river_gguf(f16, out, river_type=a.river_type, n_threads=a.threads, progress=False,
                                          calibration_tokens=a.tokens, report=lines.append)
        total_cpu, total_wall = time.process_time() - c0, time.perf_counter() - w0
    res = {"model": a.model, "threads": a.threads, "tokens": a.tokens, "river_type": a.river_type,
           "cpu_s": total_cpu, "wall_s": total_wall,
           "stages": {k: {"cpu_s": clock.cpu[k], "wall_s": clock.wall[k], "calls": clock.calls[k],
                          "work": dict(clock.work.get(k, {}))} for k in clock.cpu},
           "presets": meta.get("river.presets"), "steps": lines}
    print("\n".join(lines))
    print(f"\n{a.model}: {total_cpu:.1f} CPU s ({total_wall:.1f} s wall), {a.threads} thread(s)")
    print("| stage | CPU s | share | wall s | calls | work |")
    print("|---|---:|---:|---:|---:|---|")
    for k in sorted(clock.cpu, key=lambda k: -clock.cpu[k]):
        work = ", ".join(f"{w} {n:,}" for w, n in sorted(clock.work.get(k, {}).items()))
        print(f"| {k} | {clock.cpu[k]:.2f} | {clock.cpu[k] / total_cpu:.0%} | {clock.wall[k]:.2f} | "
              f"{clock.calls[k]} | {work} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
