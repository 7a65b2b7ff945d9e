"""River layers with the backbone's attention (river_attention="backbone"): each river layer runs
the backbone's attention weights and its own FFN. Its oracle is a plain GGUF whose attention
tensors come from the backbone and the rest from the river (convert.hybrid.write_mixed_gguf), in
stock llama.cpp."""
import numpy as np
import pytest

from river_gguf import Model
from river_gguf.greedy import greedy
from river_gguf.convert.hybrid import write_hybrid_gguf, write_mixed_gguf
from river_gguf.convert.hybrid import attention_from

from test_river import TAUS, _first_tau
from river_gguf.measure.teacher import score

from support import LOGIT_TOL, PROSE, THREADS

@pytest.fixture(scope="module")
def river_model(f16_path, q4_0_path):
    # Every call names its exit setting: a threshold given here spares the load the profile two
    # plain files would otherwise get (256 backbone decode steps).
    return Model(f16_path, river=q4_0_path, n_ctx=512, n_threads=THREADS, threshold=0.97)


@pytest.fixture(scope="module")
def prose_tokens(river_model):
    return river_model.tokenize(PROSE)


def _same_as_oracle(m, oracle, toks, **opts):
    ours = m.logits(toks, **opts)
    assert np.abs(ours - oracle.logits(toks)).max() < LOGIT_TOL
    g = greedy(m, toks[:12], max_tokens=24, **opts)
    assert g.tokens == oracle.greedy(toks[:12], 24)


def test_river_only_with_backbone_attention_equals_the_mixed_gguf(river_model, prose_tokens, f16_path, q4_0_path,
                                                                  tmp_path, oracle_factory):
    mixed = tmp_path / "q4_0+f16-attention.gguf"
    write_mixed_gguf(q4_0_path, mixed, {"bb": f16_path}, attention_from("bb"))
    _same_as_oracle(river_model, oracle_factory(str(mixed)), prose_tokens, mode="river-only", river_head=True,
                    river_attention="backbone")
    # ... and differs from the river's own attention, which is the plain Q4_0 file.
    a = river_model.logits(prose_tokens, mode="river-only", river_head=True, river_attention="backbone")
    b = river_model.logits(prose_tokens, mode="river-only", river_head=True)
    assert np.abs(a - b).max() > 10 * LOGIT_TOL


@pytest.mark.parametrize("k,tail", [(5, 0), (12, 4)])
def test_forced_exit_with_backbone_attention_equals_the_mixed_hybrid(k, tail, river_model, prose_tokens, f16_path,
                                                                     q4_0_path, tmp_path, oracle_factory):
    hybrid = tmp_path / "hybrid.gguf"
    write_hybrid_gguf(f16_path, q4_0_path, hybrid, exit_layer=k, river_head=False, tail=tail)
    mixed = tmp_path / "hybrid+f16-attention.gguf"
    write_mixed_gguf(hybrid, mixed, {"bb": f16_path}, attention_from("bb"))
    _same_as_oracle(river_model, oracle_factory(str(mixed)), prose_tokens, exit_layer=k, tail=tail,
                    river_head=False, river_attention="backbone")


def test_dynamic_exit_with_backbone_attention(river_model, prose_tokens):
    # tau > 1: no token leaves, so it is the backbone whatever the river's attention.
    a = score(river_model, prose_tokens, prefix=8, mode="river", threshold=1.01, river_attention="backbone")
    b = score(river_model, prose_tokens, prefix=8, mode="backbone")
    assert np.array_equal(a.logprobs, b.logprobs)
    # With exits (the first tau at which a token leaves before the last layer on this CPU), the
    # river's attention changes what follows.
    L = river_model.n_layer

    def run(tau):
        return (score(river_model, prose_tokens, prefix=8, mode="river", threshold=tau, river_attention="backbone"),
                score(river_model, prose_tokens, prefix=8, mode="river", threshold=tau))

    _, (r, plain) = _first_tau(run, lambda rs: all(min(x.exit_layers[1:]) < L - 1 for x in rs),
                               "tokens that exit before the last layer", taus=(0.9,) + tuple(TAUS))
    assert not np.array_equal(r.logprobs, plain.logprobs)


def test_river_attention_is_checked(river_model, f16_path):
    with pytest.raises(ValueError, match="river_attention"):
        river_model.logits([1, 2, 3], mode="river-only", river_attention="both")
    with pytest.raises(ValueError, match="river option"):
        Model(f16_path, n_ctx=64, river_attention="backbone")
