"""Making River GGUFs: the converter (build), the importance-matrix river (imatrix) and the plain
hybrid GGUFs that serve as stock-llama.cpp oracles (hybrid).

    from river_gguf.convert import build_river_gguf
    build_river_gguf("model.f16.gguf", "model.river.gguf")
"""
from .build import FORMAT_VERSION, RIVER_PREFIX, build_river_gguf, upgrade_river_gguf  # noqa: F401
