"""`river-gguf info`: a model's architecture, river and presets."""
import os

from .. import presets
from ..devices import list_devices, offload_gpus
from .common import load_model


# ----- info ----------------------------------------------------------------------------
def _print_devices() -> None:
    devs = list_devices()
    gpus = offload_gpus()
    rows = [("device", "type", "free MiB", "total MiB", "main_gpu", "description")]
    for d in devs:
        idx = str(gpus.index(d["name"])) if d["name"] in gpus else "-"
        rows.append((d["name"], d["type"], f"{d['memory_free'] / 2**20:.0f}", f"{d['memory_total'] / 2**20:.0f}", idx,
                     d["description"]))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        print("  ".join(f"{c:<{w}}" for c, w in zip(r, widths)) + "  " + r[-1])
    if not gpus:
        print("no GPU: this llama-cpp-python has no GPU backend, or it sees no device "
              "(scripts/setup.sh builds one with RIVER_GGUF_GPU=cuda or vulkan)")


def _cmd_info(args) -> int:
    if args.devices:
        _print_devices()
        if args.model is None:
            return 0
        print()
    # The smallest context: info reads metadata and needs no KV cache worth allocating.
    args.ctx = 16
    m = load_model(args)
    md, hp = m.metadata, m.hparams
    rows = [("file", m.model_path), ("size", f"{os.path.getsize(m.model_path) / 2**20:.1f} MiB"),
            ("name", md.get("general.name", "?")), ("arch", hp["arch"]), ("n_layer", hp["n_layer"]),
            ("n_embd", hp["n_embd"]), ("n_head", f"{hp['n_head']} (kv {hp['n_head_kv']})"),
            ("n_vocab", hp["n_vocab"]), ("n_ctx_train", hp["n_ctx_train"]),
            ("chat template", "yes" if md.get("tokenizer.chat_template") else "no"),
            ("river", ("yes" + (f" ({m.river_path})" if m.river_path else " (embedded)")) if m.has_river else "no")]
    if m.has_river:
        rows.append(("river head", "yes" if m.river_has_head else "no"))
    rows.append(("exit defaults", m.exit_options))
    rows += [(k, v) for k, v in sorted(md.items()) if k.startswith("river.") and k not in ("river.presets", "river.presets_grid")]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    if m.presets:
        print("frontier (presets: KLD measured on the calibration split; cost per decode step by the stored cost "
              "model, or timed by river-gguf tune):")
        for line in presets.describe(m.presets, m.metadata.get(presets.DEFAULT_KEY, presets.DEFAULT_PRESET)):
            print(f"  {line}")
    return 0


def register(sub, common) -> None:
    p = sub.add_parser("info", parents=[common.model],
                       help="print a model's architecture and river metadata (--devices: the devices ggml sees)")
    p.add_argument("--devices", action="store_true",
                   help="list the devices ggml sees (name, type, free and total memory) and the main_gpu index of "
                        "each GPU; with no MODEL, only that")
    p.set_defaults(func=_cmd_info)
