"""`river-gguf info`: a model's architecture, river and presets."""
import os

from .common import load_model


# ----- info ----------------------------------------------------------------------------
def _cmd_info(args) -> int:
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
        from .. import presets

        print("frontier (presets: KLD measured on the calibration split; cost per decode step by the stored cost "
              "model, or timed by river-gguf tune):")
        for line in presets.describe(m.presets, m.metadata.get(presets.DEFAULT_KEY, presets.DEFAULT_PRESET)):
            print(f"  {line}")
    return 0


def register(sub, common) -> None:
    p = sub.add_parser("info", parents=[common.model], help="print a model's architecture and river metadata")
    p.set_defaults(func=_cmd_info)
