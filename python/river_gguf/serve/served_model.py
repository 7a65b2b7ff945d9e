"""Which model class serves, how its slots are made, and the name it is served under."""
import os

from ..llama import Llama

#: llama-server's slot count when --parallel is not given (its -1, "auto"); those slots share one
#: KV pool, each able to use the whole context.
DEFAULT_SLOTS = 4

#: llama.cpp rounds a split context up to a whole number of these per sequence.
_SLOT_CTX_STEP = 256


def model_class():
    """The class `river-gguf serve` loads: the llama_cpp-compatible Llama, so grammar,
    response_format, tools and llama-cpp-python's sampling parameters work as on its server. The
    server needs only what protocol.ServedModel names, and refuses (400) parameters the class
    does not take."""

    return Llama


def slot_context(n_ctx: int, n_slots: int, unified: bool) -> tuple:
    """(the context of one slot, the KV pool of all of them), as llama-server sizes them: with a
    unified pool every slot may use all n_ctx positions; otherwise n_ctx is split evenly,
    each slot's share rounded up to a multiple of 256 (and the pool grown to match)."""
    if isinstance(n_slots, bool) or not isinstance(n_slots, int) or n_slots < 1:
        raise ValueError(f"the number of slots must be an int >= 1, got {n_slots!r}")
    if unified or n_slots == 1:
        return n_ctx, n_ctx
    share = n_ctx // n_slots
    if share == 0:
        raise ValueError(f"a context of {n_ctx} tokens cannot be split among {n_slots} slots")
    share = -(-share // _SLOT_CTX_STEP) * _SLOT_CTX_STEP
    return share, share * n_slots


def make_slots(llama, n_slots: int, slot_n_ctx: int) -> list:
    """`n_slots` slot objects over `llama`'s model, each a Llama-compatible object with its own KV
    sequence of up to `slot_n_ctx` positions in `llama`'s cache; calls on different slots may
    run at once in different threads, and their decode steps are batched together."""
    return llama.slots(n_slots, n_ctx=slot_n_ctx)


def model_id(model, alias=None) -> str:
    """--alias if given, else the model's file name (clients see this in /v1/models)."""
    return alias or os.path.basename(model.model_path)
