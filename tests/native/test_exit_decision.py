"""The exit decision as graph ops (exit_decision="graph", the default when layers are offloaded)
against the CPU op (the default on a CPU-only engine), on the same CPU: the scheduler's eval
callback reads cos(h_in, h_out) computed by ggml ops on the layer's device and stops the graph at
an exit. The two paths must take the same exits and compute the same logits, and the graph
path must keep River's invariants (the rule, dynamic = forced, no cache holes)."""
import numpy as np
import pytest

from river_gguf import Model
from river_gguf.greedy import greedy
from river_gguf.measure.traces import similarity_trace
from river_gguf.options import EXIT_RULES, ExitOptions

PROSE = ("The river runs through the valley, past the old mill and the bridge, and on to the sea. "
         "In spring the water rises and the fields along its banks turn green again.")
TAUS = (0.97, 0.965, 0.96, 0.95, 0.98)


@pytest.fixture(scope="module")
def models(f16_path, q4_0_path):
    return {d: Model(f16_path, river=q4_0_path, n_ctx=256, n_threads=1, threshold=0.97, exit_decision=d)
            for d in ("cpu", "graph")}


@pytest.fixture(scope="module")
def tokens(models):
    return models["cpu"].tokenize(PROSE)


def test_which_path_runs(models, f16_path):
    assert not models["cpu"].exits_on_graph and models["graph"].exits_on_graph
    assert not Model(f16_path, n_ctx=32, n_threads=1).exits_on_graph  # auto on a CPU-only engine
    with pytest.raises(ValueError, match="exit_decision"):
        Model(f16_path, n_ctx=32, n_threads=1, exit_decision="gpu")


@pytest.mark.parametrize("rule", EXIT_RULES)
def test_similarities_agree(models, tokens, rule):
    cpu, graph = (similarity_trace(models[d], tokens[:24], mode="backbone", exit_rule=rule) for d in ("cpu", "graph"))
    assert len(cpu) == len(graph) and all(len(a) == len(b) == models["cpu"].n_layer for a, b in zip(cpu, graph))
    # The CPU op sums in double, the graph in float: the same values to float rounding (relative:
    # the update rule's scores reach far below -1 where an update outgrows the state).
    assert np.allclose(cpu, graph, rtol=1e-5, atol=1e-5)
    # A prompt pass with exits: the batch's minimum, per layer.
    prompt_exits = ExitOptions(mode="river", exit_rule=rule, threshold=0.9, prefill="river")
    passes = []
    for d in ("cpu", "graph"):
        with models[d].session(prompt_exits) as s:
            s.extend(tokens, trace=True)
            passes.append((s.exit_layer, s.scores))
    (k_cpu, s_cpu), (k_graph, s_graph) = passes
    assert k_cpu == k_graph and np.allclose(s_cpu, s_graph, rtol=1e-5, atol=1e-5)


def _mixing_tau(models, tokens):
    """The first threshold of TAUS at which the CPU path's greedy run mixes exit layers (which
    threshold does depends on the CPU's float rounding)."""
    for tau in TAUS:
        g = greedy(models["cpu"], tokens[:16], max_tokens=32, mode="river", threshold=tau)
        if len(set(g.stats["exit_layers"])) > 2:
            return tau
    pytest.fail(f"no threshold of {TAUS} mixes exits on this CPU")


def test_greedy_decoding_takes_the_same_exits(models, tokens):
    tau = _mixing_tau(models, tokens)
    cpu, graph = (greedy(models[d], tokens[:16], max_tokens=32, mode="river", threshold=tau) for d in ("cpu", "graph"))
    assert graph.tokens == cpu.tokens and graph.stats["exit_layers"] == cpu.stats["exit_layers"]


def test_graph_decision_follows_the_rule_and_equals_the_forced_exit(models, tokens):
    m = models["graph"]
    tau = _mixing_tau(models, tokens)
    exited = 0
    s = m.session(ExitOptions(mode="river", threshold=tau))
    for i in range(10, len(tokens)):
        s.truncate(0)
        s.extend(tokens[:i])
        dyn = s.extend([tokens[i]], decode=True, trace=True)
        exit_layer, sims = s.exit_layer, s.scores
        passed = [j for j, x in enumerate(sims) if x > tau]
        if exit_layer < m.n_layer - 1:
            exited += 1
            assert passed == [exit_layer]  # the first layer that passes, and the graph stopped there
            s.truncate(i)
            fixed = s.extend([tokens[i]], decode=True, options=ExitOptions(exit_layer=exit_layer))
            assert np.array_equal(dyn, fixed)
        else:
            assert passed in ([], [m.n_layer - 1])
    assert exited, f"no token of the text exited early at tau {tau} on this CPU"


def test_no_cache_holes_after_graph_exits(f16_path, q4_0_path, models, tokens):
    # A fresh model: its cache starts as NaN, so any row no layer wrote stays NaN.
    tau = _mixing_tau(models, tokens)
    m = Model(f16_path, river=q4_0_path, n_ctx=128, n_threads=1, threshold=tau, exit_decision="graph")
    g = greedy(m, tokens[:16], max_tokens=32, mode="river", threshold=tau)
    assert len(set(g.stats["exit_layers"])) > 2  # as on the CPU path, which chose tau
    n = m.n_past
    for layer in range(m.n_layer):
        for values in (False, True):
            rows = m.cache_rows(layer, values, n)
            assert np.isfinite(rows).all(), f"hole in layer {layer} {'V' if values else 'K'}"


def test_scheduler_graphs_are_reused_bit_for_bit(f16_path, q4_0_path, models, tokens):
    """Graph decisions run through a scheduler: a kept single-token graph owns one (as graphs
    with offloaded layers do), and is run again by the next step of the same spec: reuse on and
    off give the same bits, with dynamic exits, and reuse builds fewer graphs than steps."""
    from river_gguf import _native

    text = tokens * 12
    tau = _mixing_tau(models, tokens)
    runs = []
    for reuse in (True, False):
        e = _native.Engine(f16_path, q4_0_path, n_ctx=512, n_threads=1, graph_reuse=reuse, exit_decision="graph")
        e.eval(text[:240])
        built = e.graphs_built
        steps = [e.eval([t], mode=1, threshold=tau, min_exit_layer=2, river_head=True) for t in text[240:280]]
        runs.append((steps, e.graphs_built - built))
    (on, built_on), (off, built_off) = runs
    assert built_off >= 40 and built_on < built_off
    assert len({s[1] for s in on}) > 1  # a real mix of exit layers
    for (la, ea, sa), (lb, eb, sb) in zip(on, off):
        assert ea == eb and sa == sb and np.array_equal(la, lb)


def test_exit_settings_are_checked(models, tokens):
    """The exit setting's keywords are its fields (native EXIT_SETTING); a rule code names a rule."""
    from river_gguf._loader import native

    e = native.Engine(models["cpu"].model_path, models["cpu"].river_path, n_ctx=32, n_threads=1)
    assert set(models["cpu"].options(mode="river")._setting_args()) <= set(native.EXIT_SETTING)
    with pytest.raises(TypeError, match="unexpected keyword argument 'thresold'"):
        e.eval(tokens[:2], mode=1, thresold=0.9)
    with pytest.raises(ValueError, match="exit rule 99"):
        e.eval(tokens[:2], mode=1, rule=99, threshold=0.9)
    with pytest.raises(ValueError, match="bad mode"):
        e.eval(tokens[:2], mode=9)
    assert e.n_past == 0
    with pytest.raises(ValueError, match="exit_rule must be one of"):
        models["cpu"].options(exit_rule="margin")


def test_the_exit_fields_are_listed_once():
    """RiverOptions' overridable fields are ExitOptions' fields plus the preset, so that a field
    added to one and not the other fails here; presets store every one but the prompt policy."""
    from dataclasses import fields

    from river_gguf import presets
    from river_gguf.options import EXIT_FIELDS, ExitOptions

    exit_fields = {f.name for f in fields(ExitOptions)}
    assert set(EXIT_FIELDS) == exit_fields | {"preset"}
    assert set(presets.OPTION_KEYS) == exit_fields - {"prefill"}
