"""The devices ggml sees and which GPU a Model offloads to (`river-gguf info --devices`,
Model(main_gpu=...)). On a CPU-only build the CPU is the only device and offloading stays on it,
as in llama.cpp; on a GPU build the same checks hold for the GPUs found."""
import pytest

from river_gguf import Model, _native
from river_gguf.devices import list_devices, offload_gpus


@pytest.fixture(scope="module")
def tiny_path(tiny):
    return tiny.model("llama", n_layer=2, seed=5)


def test_the_cpu_is_listed_with_its_memory():
    devs = list_devices()
    cpus = [d for d in devs if d["type"] == "CPU"]
    assert cpus, devs
    assert all(d["memory_total"] > 0 and 0 <= d["memory_free"] <= d["memory_total"] for d in cpus)
    assert all(set(d) == {"name", "description", "type", "memory_free", "memory_total"} for d in devs)
    assert all(d["type"] in ("CPU", "GPU", "IGPU", "ACCEL") for d in devs)


def test_offload_order_is_discrete_gpus_then_integrated():
    by_name = {d["name"]: d["type"] for d in list_devices()}
    gpus = offload_gpus()
    assert all(by_name[g] in ("GPU", "IGPU") for g in gpus)
    types = [by_name[g] for g in gpus]
    assert types == sorted(types, key=lambda t: t != "GPU")  # every GPU before any IGPU
    assert len(gpus) == sum(1 for n, t in by_name.items() if t in ("GPU", "IGPU") and not n.startswith("RPC"))


def test_main_gpu_is_checked(tiny_path):
    with pytest.raises(ValueError, match="main_gpu"):
        Model(tiny_path, n_ctx=32, n_threads=1, main_gpu=-1)
    with pytest.raises(ValueError, match="main_gpu"):
        Model(tiny_path, n_ctx=32, n_threads=1, main_gpu=True)
    gpus = offload_gpus()
    if gpus:
        with pytest.raises(ValueError, match=f"main_gpu={len(gpus)} is not one of this machine's GPUs"):
            Model(tiny_path, n_ctx=32, n_threads=1, n_gpu_layers=-1, main_gpu=len(gpus))
        m = Model(tiny_path, n_ctx=32, n_threads=1, n_gpu_layers=-1, main_gpu=len(gpus) - 1)
        assert all(d == "GPU" for d in m.layer_devices)
    else:  # no GPU: every layer stays on the CPU whatever is asked, as llama.cpp does
        m = Model(tiny_path, n_ctx=32, n_threads=1, n_gpu_layers=-1, main_gpu=3)
        assert all(d == "CPU" for d in m.layer_devices)


def test_info_devices_lists_them(capsys):
    from river_gguf.cli import main

    assert main(["info", "--devices"]) == 0
    out = capsys.readouterr().out
    for d in list_devices():
        assert d["name"] in out and d["type"] in out
    if not offload_gpus():
        assert "no GPU" in out


def test_gpu_offload_fits_the_free_memory():
    """The placement's fit (llama.cpp's --fit): the last layers first, the head only once every
    layer is on the GPU, a reserve kept free; a backend that reports no memory fits all."""
    fit = _native.fit_gpu_layers
    layers = [100] * 10
    assert fit(layers, 50, 0, 30, 99) == (10, True)           # no memory reported: everything asked
    assert fit(layers, 50, 2000, 30, 99) == (10, True)        # plenty
    assert fit(layers, 50, 1000, 30, 99) == (9, False)        # 30 + 9 * 100 fits, 10 layers do not
    assert fit(layers, 50, 1060, 30, 99) == (10, False)       # all layers, but not the head
    assert fit(layers, 50, 1080, 30, 99) == (10, True)
    assert fit(layers, 50, 2000, 30, 4) == (4, False)         # only what was asked
    assert fit(layers, 50, 2000, 30, 10) == (10, False)       # n_gpu_layers == n_layer: no head
    assert fit(layers, 50, 100, 30, 99) == (0, False)         # nothing fits: a CPU-only engine
    assert fit([100, 100, 700], 0, 600, 0, 99) == (0, False)  # from the last layer back, no gaps
    assert fit(layers, 50, 2000, 30, 0) == (0, False)


def _plan(plan):
    """(backbone, river, kv_cache) per layer as strings of G (GPU) and c (CPU), head, river_first."""
    row = lambda k: "".join("G" if x else "c" for x in plan[k])  # noqa: E731
    return row("backbone"), row("river"), row("kv_cache"), plan["head"], plan["river_first"]


def test_the_gpu_plan_puts_the_river_first_when_the_model_does_not_fit():
    """plan_gpu (the paper's VRAM eviction): a River model asked to offload everything that does
    not fit keeps its river, head and KV cache on the GPU, then its backbone from the first layer
    on; a plain model, a layer count asked for, or a budget too small for the river alone get
    llama.cpp's fit (the last layers whole)."""
    plan = _native.plan_gpu
    layers = [(100, 40, 10)] * 5   # backbone, river, KV bytes per layer: 150 a layer, 750 in all
    reserve, head = 30, 50         # river-first base: 30 + 50 + 5 * (40 + 10) = 330
    assert _plan(plan(layers, head, 0, reserve, 99)) == ("GGGGG", "GGGGG", "GGGGG", True, False)  # no budget
    assert _plan(plan(layers, head, 830, reserve, 99)) == ("GGGGG", "GGGGG", "GGGGG", True, False)  # it all fits
    assert plan(layers, head, 830, reserve, 99)["bytes"] == 830
    assert _plan(plan(layers, head, 829, reserve, 99)) == ("GGGGc", "GGGGG", "GGGGG", True, True)
    assert _plan(plan(layers, head, 630, reserve, 99)) == ("GGGcc", "GGGGG", "GGGGG", True, True)
    assert plan(layers, head, 630, reserve, 99)["bytes"] == 630
    assert _plan(plan(layers, head, 429, reserve, 99)) == ("ccccc", "GGGGG", "GGGGG", True, True)
    # Below the river-first base: llama.cpp's fit, the last whole layers that fit, no head.
    assert _plan(plan(layers, head, 329, reserve, 99)) == ("ccccG", "ccccG", "ccccG", False, False)  # 30 + 150
    # A layer count asked for is llama.cpp's, River model or not.
    assert _plan(plan(layers, head, 630, reserve, 5)) == ("cGGGG", "cGGGG", "cGGGG", False, False)
    assert _plan(plan(layers, head, 2000, reserve, 2)) == ("cccGG", "cccGG", "cccGG", False, False)
    # No river: nothing to put first.
    plain = [(140, 0, 10)] * 5
    assert _plan(plan(plain, head, 630, reserve, 99)) == ("cGGGG", "cGGGG", "cGGGG", False, False)
    # No gap in the backbone: a big early layer stops it even when a later one would fit.
    assert _plan(plan([(300, 40, 10)] + layers[1:], head, 629, reserve, 99)) == \
        ("ccccc", "GGGGG", "GGGGG", True, True)


def test_the_gpu_memory_budget_is_checked(tiny_path):
    from river_gguf.options import parse_bytes

    assert parse_bytes("gpu_memory", 123) == 123
    assert parse_bytes("gpu_memory", "512MiB") == 512 << 20
    assert parse_bytes("gpu_memory", "1.5 GiB") == 3 << 29
    assert parse_bytes("gpu_memory", "6G") == parse_bytes("gpu_memory", "6gb") == 6 << 30
    for bad in (0, -1, True, 1.5, "", "GiB", "-1GiB", "nan", "inf GiB", "4 parsecs", "0.1", [1]):
        with pytest.raises(ValueError, match="gpu_memory"):
            parse_bytes("gpu_memory", bad)
    with pytest.raises(ValueError, match="gpu_memory"):
        Model(tiny_path, n_ctx=32, n_threads=1, n_gpu_layers=-1, gpu_memory="lots")
    m = Model(tiny_path, n_ctx=32, n_threads=1, n_gpu_layers=-1, gpu_memory="1GiB")
    p = m.placement
    assert len(p["backbone"]) == len(p["kv_cache"]) == len(p["river"]) == m.hparams["n_layer"]
    if not offload_gpus():  # no GPU: everything stays on the CPU and no GPU memory is counted
        assert set(p["backbone"]) == set(p["kv_cache"]) == {"CPU"} and p["head"] == "CPU"
        assert p["river"] == [""] * m.hparams["n_layer"] and not p["river_first"] and p["gpu_bytes"] == 0
