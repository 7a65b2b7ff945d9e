"""The server's slots in lossless mode: two slots of one River GGUF (served_model.make_slots over a
Llama whose default mode is lossless, as `river-gguf serve --parallel 2 --mode lossless` makes
them) answer two requests at once, each with the text the same request gets alone.

Without flash attention a row moves only by rounding (about 1e-6) when concurrent slots leave a
sequence's rows out of position order in the shared cache (tests/test_lossless_slots.py), so the
greedy texts are equal."""
from river_gguf import Llama
from river_gguf.serve.served_model import make_slots

from test_server_slots import get, in_threads, post, serving, stream

N_TOKENS = 24


def test_lossless_slots_serve_two_requests_at_once(tiny):
    path = tiny.river("qwen2", dict(seed=5, n_layer=3))  # tests/test_lossless.py's: drafts kept and rejected
    llama = Llama(path, n_ctx=256, n_threads=1, flash_attn=False, verbose=False, mode="lossless",
                  ngram_draft=False, adaptive_draft=False, draft_max=4)
    slots = make_slots(llama, 2, 128)
    prompts = ("one two three", "alpha beta")
    try:
        with serving(slots) as base:
            alone = {}
            for p in prompts:
                status, body = post(base, "/v1/completions", {"prompt": p, "max_tokens": N_TOKENS, "temperature": 0})
                assert status == 200, body
                alone[p] = body["choices"][0]["text"]

            def streamed(p):
                with stream(base, p, max_tokens=N_TOKENS, temperature=0) as s:
                    return "".join(s)

            together = in_threads(*(lambda p=p: streamed(p) for p in prompts))
            _, info = get(base, "/slots")
        assert together == [alone[p] for p in prompts]
        assert len(info) == 2
        for s in slots:  # each slot's last request ran lossless rounds on its own sequence
            stats = s.last_stats
            assert stats["mode"] == "lossless" and stats["rounds"] > 0 and stats["drafted"] > 0, stats
        assert sorted(s.session.seq for s in slots) == [0, 1]
    finally:
        llama.close()
