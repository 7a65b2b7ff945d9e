"""The devices ggml sees and which GPU a Model offloads to (`river-gguf info --devices`,
Model(main_gpu=...)). On a CPU-only build the CPU is the only device and offloading stays on it,
as in llama.cpp; on a GPU build the same checks hold for the GPUs found."""
import pytest

from river_gguf import Model, _native
from river_gguf.devices import list_devices, offload_gpus
from river_gguf.testing import write_tiny_model


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("devices") / "tiny.gguf", "llama", n_layer=2, seed=5)


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
