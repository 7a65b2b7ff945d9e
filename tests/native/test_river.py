"""River early exit against RIVER.md's invariants, with stock llama.cpp as the external oracle.

Dynamic exits have no oracle: where a test needs tokens that leave early, it picks the first of a
few thresholds for which the engine's own run has them (similarities, like the generated tokens
they are computed on, round differently on another CPU), then checks the invariant on that run."""
import numpy as np
import pytest

from river_gguf import Model
from river_gguf.greedy import greedy
from river_gguf.convert.hybrid import write_hybrid_gguf
from river_gguf.measure.teacher import score
from river_gguf.options import ExitOptions

from support import LOGIT_TOL, PROSE, THREADS


N_GREEDY = 32


@pytest.fixture(scope="module")
def river_model(f16_path, q4_0_path):
    # Backbone F16, river Q4_0: two plain GGUFs (the same checks as a River GGUF).
    return Model(f16_path, river=q4_0_path, n_ctx=512, n_threads=THREADS, threshold=0.97)


@pytest.fixture(scope="module")
def prose_tokens(river_model):
    return river_model.tokenize(PROSE)


# Thresholds to choose from, the one each test used first.
TAUS = (0.97, 0.965, 0.96, 0.95, 0.98, 0.93)


def _first_tau(run, has, what, taus=TAUS):
    """The first threshold whose run (run(tau)) has the property, and that run."""
    seen = []
    for tau in taus:
        r = run(tau)
        if has(r):
            return tau, r
        seen.append(tau)
    pytest.fail(f"no threshold of {seen} gives {what} on this CPU")


def _mixed(g):
    exits = set(g.stats["exit_layers"])
    return len(exits) > 2 and min(exits) < 10


def _assert_same_as_oracle(m, oracle, toks, **opts):
    ours = m.logits(toks, **opts)
    ref = oracle.logits(toks)
    assert np.abs(ours - ref).max() < LOGIT_TOL
    prompt = toks[:12]
    g = greedy(m, prompt, max_tokens=N_GREEDY, **opts)
    assert g.tokens == oracle.greedy(prompt, N_GREEDY)


def test_invariant1_threshold_above_one_is_the_backbone(river_model, prose_tokens):
    river = score(river_model, prose_tokens, prefix=8, mode="river", threshold=1.01)
    backbone = score(river_model, prose_tokens, prefix=8, mode="backbone")
    assert np.array_equal(river.logprobs, backbone.logprobs)
    assert (river.exit_layers == river_model.n_layer - 1).all()
    # The same through the layer-by-layer path (trace=True skips the fused shortcut for tau > 1).
    with river_model.session(ExitOptions(mode="river", threshold=1.01)) as s:
        s.extend(prose_tokens[:8])
        steps = [(s.extend([t], decode=True, trace=True), s.exit_layer, s.scores) for t in prose_tokens[8:20]]
    for i, (logits, exit_layer, sims) in enumerate(steps):
        assert exit_layer == river_model.n_layer - 1 and len(sims) == river_model.n_layer
        lp = logits.astype(np.float64)
        lp = lp[prose_tokens[9 + i]] - lp.max() - np.log(np.exp(lp - lp.max()).sum())
        assert abs(lp - backbone.logprobs[1 + i]) < 1e-4
    a = greedy(river_model, prose_tokens[:10], max_tokens=24, mode="river", threshold=1.01)
    b = greedy(river_model, prose_tokens[:10], max_tokens=24, mode="backbone")
    assert a.tokens == b.tokens and a.stats["river_layer_share"] == 0.0


@pytest.mark.parametrize("k", [0, 6, 17, 28])
def test_invariant2_forced_exit_equals_hybrid_gguf_in_llama_cpp(k, river_model, prose_tokens, f16_path, q4_0_path,
                                                                 tmp_path, oracle_factory):
    hybrid = tmp_path / f"hybrid-{k}.gguf"
    write_hybrid_gguf(f16_path, q4_0_path, hybrid, exit_layer=k, river_head=False)
    _assert_same_as_oracle(river_model, oracle_factory(str(hybrid)), prose_tokens, exit_layer=k, river_head=False)


def test_invariant2_with_river_head(river_model, prose_tokens, f16_path, q4_0_path, tmp_path, oracle_factory):
    hybrid = tmp_path / "hybrid-rh.gguf"
    write_hybrid_gguf(f16_path, q4_0_path, hybrid, exit_layer=6, river_head=True)
    _assert_same_as_oracle(river_model, oracle_factory(str(hybrid)), prose_tokens, exit_layer=6, river_head=True)


@pytest.mark.parametrize("k,tail,river_head", [(6, 2, False), (-1, 4, True), (20, 3, True)])
def test_invariant5_forced_exit_with_tail_equals_hybrid_gguf(k, tail, river_head, river_model, prose_tokens,
                                                            f16_path, q4_0_path, tmp_path, oracle_factory):
    # Layers 0..k and the last `tail` from the backbone, the rest from the river.
    hybrid = tmp_path / f"hybrid-{k}-tail{tail}.gguf"
    write_hybrid_gguf(f16_path, q4_0_path, hybrid, exit_layer=k, river_head=river_head, tail=tail)
    opts = dict(exit_layer=k, tail=tail, river_head=river_head) if k >= 0 else \
        dict(mode="river-only", tail=tail, river_head=river_head)
    _assert_same_as_oracle(river_model, oracle_factory(str(hybrid)), prose_tokens, **opts)


def test_dynamic_exit_with_tail_runs_the_tail_on_the_backbone(river_model, prose_tokens):
    # A dynamic step that exits at k with a tail equals the forced exit at k with that tail, and
    # exits never happen inside the tail's reach (the river needs at least one layer).
    L = river_model.n_layer
    prompt = prose_tokens[:10]
    for tau in TAUS:  # until a threshold lets some token exit: the comparison needs one
        exits = []
        s = river_model.session(ExitOptions(mode="river", threshold=tau, tail=4))
        for tok in prose_tokens[10:22]:
            s.truncate(0)
            s.extend(prompt)
            dyn = s.extend([tok], decode=True)
            k = s.exit_layer
            exits.append(k)
            assert k == L - 1 or k < L - 1 - 4
            if k < L - 1:
                s.truncate(len(prompt))
                fixed = s.extend([tok], decode=True, options=ExitOptions(exit_layer=k, tail=4))
                assert np.array_equal(dyn, fixed)
        s.close()
        if any(k < L - 1 for k in exits):
            break
    else:
        pytest.fail(f"no token exits early with tail 4 at any threshold of {TAUS} on this CPU")


def test_invariant3_river_only_equals_river_gguf(river_model, prose_tokens, q4_0_path, oracle_factory):
    # With the river head, river-only runs exactly the river file: its embeddings, layers, head.
    _assert_same_as_oracle(river_model, oracle_factory(q4_0_path), prose_tokens, mode="river-only", river_head=True)


def test_invariant3_river_only_with_backbone_head(river_model, prose_tokens, f16_path, q4_0_path, tmp_path,
                                                  oracle_factory):
    hybrid = tmp_path / "hybrid-river-only.gguf"
    write_hybrid_gguf(f16_path, q4_0_path, hybrid, exit_layer=-1, river_head=False)
    _assert_same_as_oracle(river_model, oracle_factory(str(hybrid)), prose_tokens, mode="river-only",
                           river_head=False)


def test_invariant4_no_cache_holes_after_mixed_exits(f16_path, q4_0_path, prose_tokens, river_model):
    # The threshold: the first that gives a real mix of exits (found on the module's model).
    tau, _ = _first_tau(lambda t: greedy(river_model, prose_tokens[:16], max_tokens=48, mode="river", threshold=t),
                        _mixed, "a real mix of exits", taus=(0.965,) + TAUS)
    # A fresh model: its cache starts as NaN, so any slot no layer wrote stays NaN.
    # threshold given: no similarity profile runs at load, so no step has touched the cache yet.
    m = Model(f16_path, river=q4_0_path, n_ctx=256, n_threads=THREADS, threshold=tau)
    assert np.isnan(m.cache_rows(0, False, 4)).all()
    g = greedy(m, prose_tokens[:16], max_tokens=48, mode="river", threshold=tau)
    assert _mixed(g), f"want a real mix of exits, got {g.stats['exit_histogram']}"
    n = m.n_past
    # Every token but the last was fed back (the last too when EOS, not the length, ended it).
    assert n == 16 + len(g.tokens) - (1 if g.finish_reason == "length" else 0)
    for layer in range(m.n_layer):
        for values in (False, True):
            rows = m.cache_rows(layer, values, n)
            assert np.isfinite(rows).all(), f"hole in layer {layer} {'V' if values else 'K'}"
            assert np.abs(rows).max(axis=1).min() > 0  # every row holds a real vector
    # Past the last written position, the poison is still there: the check above can fail.
    assert np.isnan(m.cache_rows(0, False, n + 1)[n]).all()


def test_exit_decision_follows_the_similarity_rule(river_model, prose_tokens):
    tau = 0.97
    for min_exit in (0, 4):
        s = river_model.session(ExitOptions(mode="river", threshold=tau, min_exit_layer=min_exit))
        s.extend(prose_tokens[:10])
        for t in prose_tokens[10:30]:
            s.extend([t], decode=True, trace=True)
            exit_layer, sims = s.exit_layer, s.scores
            # sims[i] belongs to backbone layer min_exit + i; the token leaves at the first that passes.
            passed = [min_exit + i for i, s in enumerate(sims) if s > tau]
            if exit_layer < river_model.n_layer - 1:
                assert passed == [exit_layer]
            else:
                assert passed == [] or passed == [river_model.n_layer - 1]
            assert exit_layer >= min_exit


def test_dynamic_exit_step_equals_forced_exit_step(river_model, prose_tokens):
    s = river_model.session(ExitOptions(mode="river", threshold=0.96))
    # The first position (from 20 on) whose token exits before the last layer at tau 0.96.
    for i in range(20, len(prose_tokens)):
        prompt, tok = prose_tokens[:i], prose_tokens[i]
        s.truncate(0)
        s.extend(prompt)
        dyn = s.extend([tok], decode=True)
        exit_layer = s.exit_layer
        if exit_layer < river_model.n_layer - 1:
            break
    else:
        pytest.fail("no token of PROSE from position 20 on exits early at tau 0.96 on this CPU")
    s.truncate(len(prompt))
    fixed = s.extend([tok], decode=True, options=ExitOptions(exit_layer=exit_layer))
    assert np.array_equal(dyn, fixed)


def test_river_prefill_uses_the_min_rule(river_model, prose_tokens):
    with river_model.session(ExitOptions(mode="river", threshold=0.9, prefill="river")) as s:
        s.extend(prose_tokens, trace=True)
        exit_layer, sims = s.exit_layer, s.scores
    # The trace holds every prompt token's score of each layer run; the batch exits at the first
    # layer whose *minimum* over the prompt's tokens passes.
    layers_run = len(sims) // len(prose_tokens)
    assert layers_run * len(prose_tokens) == len(sims) and layers_run > exit_layer
    minima = np.asarray(sims).reshape(layers_run, len(prose_tokens)).min(axis=1)
    passed = [i for i, x in enumerate(minima) if x > 0.9]
    assert exit_layer == (passed[0] if passed else river_model.n_layer - 1)
    m = river_model
    a = greedy(m, prose_tokens[:20], max_tokens=4, mode="river", threshold=-1.0, prefill="river")
    assert a.stats["exit_layers"][0] == 0  # tau=-1 sends the whole prompt out after layer 0
    b = greedy(m, prose_tokens[:20], max_tokens=4, mode="river", threshold=-1.0, prefill="backbone")
    assert b.stats["exit_layers"][0] == m.n_layer - 1


def test_generation_stats(river_model, prose_tokens):
    L = river_model.n_layer

    def run(tau, **kw):
        return greedy(river_model, prose_tokens[:12], max_tokens=20, mode="river", threshold=tau, river_head=True,
                                    **kw)

    # A threshold at which some token leaves early, so the share has something to count.
    tau, g = _first_tau(run, lambda g: any(e < L - 1 for e in g.stats["exit_layers"]), "an early exit")
    s, n = g.stats, len(g.tokens)
    assert (n == 20) == (g.finish_reason == "length")
    assert len(s["exit_layers"]) == n and sum(s["exit_histogram"].values()) == n
    assert s["mean_exit_layer"] == pytest.approx(np.mean(s["exit_layers"]))
    assert s["river_layer_share"] == pytest.approx(sum(L - 1 - e for e in s["exit_layers"]) / (n * L))
    assert 0 < s["river_layer_share"] < 1
    # With a tail the last layers are backbone again: they do not count as river layers.
    t = run(tau, tail=3)
    ts, nt = t.stats, len(t.tokens)
    assert ts["tail"] == 3 and len(ts["exit_layers"]) == nt
    assert ts["river_layer_share"] == pytest.approx(
        sum(max(L - 4 - e, 0) for e in ts["exit_layers"]) / (nt * L))


def test_graph_reuse_changes_no_logit_across_a_padding_boundary(f16_path, q4_0_path):
    # Decode graphs are kept and reused while n_kv (padded to 256) is unchanged. Reuse on and off
    # must give the same bits, with dynamic exits, across the 256-position boundary where the
    # padded n_kv grows and a new set of graphs is built.
    from river_gguf import _native

    text = (PROSE + " ") * 6
    runs = []
    for reuse in (True, False):
        e = _native.Engine(f16_path, q4_0_path, n_ctx=512, n_threads=THREADS, graph_reuse=reuse)
        m = Model(f16_path, n_ctx=8)  # only for the tokenizer
        toks = m.tokenize(text)[:300]
        assert len(toks) == 300
        e.eval(toks[:240])
        steps = [e.eval([t], mode=1, threshold=0.97, min_exit_layer=2, river_head=True, tail=t % 3)
                 for t in toks[240:280]]
        runs.append((steps, e.kept_graphs))
    (on, kept_on), (off, kept_off) = runs
    assert kept_off == 0 and kept_on > 1
    assert len({s[1] for s in on}) > 1  # a real mix of exit layers
    for (la, ea, sa), (lb, eb, sb) in zip(on, off):
        assert ea == eb and sa == sb and np.array_equal(la, lb)


def test_joined_qkv_and_gate_up_change_no_logit(f16_path, q4_0_path, oracle_factory):
    # CPU layers (the Q4_0 river, repacked; the F16 backbone) run Q/K/V and gate/up as one mul_mat each. Every
    # output row is the same dot product, so the logits are the same bits as with separate
    # mul_mats, and as llama.cpp's on the river file, in prefill and in decode steps.
    from river_gguf import _native

    m = Model(f16_path, n_ctx=8)  # only for the tokenizer
    toks = m.tokenize(PROSE)[:40]
    runs = []
    for fuse in (True, False):
        e = _native.Engine(f16_path, q4_0_path, n_ctx=128, n_threads=THREADS, fuse=fuse)
        prompt = e.eval(toks[:24], mode=2, river_head=True)[0]
        steps = [e.eval([t], mode=2, river_head=True)[0] for t in toks[24:]]
        e.truncate(0)
        backbone = e.eval(toks[:24])[0]  # the F16 backbone: joined in a plain CPU buffer
        dyn = [e.eval([t], mode=1, threshold=0.97, river_head=True, tail=1)[:2] for t in toks[24:]]
        runs.append((prompt, steps, dyn, backbone))
    (p1, s1, d1, b1), (p0, s0, d0, b0) = runs
    assert np.array_equal(p1, p0) and np.array_equal(b1, b0)
    assert all(np.array_equal(a, b) for a, b in zip(s1, s0))
    assert all(ea == eb and np.array_equal(la, lb) for (la, ea), (lb, eb) in zip(d1, d0))
    ref = oracle_factory(q4_0_path).logits(toks)
    assert np.abs(np.vstack([p1[-1:]] + [s[-1:] for s in s1[:-1]]) - ref[23:-1]).max() < LOGIT_TOL
