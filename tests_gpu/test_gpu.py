"""River on a GPU backend (Vulkan on Mesa's lavapipe in CI, CUDA where one is lent), with every
layer, the head, the river and the KV cache offloaded (n_gpu_layers=-1).

The oracle is llama.cpp's own offload of the same file on the same backend: the engine's logits
equal it bit for bit (the CPU backend rounds differently, so the CPU engine is no oracle here).
River's invariants (docs/method.md) hold on the device, exits are decided there from one float
per tested layer, and the scheduler splits a decode step the same few times whatever the depth.

Run with scripts/test_gpu.sh, which builds the GPU variant in a venv of its own."""
import numpy as np
import pytest

from river_gguf import Model, _native
from river_gguf.convert.build import build_river_gguf
from river_gguf.convert.hybrid import write_hybrid_gguf, write_mixed_gguf
from river_gguf.devices import list_devices, offload_gpus
from river_gguf.greedy import greedy
from river_gguf.eval.random_model import write_tiny_model
from river_gguf.convert.hybrid import attention_from
from river_gguf.measure.teacher import score
from river_gguf.measure.traces import similarity_trace
from river_gguf.options import ExitOptions

from conftest import PROSE

N_GREEDY = 8
# lavapipe runs SmolLM2's F16 at a few tokens a second on 2 cores: the checks use short texts.
N_TOKENS = 28
# Exits on the device against the CPU engine's: the similarities are the same cos(h_in, h_out)
# of states that the two backends round differently (the CPU op also sums in double), so a
# similarity near tau can fall on the other side. Stated tolerance: every similarity within
# SIM_TOL, and the same exit layer for at least EXIT_AGREEMENT of the steps.
SIM_TOL = 5e-3
EXIT_AGREEMENT = 0.9
ALL_LAYERS = 1 << 30  # the native Engine's n_gpu_layers for "all" (Model takes -1)


def _gpu_engine(path, river_path, **kw):
    e = _native.Engine(path, river_path, n_threads=2, n_gpu_layers=ALL_LAYERS, **kw)
    assert set(e.layer_devices) == {"GPU"}
    return e


@pytest.fixture(scope="module")
def river_model(f16_path, q4_0_path):
    return Model(f16_path, river=q4_0_path, n_ctx=512, n_threads=2, threshold=0.97, n_gpu_layers=-1)


@pytest.fixture(scope="module")
def prose_tokens(river_model):
    return river_model.tokenize(PROSE)[:N_TOKENS]


def _same_as_oracle(m, oracle, toks, **opts):
    ours = m.logits(toks, **opts)
    ref = oracle.logits(toks)
    assert ours.shape == ref.shape and np.isfinite(ours).all()
    assert np.array_equal(ours, ref), f"max |diff| {np.abs(ours - ref).max()}"
    prompt = toks[:12]
    g = greedy(m, prompt, max_tokens=N_GREEDY, **opts)
    assert g.tokens == oracle.greedy(prompt, N_GREEDY)


def test_the_gpu_holds_every_layer(river_model):
    gpus = offload_gpus()
    types = {d["name"]: d["type"] for d in list_devices()}
    assert gpus and all(types[g] in ("GPU", "IGPU") for g in gpus)
    assert river_model.gpu_offload and river_model.exits_on_graph
    assert set(river_model.layer_devices) == {"GPU"}


# Plain files of several architectures, gemma3 with a sliding window shorter than the prompt,
# phi3 with LongRoPE at a context past its original one (the long factor set: a third input of
# every rope op).
ARCH_CASES = {
    "qwen2": ("qwen2", dict(n_layer=3)),
    "qwen3": ("qwen3", dict(n_layer=3)),
    "gemma3": ("gemma3", dict(n_layer=7, head_dim=32, sliding_window=8)),
    "phi3-longrope": ("phi3", dict(n_layer=3, longrope=True)),
}
ARCH_CTX = {"phi3-longrope": 512}  # > LONGROPE_ORIG_CTX; the others 256


@pytest.mark.parametrize("name", ["smollm2-q4_0", "smollm2-f16"] + list(ARCH_CASES))
def test_backbone_equals_llama_cpp_offload(name, f16_path, q4_0_path, tmp_path, gpu_oracle):
    if name.startswith("smollm2"):
        path = q4_0_path if name.endswith("q4_0") else f16_path
    else:
        arch, kw = ARCH_CASES[name]
        path = write_tiny_model(tmp_path / f"{name}.gguf", arch, seed=3, **kw)
    n_ctx = ARCH_CTX.get(name, 256)
    m = Model(path, n_ctx=n_ctx, n_threads=2, n_gpu_layers=-1)
    toks = m.tokenize(PROSE)  # all of it: longer than gemma3's window of 8
    assert len(toks) > 40
    _same_as_oracle(m, gpu_oracle(path, n_ctx), toks, mode="backbone")


def test_invariant1_threshold_above_one_is_the_backbone(river_model, prose_tokens):
    river = score(river_model, prose_tokens, prefix=8, mode="river", threshold=1.01)
    backbone = score(river_model, prose_tokens, prefix=8, mode="backbone")
    assert np.array_equal(river.logprobs, backbone.logprobs)
    assert (river.exit_layers == river_model.n_layer - 1).all()


@pytest.mark.parametrize("k,tail", [(6, 0), (17, 3)])
def test_invariant2_and_5_forced_exit_equals_hybrid_in_llama_cpp(k, tail, river_model, prose_tokens, f16_path,
                                                                  q4_0_path, tmp_path, gpu_oracle):
    hybrid = tmp_path / f"hybrid-{k}-{tail}.gguf"
    write_hybrid_gguf(f16_path, q4_0_path, hybrid, exit_layer=k, river_head=False, tail=tail)
    _same_as_oracle(river_model, gpu_oracle(str(hybrid)), prose_tokens, exit_layer=k, tail=tail, river_head=False)


def test_invariant3_river_only_equals_the_river_in_llama_cpp(river_model, prose_tokens, q4_0_path, gpu_oracle):
    _same_as_oracle(river_model, gpu_oracle(q4_0_path), prose_tokens, mode="river-only", river_head=True)


def test_invariant6_backbone_attention_equals_the_mixed_gguf(river_model, prose_tokens, f16_path, q4_0_path,
                                                             tmp_path, gpu_oracle):
    # River layers with the backbone's attention group (what the balanced preset runs), on the
    # device where both weights of each layer live.
    # The river file with every attention tensor from the backbone: what river-only runs then.
    mixed = write_mixed_gguf(q4_0_path, str(tmp_path / "mixed.gguf"), {"bb": f16_path}, attention_from("bb"))
    _same_as_oracle(river_model, gpu_oracle(str(mixed)), prose_tokens, mode="river-only", river_head=True,
                    river_attention="backbone")


def _mixed(exit_layers, n_layer):
    exits = set(int(e) for e in exit_layers)
    return len(exits) > 2 and min(exits) < n_layer - 1


def _unwritten(rows, poison):
    """Per row: whether it is all poison (NaN, or the finite poison a device cache holds)."""
    return np.isnan(rows).all(axis=1) if np.isnan(poison) else (rows == poison).all(axis=1)


def test_invariant4_no_cache_holes_after_mixed_exits(f16_path, q4_0_path, prose_tokens, river_model):
    # The cache lives on the device. Its flash attention spans masked rows too, so the poison
    # there is finite (POISON_NO_FLASH), and a slot no layer wrote is a whole row of it.
    for tau in (0.965, 0.97, 0.96, 0.95, 0.98):
        m = Model(f16_path, river=q4_0_path, n_ctx=256, n_threads=2, threshold=tau, n_gpu_layers=-1)
        poison = m.cache_poison(0)
        assert poison == _native.Engine.POISON_NO_FLASH
        assert _unwritten(m.cache_rows(0, False, 4), poison).all()
        g = greedy(m, prose_tokens[:16], max_tokens=40, mode="river", threshold=tau)
        if _mixed(g.stats["exit_layers"], m.n_layer):
            break
    else:
        pytest.fail("no threshold gives a mix of exits on this device")
    n = m.n_past
    for layer in range(m.n_layer):
        for values in (False, True):
            rows = m.cache_rows(layer, values, n + 1)
            assert np.isfinite(rows).all()
            assert not _unwritten(rows[:n], poison).any(), f"hole in layer {layer} {'V' if values else 'K'}"
            assert _unwritten(rows[n:], poison).all()  # past the last position: still poison, so the check can fail


def test_dynamic_exits_follow_the_rule_on_the_device(river_model, prose_tokens):
    # Each step leaves at the first tested layer whose similarity (computed on the device, one
    # float read back) passes tau, and equals the forced exit at that layer.
    L = river_model.n_layer
    s = river_model.session(ExitOptions(mode="river", threshold=0.96))
    s.extend(prose_tokens[:10])
    exits = []
    for t in prose_tokens[10:]:
        pos = s.n_past
        dyn = s.extend([t], decode=True, trace=True)
        k, sims = s.exit_layer, s.scores
        passed = [i for i, x in enumerate(sims) if x > 0.96]
        assert passed == ([k] if k < L - 1 else [])
        if k < L - 1:
            s.truncate(pos)
            fixed = s.extend([t], decode=True, options=ExitOptions(exit_layer=k))
            assert np.array_equal(dyn, fixed)
        exits.append(k)
    s.close()
    assert any(k < L - 1 for k in exits), "no token left early at tau 0.96"


def test_exits_agree_with_the_cpu_engine(f16_path, q4_0_path, prose_tokens, river_model):
    cpu = Model(f16_path, river=q4_0_path, n_ctx=512, n_threads=2, threshold=0.97)
    toks = prose_tokens
    # Similarities of every layer, backbone only (no exit): the same states on both sides.
    s_gpu = similarity_trace(river_model, toks)
    s_cpu = similarity_trace(cpu, toks)
    assert len(s_gpu) == len(s_cpu)
    assert max(abs(a - b) for ra, rb in zip(s_gpu, s_cpu) for a, b in zip(ra, rb)) < SIM_TOL
    # Teacher-forced with exits live, at the first threshold whose CPU run mixes exit layers
    # (which one does depends on the CPU's rounding).
    for tau in (0.97, 0.965, 0.96, 0.95, 0.98):
        b = score(cpu, toks, prefix=8, mode="river", threshold=tau)
        if _mixed(b.exit_layers, cpu.n_layer):
            break
    else:
        pytest.fail("no threshold gives the CPU engine a mix of exits")
    a = score(river_model, toks, prefix=8, mode="river", threshold=tau)
    assert np.mean(a.exit_layers == b.exit_layers) >= EXIT_AGREEMENT


def test_a_decode_step_splits_the_same_few_times_at_any_depth(f16_path, q4_0_path, prose_tokens):
    """No hidden state crosses to the host per tested layer: with the decision on the device
    the scheduler cuts a step into a fixed few splits (the token embedding on the host, the
    layers and head on the GPU), however many layers are tested. The CPU exit op, the
    alternative, splits around every tested layer: the count can fail."""
    counts = {}
    for decision in ("graph", "cpu"):
        e = _gpu_engine(f16_path, q4_0_path, n_ctx=256, exit_decision=decision)
        e.eval(prose_tokens[:8])
        _, k, sims = e.eval([prose_tokens[8]], mode=1, threshold=1.01, trace=True)  # every layer tested
        assert k == e.hparams["n_layer"] - 1 and len(sims) == e.hparams["n_layer"]
        counts[decision] = e.last_splits
    n_layer = e.hparams["n_layer"]
    assert counts["graph"] <= 3, counts
    assert counts["cpu"] >= n_layer, counts


def test_a_short_gpu_memory_budget_keeps_the_river_first(f16_path, q4_0_path, prose_tokens, river_model):
    """gpu_memory below the model's size, n_gpu_layers=-1: the river, head and KV cache stay on
    the GPU and the backbone follows from its first layer (the paper's VRAM eviction); the deep
    backbone layers, which early-exiting tokens skip, stay in host memory."""
    full = river_model.placement
    n = river_model.n_layer
    keep = n // 2
    assert not full["river_first"] and (full["gpu_budget"] == 0 or full["gpu_bytes"] <= full["gpu_budget"])
    # The whole placement's bytes less the last n - keep backbone layers (the head counted as
    # the plan counts it, whether the device could take it or not).
    budget = (full["gpu_bytes"] + (0 if full["head"] == "GPU" else full["head_bytes"])
              - sum(full["backbone_bytes"][keep:]))
    with pytest.warns(RuntimeWarning, match="deeper backbone layers run on the CPU"):
        m = Model(f16_path, river=q4_0_path, n_ctx=512, n_threads=2, threshold=0.97, n_gpu_layers=-1,
                  gpu_memory=budget)
    p = m.placement
    assert p["river_first"] and p["gpu_budget"] == budget and p["gpu_bytes"] <= budget
    assert p["backbone"] == ["GPU"] * keep + ["CPU"] * (n - keep)
    assert p["river"] == ["GPU"] * n and p["kv_cache"] == ["GPU"] * n and p["head"] == full["head"]
    assert m.layer_devices == ["GPU"] * n and m.gpu_layers == keep
    # River-only runs on the GPU alone: the same logits as the whole offload, bit for bit.
    opts = dict(mode="river-only", river_head=True)
    assert np.array_equal(m.logits(prose_tokens, **opts), river_model.logits(prose_tokens, **opts))
    # The backbone's deep layers run on the CPU, which rounds differently: close, not equal.
    ours, ref = m.logits(prose_tokens, mode="backbone"), river_model.logits(prose_tokens, mode="backbone")
    assert np.isfinite(ours).all()
    assert np.mean(ours.argmax(-1) == ref.argmax(-1)) >= EXIT_AGREEMENT
    assert np.abs(ours - ref).max() < 0.05 * np.abs(ref).max()
    s_ours, s_ref = similarity_trace(m, prose_tokens), similarity_trace(river_model, prose_tokens)
    assert max(abs(a - b) for ra, rb in zip(s_ours, s_ref) for a, b in zip(ra, rb)) < SIM_TOL
    # Dynamic exits across the split: exits from the GPU layers and the CPU ones both decode.
    g = greedy(m, prose_tokens[:12], max_tokens=N_GREEDY, mode="river", threshold=0.97)
    assert 0 < len(g.tokens) <= N_GREEDY and all(-1 <= k < n for k in g.stats["exit_layers"])


@pytest.fixture(scope="module")
def tiny_river(tmp_path_factory):
    """A random qwen2 model (6 layers) as a River GGUF with a Q4_0 river: cheap enough on
    lavapipe for a prompt of 248 tokens."""
    d = tmp_path_factory.mktemp("tiny")
    plain = write_tiny_model(d / "qwen2.gguf", "qwen2", n_layer=6, seed=11)
    river = d / "qwen2.river.gguf"
    build_river_gguf(plain, river, backbone_type=None, river_type="q4_0", imatrix=None, presets=False,
                     threshold=0.9, progress=False, n_threads=2)
    return str(river)


def test_kept_graphs_equal_rebuilt_ones_across_a_padding_boundary(tiny_river):
    # Single-token graphs are kept on the device too (each with its own scheduler), so a step
    # replays its graph. Kept and rebuilt give the same bits, with dynamic exits and tails,
    # across position 256 where the padded n_kv grows.
    toks = (Model(tiny_river, n_ctx=8).tokenize(PROSE) * 8)[:300]
    assert len(toks) == 300
    def run(reuse, tau):  # 16 steps from position 248: eight either side of the boundary
        e = _gpu_engine(tiny_river, "", n_ctx=512, graph_reuse=reuse)
        e.eval(toks[:248])
        built = e.graphs_built
        steps = [e.eval([t], mode=1, threshold=tau, river_head=True, tail=t % 2) for t in toks[248:264]]
        return steps, e.kept_graphs, e.graphs_built - built

    # The random model's similarities climb from ~0.4 after layer 0 to ~0.9 after layer 4: the
    # first of these thresholds whose kept run mixes exit layers.
    for tau in (0.75, 0.8, 0.7, 0.85):
        on, kept_on, built_on = run(True, tau)
        if len({s[1] for s in on}) > 1:
            break
    else:
        pytest.fail("no threshold gives a mix of exit layers on the random model")
    off, kept_off, built_off = run(False, tau)
    assert kept_off == 0 and kept_on > 1 and built_on < built_off
    for (la, ea, sa), (lb, eb, sb) in zip(on, off):
        assert ea == eb and sa == sb and np.array_equal(la, lb)
