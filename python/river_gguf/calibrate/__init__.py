"""Measuring a River GGUF and storing what was found in it: the presets (presets: KLD of the
grid on the calibration split; tune: the tiers from speeds timed here) and tau (tau). Between the
runtime (model, presets' stored format and cost model) and the converter, which calls it."""
from ..gguf.io import deferred_interrupts
from ..model import Model


def open_model(*args, **kwargs):
    """``Model(*args, **kwargs)`` with Ctrl-C held until the load returns: libllama's vocab loader
    logs through llama-cpp-python's ctypes callback, which would drop a KeyboardInterrupt raised in
    it, so Ctrl-C during a load would otherwise be lost and the conversion run on."""

    with deferred_interrupts():
        return Model(*args, **kwargs)
