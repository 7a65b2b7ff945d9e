"""Hybrid GGUFs: the plain file that a forced River exit is equivalent to (the stock llama.cpp oracle).

With every token forced out after backbone layer k, the engine computes layers 0..k with the
backbone and k+1..L-1 with the river. ``write_hybrid_gguf`` writes exactly that model as an
ordinary GGUF under the plain tensor names, so llama.cpp can run it and its logits can be
compared with the engine's.
"""
from __future__ import annotations

import contextlib
import os
import re

from .._loader import native
from ..gguf.copy import (arch, check_loadable, new_writer, open_reader, plain_tensors, river_tensors_by_name, same_file,
                         write_tensors)
from ..gguf.io import atomic_output, check_output_path
from ..gguf.river_index import RIVER_PREFIX, read_field
from .build import compare_models

_LAYER = re.compile(r"^blk\.(\d+)\.")



def _tied_only(name: str) -> bool:
    """Whether llama.cpp's loader of the family has no output.weight (and refuses a file that
    holds one): its head is always the embedding table (the family's entry, native/arch.h)."""
    return bool(native.ARCHITECTURES.get(name, {}).get("tied_only", False))


def write_hybrid_gguf(backbone_path, river_path, out_path, exit_layer: int, river_head: bool,
                      progress: bool = False, tail: int = 0) -> str:
    """Write a plain GGUF: layers 0..exit_layer from the backbone, the rest from the river,
    except the last `tail` layers, which come from the backbone again (RIVER.md invariant 5).

    exit_layer: -1 puts every layer in the river (the engine's river-only mode); n_layer-1 is
        the backbone alone.
    river_head: the output head is the river's (its output.weight, or its token_embd when tied)
        instead of the backbone's. The head is always written as an explicit output.weight.
    token_embd.weight is the backbone's, except with exit_layer == -1 and river_head, where the
        engine embeds with the river's table too.
    For an architecture that always ties its head (gemma2), no output.weight is written: the
    head must then be the embedding table written (ValueError otherwise, e.g. river_head with
    exit_layer >= 0, which no such file can hold).
    Norms and rope_freqs come from the backbone, and so does all metadata (river.* keys dropped).
    Either input may be a River GGUF: the backbone's plain tensors / the river's ``river.*`` ones are used.
    """

    backbone_path, river_path, out_path = os.fspath(backbone_path), os.fspath(river_path), os.fspath(out_path)
    if same_file(out_path, backbone_path) or same_file(out_path, river_path):
        raise ValueError(f"output {out_path} would overwrite an input file")
    check_output_path(out_path)  # a folder, or a folder we cannot write to: refused before any work
    check_loadable(backbone_path)
    check_loadable(river_path)
    bb = open_reader(backbone_path)
    rv = bb if same_file(backbone_path, river_path) else open_reader(river_path)
    n_layer = int(read_field(bb, f"{arch(bb)}.block_count"))
    if isinstance(exit_layer, bool) or not isinstance(exit_layer, int) or not -1 <= exit_layer < n_layer:
        raise ValueError(f"exit_layer must be an int in [-1, {n_layer - 1}], got {exit_layer!r}")
    if isinstance(tail, bool) or not isinstance(tail, int) or not 0 <= tail < n_layer:
        raise ValueError(f"tail must be an int in [0, {n_layer - 1}], got {tail!r}")

    rv_tensors = river_tensors_by_name(rv, RIVER_PREFIX)
    if not rv_tensors:
        if rv is bb:
            raise ValueError(f"{river_path} holds no river tensors")
        rv_tensors = {t.name: t for t in rv.tensors}
    compare_models(bb, rv, rv_tensors)

    bb_tensors = {t.name: t for t in plain_tensors(bb)}
    if river_head:
        head = rv_tensors.get("output.weight", rv_tensors["token_embd.weight"])
    else:
        head = bb_tensors.get("output.weight", bb_tensors["token_embd.weight"])
    embd = rv_tensors["token_embd.weight"] if (exit_layer == -1 and river_head) else bb_tensors["token_embd.weight"]

    plan = []
    for name, t in bb_tensors.items():
        m = _LAYER.match(name)
        if m:
            il = int(m.group(1))
            plan.append((name, t if il <= exit_layer or il >= n_layer - tail else rv_tensors[name]))
        elif name == "token_embd.weight":
            plan.append((name, embd))
            if _tied_only(arch(bb)):
                if head is not embd:
                    raise ValueError(f"{arch(bb)} ties its head to the embedding table: a hybrid with the "
                                     f"{'river' if river_head else 'backbone'}'s head and the "
                                     f"{'river' if embd is not bb_tensors['token_embd.weight'] else 'backbone'}'s "
                                     "embeddings cannot be written")
            elif "output.weight" not in bb_tensors:
                plan.append(("output.weight", head))
        elif name == "output.weight":
            plan.append((name, head))
        else:
            plan.append((name, t))

    with atomic_output(out_path) as tmp, contextlib.closing(new_writer(tmp, bb)) as w:
        write_tensors(w, plan, progress, desc=f"hybrid {os.path.basename(out_path)}")
    return out_path


def write_mixed_gguf(base_path, out_path, sources, pick, progress: bool = False) -> str:
    """Write a plain GGUF whose tensors come from `base_path`, except that each tensor for which
    `pick(name)` returns a key of `sources` comes from that file instead (the same name, any
    type): e.g. a Q4_K_M file with every attention tensor from a Q8_0 file of the same model.
    Metadata is the base's. All files must be plain GGUFs of one model (same names and shapes)."""

    base_path, out_path = os.fspath(base_path), os.fspath(out_path)
    paths = {k: os.fspath(p) for k, p in sources.items()}
    if any(same_file(out_path, p) for p in [base_path, *paths.values()]):
        raise ValueError(f"output {out_path} would overwrite an input file")
    check_output_path(out_path)
    check_loadable(base_path)
    base = open_reader(base_path)
    readers = {}
    for k, p in paths.items():
        check_loadable(p)
        readers[k] = open_reader(p)
        compare_models(base, readers[k])
    tensors = {k: {t.name: t for t in plain_tensors(r)} for k, r in readers.items()}
    plan = []
    for t in plain_tensors(base):
        src = pick(t.name)
        if src is not None and src not in tensors:
            raise ValueError(f"pick({t.name!r}) returned {src!r}, which is not one of {sorted(tensors)}")
        plan.append((t.name, t if src is None else tensors[src][t.name]))
    with atomic_output(out_path) as tmp, contextlib.closing(new_writer(tmp, base)) as w:
        write_tensors(w, plan, progress, desc=f"mix {os.path.basename(out_path)}")
    return out_path


def attention_from(key: str):
    """A write_mixed_gguf pick: every layer's attention tensors (the engine's attention group,
    which river_attention="backbone" swaps) from the source `key`, the rest from the base."""
    kinds = native.ATTENTION_TENSORS
    return lambda name: key if name.startswith("blk.") and name.split(".")[2] in kinds else None


def write_backbone_attention_oracle(backbone_path, river_path, folder) -> str:
    """The plain GGUF that river-only with the backbone's attention (river_attention="backbone")
    computes: the river alone, with every attention tensor of each layer from the backbone.
    Written into `folder` (with the river-only file it starts from); returns its path."""
    river_only = os.path.join(os.fspath(folder), "river-only.gguf")
    write_hybrid_gguf(river_path, river_path, river_only, exit_layer=-1, river_head=True)
    mixed = os.path.join(os.fspath(folder), "backbone-attention.gguf")
    return write_mixed_gguf(river_only, mixed, {"bb": backbone_path}, attention_from("bb"))
