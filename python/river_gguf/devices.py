"""The devices ggml sees on this machine, and the GPUs a Model offloads to.

    river-gguf info --devices
    from river_gguf.devices import list_devices, offload_gpus

Which backends exist depends on how llama-cpp-python was built (scripts/setup.sh:
RIVER_GGUF_GPU=cuda or vulkan); a CPU-only build lists the CPU alone.
"""
from typing import Dict, List

from ._loader import native


def list_devices() -> List[Dict]:
    """Every device of every ggml backend: name, description, type ("CPU", "GPU" for a
    discrete GPU, "IGPU" for an integrated one, "ACCEL"), memory_free and memory_total (bytes)."""
    return list(native.devices())


def offload_gpus() -> List[str]:
    """The GPUs Model(n_gpu_layers=...) offloads to, in the order main_gpu indexes: discrete
    GPUs first, then integrated ones, as llama.cpp orders them."""
    return list(native.offload_gpus())
