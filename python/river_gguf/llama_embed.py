"""Embeddings as river_gguf.Llama gives them: the pooling a Llama uses (libllama's rule) and the
pooled rows of one input. The rows are the backbone's final-norm output (Model.embed)."""
from typing import Dict, List

import numpy as np
from llama_cpp import llama_cpp as lib

from ._loader import native
from .options import is_int

POOLINGS = (lib.LLAMA_POOLING_TYPE_NONE, lib.LLAMA_POOLING_TYPE_MEAN, lib.LLAMA_POOLING_TYPE_CLS,
            lib.LLAMA_POOLING_TYPE_LAST)


def resolve_pooling(pooling_type, metadata: Dict[str, str], model_path: str, embedding: bool) -> int:
    """libllama's rule: an unspecified pooling is the file's `{arch}.pooling_type`, else none.
    Rank pooling (a reranker's classifier head) raises NotImplementedError on a Llama made for
    embeddings."""
    if not is_int(pooling_type):
        raise ValueError(f"pooling_type must be an int (llama_pooling_type), got {pooling_type!r}")
    p = int(pooling_type)
    if p == lib.LLAMA_POOLING_TYPE_UNSPECIFIED:
        arch = metadata.get("general.architecture", "")
        try:
            p = int(metadata.get(f"{arch}.pooling_type", lib.LLAMA_POOLING_TYPE_NONE))
        except ValueError:
            raise native.GGUFFormatError(f"{model_path}: {arch}.pooling_type is not an integer") from None
    if p == lib.LLAMA_POOLING_TYPE_RANK:
        if embedding:
            raise NotImplementedError("river_gguf.Llama does not do rank pooling (a reranker's classifier head)")
    elif p not in POOLINGS:
        raise ValueError(f"unknown pooling_type {p} (none 0, mean 1, cls 2, last 3, rank 4)")
    return p


def pool(rows: np.ndarray, pooling: int, normalize: bool):
    """One input's embedding from its per-token rows: a list of floats per token with pooling
    none, else one list (mean, the first row, the last row); normalize: unit L2 norm."""
    if pooling == lib.LLAMA_POOLING_TYPE_NONE:
        out = rows
    elif pooling == lib.LLAMA_POOLING_TYPE_MEAN:
        out = rows.mean(axis=0, dtype=np.float32)[None]
    elif pooling == lib.LLAMA_POOLING_TYPE_CLS:
        out = rows[:1]
    else:  # LAST
        out = rows[-1:]
    if normalize:
        norms = np.linalg.norm(out.astype(np.float64), axis=1, keepdims=True)
        out = np.where(norms > 0, out / np.where(norms > 0, norms, 1.0), out)
    lists = [[float(v) for v in r] for r in out]
    return lists if pooling == lib.LLAMA_POOLING_TYPE_NONE else lists[0]


def embedding_tokens(tokens: List[int], text: str, n_batch: int, truncate: bool) -> List[int]:
    """The tokens one input embeds: one batch at most (truncate: its first n_batch tokens; else
    more raise ValueError, as llama_cpp's message says), at least one."""
    if truncate:
        tokens = tokens[:n_batch]
    if len(tokens) > n_batch:
        raise ValueError(f"Requested tokens ({len(tokens)}) exceed batch size of {n_batch}")
    if not tokens:
        raise ValueError(f"no tokens to embed in {text!r}")
    return tokens


def embedding_response(embeds: list, total_tokens: int, model: str) -> dict:
    """llama_cpp's create_embedding dict (OpenAI's form) of the inputs' embeddings."""
    return {
        "object": "list",
        "data": [{"object": "embedding", "embedding": e, "index": i} for i, e in enumerate(embeds)],
        "model": model,
        "usage": {"prompt_tokens": total_tokens, "total_tokens": total_tokens},
    }
