"""Prompt tokens as llama_cpp.Llama builds them for a completion: BOS/EOS by the vocabulary's rules
(CLS/SEP where it has them), and fill-in-the-middle prompts for a suffix."""
from typing import Callable, List, Optional, Tuple

from llama_cpp import llama_cpp as lib


def completion_prompt(vocab_model, tokenize: Callable, prompt, suffix: Optional[str],
                      spm_infill: bool) -> Tuple[List[int], Optional[str]]:
    """(prompt tokens, text to append to the output): None, or the suffix when the vocabulary has
    no FIM tokens. vocab_model: libllama's vocab-only model; tokenize: the Llama's (bytes, add_bos,
    special); prompt: a str, or checked token ids (used as they are, without BOS/EOS, unless a
    suffix asks for an infill prompt). spm_infill: the suffix before the prefix, as llama_cpp's
    option."""
    is_list = not isinstance(prompt, str)
    if is_list:
        body = list(prompt)
    else:
        body = tokenize(prompt.encode("utf-8"), add_bos=False, special=suffix is None) if prompt else []
    cls_id, sep_id = vocab_model.token_cls(), vocab_model.token_sep()
    bos_id = cls_id if cls_id != -1 else vocab_model.token_bos()
    eos_id = sep_id if sep_id != -1 else vocab_model.token_eos()
    head = [] if (is_list and suffix is None) or not vocab_model.add_bos_token() or bos_id == -1 else [bos_id]
    tail = [] if (is_list and suffix is None) or (not vocab_model.add_eos_token() and sep_id == -1) else [eos_id]
    append = None
    if suffix is not None:
        vocab = vocab_model.vocab
        pre, suf, mid = (lib.llama_vocab_fim_pre(vocab), lib.llama_vocab_fim_suf(vocab),
                         lib.llama_vocab_fim_mid(vocab))
        if min(pre, suf, mid) >= 0:
            stoks = tokenize(suffix.encode("utf-8"), add_bos=False, special=False) if suffix else []
            body = ([suf] + stoks + [pre] + body + [mid]) if spm_infill else ([pre] + body + [suf] + stoks + [mid])
        else:
            append = suffix
    return head + body + tail, append
