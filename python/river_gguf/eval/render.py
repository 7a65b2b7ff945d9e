"""The Pareto report, rendered: its markdown table and notes, the Pareto plot, and the files
written (report.md, report.json, pareto.png). The numbers come from report.run_eval and
report.analyse; nothing here measures."""
from __future__ import annotations

import json
import math
import os
from typing import Dict, List, Optional

from ..measure import divergence
from ..results import json_safe
from .report import KLD_REFS, SPEED_REFS


def _f(x, fmt="{:.4f}"):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def opts_text(o: Optional[dict]) -> str:
    if not o:
        return "-"
    mode = o.get("mode", "river")
    if o.get("exit_layer") is not None:
        s = f"exit@{o['exit_layer']}"
    elif mode == "river":
        s = f"tau={o.get('threshold')}" + (f" min_exit={o['min_exit_layer']}" if o.get("min_exit_layer") else "")
    else:
        s = mode
    return (s + f" tail={o.get('tail', 0)}" + ("" if o.get("river_head", True) else " backbone head")
            + (" backbone attention" if o.get("river_attention") == "backbone" else ""))


def markdown(report: dict) -> str:
    """The report as markdown: every row's table, then what analyse() found, one part each."""
    a = report["analysis"]
    out = [_rows_table(report), ""]
    out += _presets_table(a["presets"]) if a.get("presets") else []
    out += _target_lines(a.get("targets", ()))
    for setup, res in a.get("dynamic_vs_static", {}).items():
        for key, v in res.items():
            out += _dynamic_vs_static_lines(setup, key, v)
    if a.get("consistency"):
        out.append(_consistency_line(a["consistency"]))
    if a["shuffle"]:
        out += _shuffle_table(a["shuffle"], report["settings"])
    for setup, v in a["vs_ladder"].items():
        who = "static" if setup == "static" else "River"
        name = "static river (+ backbone tail) controls" if setup == "static" else setup
        out += [_frontier_line(name, who, kind, v[kind]) for kind in ("q4_k_m", "q8_0") if kind in v]
    return "\n".join(out) + "\n"


def _rows_table(report: dict) -> str:
    """One line per row: speed, KLD from F16 with its interval and spread, same top token,
    perplexity, KLD per domain, mean exit layer and greedy agreement."""
    doms = list(report["domains"])
    head = ["setup", "config", "tok/s", "KLD from F16 [95% CI]", "KLD median", "KLD p99", "same top %", "ppl [95% CI]"] + \
        [f"KLD {d}" for d in doms] + ["mean exit", "agree", "agree prefix"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in report["rows"]:
        o = r["overall"]
        label = r["label"] + (" (llama.cpp)" if r.get("engine") == "llama.cpp" or r["kind"] == "ladder" else "")
        if r["kind"] == "preset":
            label = f"**{r['label']}** ({opts_text(r.get('preset_options'))})"
        st = o.get("same_top")
        cells = [r["setup"], label, _f(o.get("decode_tok_s"), "{:.1f}"),
                 divergence.fmt_ci(o.get("kld"), o.get("kld_ci")), _f(o.get("kld_median"), "{:.4f}"),
                 _f(o.get("kld_p99"), "{:.3f}"),
                 divergence.fmt_ci(None if st is None else 100 * st,
                                   None if o.get("same_top_ci") is None else [100 * x for x in o["same_top_ci"]], "{:.1f}"),
                 divergence.fmt_ci(o.get("ppl"), o.get("ppl_ci"), "{:.3f}")]
        cells += [_f(r["domains"][d].get("kld"), "{:.4f}") for d in doms]
        cells += [_f(o.get("mean_exit_layer"), "{:.1f}"), _f(o.get("agreement"), "{:.2f}"),
                  _f(o.get("agreement_prefix"), "{:.1f}")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _presets_table(presets: List[dict]) -> List[str]:
    """The presets against the ladder's reference files and the static rows they dominate."""
    out = ["Presets against the ladder (tok/s ratios and kld differences measured in this run):\n",
           "| preset | tok/s | kld | tok/s vs " + " | tok/s vs ".join(SPEED_REFS) + " | kld vs "
           + " | kld vs ".join(KLD_REFS) + " | dominated by | dominates |",
           "|" + "---|" * (5 + len(SPEED_REFS) + len(KLD_REFS))]
    for e in presets:
        cells = [e["preset"], _f(e["tok_s"], "{:.1f}"), _f(e["kld"])]
        cells += [_f(e["speed_ratio"].get(q), "{:.2f}x") for q in SPEED_REFS]
        cells += [_f(e["kld_delta"].get(q), "{:+.4f}") for q in KLD_REFS]
        cells += [", ".join(e["dominated_by"]) or "none", ", ".join(e["dominates"]) or "none"]
        out.append("| " + " | ".join(cells) + " |")
    out.append("")
    return out


def _target_lines(targets) -> List[str]:
    """Each target: met or not, each preset's speed and KLD against it with the paired interval,
    and the other rows that clear the same bar."""
    out = []
    for t in targets:
        goal = f"a preset at least as fast as {t['ref']} and at least as close to F16 (KLD)"
        if t["met"] is None:
            out.append(f"- {goal}: **n/a** ({t['why']}).")
            continue
        out.append(f"- {goal} ({t['ref_tok_s']:.1f} tok/s, KLD {_f(t['ref_kld'], '{:.4f}')}): "
                   f"**{'met by ' + ', '.join(t['met_by']) if t['met'] else 'not met'}**.")
        for c in t["presets"]:
            ci = c["delta_kld_ci"]
            out.append(f"  - {c['preset']}: {c['speed_ratio']:.2f}x its speed"
                       f"{'' if c['fast_enough'] or c['speed_ratio'] < 0.95 else ' (within 5%: timing noise)'}, "
                       f"KLD {c['kld']:.4f} (Δ {_f(c['delta_kld'], '{:+.4f}')}"
                       + (f", 95% CI [{ci[0]:+.4f}, {ci[1]:+.4f}]" if ci else "") + ")"
                       + (" -> closer, supported by the interval" if c["close_supported"] else
                          " -> not closer" if not c["close_enough"] else " -> closer, within the interval's noise"))
        also = t.get("bar_cleared_by")
        out.append(f"  - Other rows of this run that clear the same bar: {', '.join(also)}." if also else
                   "  - No other row of this run clears the same bar.")
    if targets:
        out.append("")
    return out


def _dynamic_vs_static_lines(setup: str, key: str, v: dict) -> List[str]:
    """One setup's dynamic rows against one static curve (`key`: llama.cpp's hybrids or
    river_gguf's river-only + tail rows): the table and its summary."""
    what = ("the static river (+ backbone tail) hybrids in stock llama.cpp" if key == "llama.cpp"
            else "the same static settings (river-only + tail) on river_gguf")
    out = [f"Dynamic exit ({setup}) vs {what} ({', '.join(v['static'])}), "
           "static kld interpolated at the row's measured speed:\n",
           "| row | tok/s | kld | static kld at that speed | Δ KLD | beats the static curve |\n"
           "|---|---|---|---|---|---|"]
    for c in v["rows"]:
        if c.get("static_kld_at_speed") is not None:
            st, d = _f(c["static_kld_at_speed"]), _f(c["delta_kld"], "{:+.4f}")
        else:
            st, d = c.get("outside", "-"), _f(c.get("delta_kld_vs_fastest", c.get("delta_kld_vs_best_faster")),
                                              "{:+.4f}")
        w = {True: "yes", False: "no", None: "-"}[c.get("wins")]
        out.append(f"| {c['label']}{'' if c['dynamic'] else ' (static setting)'} | {_f(c['tok_s'], '{:.1f}')} | "
                   f"{_f(c['kld'])} | {st} | {d} | {w} |")
    s = v["summary"]
    if s["compared"]:
        out.append(f"\n- Dynamic rows inside the static curve's speed range: {s['wins']} of {s['compared']} "
                   f"beat it (lower kld at the same speed). Best: {s['best_label']} ({s['best_tok_s']:.1f} "
                   f"tok/s), Δ KLD {s['best_delta_kld']:+.4f}; mean Δ KLD {s['mean_delta_kld']:+.4f} "
                   "(negative: dynamic better).")
    else:
        out.append("\n- No dynamic row falls inside the static curve's speed range.")
    out.append(f"- Counting the rows outside that range too (lost: a faster static point also has a lower "
               f"kld; won: faster than every static point and no worse than the fastest): "
               f"{s['decided_wins']} of {s['decided']} dynamic rows win.")
    out.append("")
    return out


def _consistency_line(consistency: List[dict]) -> str:
    same = all(c["same_kld"] for c in consistency)
    return ("Consistency: river-only (+ tail) rows on river_gguf vs their hybrid files "
            f"(kld {'identical' if same else 'NOT identical'}; speed river_gguf / llama.cpp: "
            + ", ".join(f"{c['control']} {c['tok_s'] / c['control_tok_s']:.2f}x" for c in consistency
                        if c.get("tok_s") and c.get("control_tok_s")) + ").\n")


def _shuffle_table(shuffle: List[dict], settings: dict) -> List[str]:
    out = ["Shuffle control (same exit-layer histogram, depths assigned to tokens at random, "
           f"seed {settings['shuffle_seed']}, {settings['shuffle_draws']} draws):\n",
           "| setup | tau | River kld | shuffled kld | cosine beats shuffle |\n|---|---|---|---|---|"]
    for s in shuffle:
        out.append(f"| {s['setup']} | {s['tau']:g} | {s['river_kld']:.4f} | "
                   f"{', '.join(f'{x:.4f}' for x in s['shuffle_kld'])} | "
                   f"{'yes' if s['cosine_beats_shuffle'] else 'no'} |")
    out.append("")
    return out


def _frontier_line(name: str, who: str, kind: str, q: dict) -> str:
    """The frontier of `name` against one ladder file: at Q4_K_M's speed (which KLD does it
    reach?) or at Q8_0's KLD (which speed?)."""
    ref = kind.upper()
    wins = f"{who} wins" if q["river_wins"] else f"{ref} wins"
    if kind == "q4_k_m":
        y = q["river_kld_at_speed"]
        head = f"- {name} frontier at Q4_K_M's speed ({q['ladder_tok_s']:.1f} tok/s, kld {q['ladder_kld']:.4f}): "
        if y is not None:
            return head + f"{who} kld {y:.4f} -> {wins}"
        if q["river_max_tok_s"] < q["ladder_tok_s"]:
            return head + f"no {who} point reaches that speed (max {q['river_max_tok_s']:.1f} tok/s) -> Q4_K_M wins"
        return head + f"every {who} point is faster (outside the frontier's range)"
    b = q["river_best_tok_s_at_or_below_kld"]
    head = f"- {name} frontier at Q8_0's kld ({q['ladder_kld']:.4f}, {q['ladder_tok_s']:.1f} tok/s): "
    if b is not None:
        return head + f"best {who} speed {b:.1f} tok/s -> {wins}"
    return head + f"no {who} point reaches that kld (best {q['river_min_kld']:.4f}) -> Q8_0 wins"


def pareto_plot(report: dict, path: str) -> None:
    # matplotlib is the optional `eval` extra, and slow to import: only when a plot is drawn.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 7))
    rows = report["rows"]
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown"]
    markers = {0: "o", 2: "^", 4: "s", 6: "D"}

    def has(r):
        return r["overall"].get("decode_tok_s") and r["overall"].get("kld")

    setups = [s for s in dict.fromkeys(r["setup"] for r in rows) if s not in ("ladder", "static")]
    for i, setup in enumerate(setups):
        c = colors[i % len(colors)]
        mine = [r for r in rows if r["setup"] == setup and has(r)]
        for t in sorted({r.get("tail") or 0 for r in mine if r["kind"] == "river"}):
            pts = sorted((r["overall"]["decode_tok_s"], r["overall"]["kld"], r) for r in mine
                         if r["kind"] == "river" and (r.get("tail") or 0) == t)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "-" + markers.get(t, "o"), color=c, ms=4,
                    label=f"{setup}: dynamic exit, tau sweep" + (f", tail {t}" if t else ""))
            for x, y, r in pts:
                ax.annotate(f"{r['tau']:g}", (x, y), fontsize=6, xytext=(2, 2), textcoords="offset points", color=c)
        pts = sorted((r["overall"]["decode_tok_s"], r["overall"]["kld"], r) for r in mine if r["kind"] == "fixed")
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "--s", color=c, ms=4, label=f"{setup}: fixed exit")
            for x, y, r in pts:
                ax.annotate(str(r["exit_layer"]), (x, y), fontsize=6, xytext=(2, 2), textcoords="offset points", color=c)
        sh = [(r["overall"]["decode_tok_s"], r["overall"]["kld"]) for r in mine if r["kind"] == "shuffle"]
        if sh:
            ax.plot(*zip(*sh), "x", color=c, label=f"{setup}: shuffled depths")
        ro = sorted((r["overall"]["decode_tok_s"], r["overall"]["kld"], r) for r in mine if r["kind"] == "river-only")
        if ro:
            ax.plot([p[0] for p in ro], [p[1] for p in ro], ":v", color=c, ms=7,
                    label=f"{setup}: river-only" + (" (+ tail, river_gguf)" if len(ro) > 1 else ""))
            for x, y, r in ro:
                if r.get("tail"):
                    ax.annotate(f"t{r['tail']}", (x, y), fontsize=6, xytext=(2, -8), textcoords="offset points", color=c)
        for r in mine:
            if r["kind"] == "backbone":
                ax.plot(r["overall"]["decode_tok_s"], r["overall"]["kld"], "*", color=c, ms=9,
                        label=f"{setup}: {r['label']} (river_gguf)")
        # Presets with the same options are one setting timed twice: one label for the group.
        groups: Dict[str, list] = {}
        for r in mine:
            if r["kind"] == "preset":
                groups.setdefault(json.dumps(r.get("preset_options") or r["preset"], sort_keys=True), []).append(r)
        for grp in groups.values():
            for r in grp:
                ax.plot(r["overall"]["decode_tok_s"], r["overall"]["kld"], "*", color="tab:red", mec="black", ms=16,
                        zorder=5)
            r = grp[0]
            ax.annotate(" = ".join(x["preset"] for x in grp), (r["overall"]["decode_tok_s"], r["overall"]["kld"]),
                        fontsize=9, fontweight="bold", color="tab:red", xytext=(6, 4), textcoords="offset points",
                        zorder=6)
    if any(r["kind"] == "preset" and has(r) for r in rows):
        ax.plot([], [], "*", color="tab:red", mec="black", ms=12, label="River GGUF presets (river_gguf)")
    ctl = sorted((r["overall"]["decode_tok_s"], r["overall"]["kld"], r) for r in rows if r["kind"] == "control" and has(r))
    if ctl:
        ax.plot([p[0] for p in ctl], [p[1] for p in ctl], "--P", color="0.45", ms=7,
                label="static river (+ backbone tail t) (llama.cpp)")
        for x, y, r in ctl:
            ax.annotate("river" if not r["tail"] else f"+tail {r['tail']}", (x, y), fontsize=7,
                        color="0.3", xytext=(4, 4), textcoords="offset points")
    lad = [r for r in rows if r["kind"] == "ladder" and has(r)]
    if lad:
        ax.plot([r["overall"]["decode_tok_s"] for r in lad], [r["overall"]["kld"] for r in lad], "kD", ms=6,
                label="static quant (llama.cpp)")
        for r in lad:
            ax.annotate(r["label"], (r["overall"]["decode_tok_s"], r["overall"]["kld"]), fontsize=8,
                        xytext=(4, -8), textcoords="offset points")
    n = report["threads"]
    ax.set_xlabel(f"decode tok/s (greedy, batch 1, {n} thread{'' if n == 1 else 's'})")
    ax.set_ylabel("KL divergence from F16 (teacher-forced through the decode path, %s)" % " + ".join(report["domains"]))
    ax.set_title(f"{report['model']}: River early exit vs. static quants (lower right is better)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def write_outputs(report: dict, out_dir: str, preamble: str = "") -> Dict[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    paths = {k: os.path.join(out_dir, n) for k, n in (("md", "report.md"), ("json", "report.json"),
                                                       ("png", "pareto.png"))}
    with open(paths["json"], "w", encoding="utf-8") as f:
        json.dump(json_safe(report), f, indent=1)
    with open(paths["md"], "w", encoding="utf-8") as f:
        f.write(preamble + markdown(report))
    pareto_plot(report, paths["png"])
    return paths
