"""Sweep plots (matplotlib, optional): accuracy vs NFE per sequence with the Pareto front, TPS per setting."""
from __future__ import annotations

from pathlib import Path
import json
from typing import Any, Dict, List, Optional, Sequence, Tuple

from dlm_engine.sweeps.tables import format_value, is_number, parse_scalar, sort_key, varying

def _label(row: Dict[str, Any], keys: Sequence[str]) -> str:
    return ", ".join(f"{k.split('.')[-1]}={format_value(row.get(k))}" for k in keys)


def _group_key(rows: Sequence[Dict[str, Any]], vary: Sequence[str]) -> Optional[str]:
    """Legend grouping: the strategy, cache or model when several are compared (in that order), else the varying
    setting with fewest values."""
    for key in ("strategy", "cache", "model"):
        if key in vary:
            return key
    best = None
    for k in vary:
        n = len({json.dumps(r.get(k), default=str) for r in rows})
        if n <= 8 and (best is None or n < best[0]):
            best = (n, k)
    return best[1] if best else None


def _numeric_params(rows: Sequence[Dict[str, Any]], vary: Sequence[str]) -> List[str]:
    nums = [k for k in vary if all(is_number(r.get(k)) for r in rows)]

    def rank(k: str) -> Tuple[int, str]:
        for i, word in enumerate(("threshold", "block_length", "buffer_size", "factor", "steps")):
            if word in k:
                return (i, k)
        return (9, k)

    return sorted(nums, key=rank)[:3]


MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">", "h", "p")


def clusters(display_xy, radius_px: float = 9.0) -> List[List[int]]:
    """Points closer than ``radius_px`` on screen, grouped (in input order; each cluster led by its first point):
    one label per cluster names all of its points. Deterministic."""
    import math

    out: List[List[int]] = []
    for i, (x, y) in enumerate(display_xy):
        for c in out:
            cx, cy = display_xy[c[0]]
            if math.hypot(x - cx, y - cy) < radius_px:
                c.append(i)
                break
        else:
            out.append([i])
    return out


def accuracy_figure(plt, ok: Sequence[Dict[str, Any]], group: Optional[str], groups: Dict[str, List[Dict[str, Any]]],
                    rest: Sequence[str]):
    """Accuracy vs NFE per sequence: every point drawn at its own value (never moved), a marker and colour per
    group (strategy when several are compared), the Pareto front outlined, and every point labelled with the
    settings that vary (``group`` and ``rest``). Points that land on (or next to) each other share one label that
    names each of them; one not exactly at the label's point has its values added."""
    pts = [r for r in ok if is_number(r.get("accuracy")) and is_number(r.get("nfe_per_prompt"))]
    if not pts:
        return None
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, (ax, side) = plt.subplots(1, 2, figsize=(10.8, 4.8), dpi=100, gridspec_kw={"width_ratios": [3, 2]})
    side.axis("off")
    ordered = sorted(groups.items(), key=lambda kv: sort_key(parse_scalar(kv[0])))
    style = {g: (colors[i % len(colors)], MARKERS[i % len(MARKERS)]) for i, (g, _) in enumerate(ordered)}
    drawn = [(g, r) for g, rs in ordered for r in rs if r in pts]
    for i, (g, _) in enumerate(ordered):
        mine = [r for gg, r in drawn if gg == g]
        if not mine:
            continue
        color, marker = style[g]
        # hollow markers, larger for later groups: points at the same value stay visible, each exactly there
        ax.scatter([r["nfe_per_prompt"] for r in mine], [r["accuracy"] for r in mine], s=36 + 22 * (i % 4),
                   marker=marker, facecolors="none", edgecolors=color, linewidths=1.3, zorder=2,
                   label=f"{group.split('.')[-1]}={g}" if group else None)
    front = sorted((r for r in pts if r.get("pareto")), key=lambda r: (r["nfe_per_prompt"], -r["accuracy"]))
    if front:
        ax.plot([r["nfe_per_prompt"] for r in front], [r["accuracy"] for r in front], drawstyle="steps-post",
                color="black", lw=1.0, zorder=1, label="Pareto front")
    ax.margins(0.1)
    ax.autoscale_view()
    handles, names = ax.get_legend_handles_labels()
    if handles:
        side.legend(handles, names, fontsize=8, loc="upper left", bbox_to_anchor=(0.0, 1.0), borderaxespad=0.0)
    keys = ([group] if group else []) + list(rest)
    if keys:
        # every point gets a number beside it (points on one spot share one: "3,4"); the key lists each number with
        # the settings that vary and the point's values, so no label covers another however close the points are
        xy = [(r["nfe_per_prompt"], r["accuracy"]) for _, r in drawn]
        key, n = [], 0
        for c in clusters(ax.transData.transform(xy)):
            nums = list(range(n + 1, n + len(c) + 1))
            n += len(c)
            ax.annotate(",".join(map(str, nums)), xy[c[0]], textcoords="offset points", xytext=(6, 3), fontsize=7,
                        zorder=3)
            key += [f"{k:>2}  {_label(drawn[i][1], keys)}: {format_value(xy[i][1])} at NFE {format_value(xy[i][0])}"
                    for k, i in zip(nums, c)]
        top = 1.0 - 0.075 * (len(handles) + 1) if handles else 1.0
        side.text(0.0, top, "\n".join(key), va="top", ha="left", fontsize=6.5, family="monospace",
                  transform=side.transAxes)
    ax.set_xlabel("NFE per sequence (mean forwards a sequence took part in)")
    ax.set_ylabel("accuracy (exact match)")
    ax.set_title("accuracy vs NFE")
    ax.grid(alpha=0.3)
    return fig


def write_plots(rows: Sequence[Dict[str, Any]], settings: Sequence[str], out_dir: Path) -> Tuple[List[Path], List[str]]:
    """accuracy_vs_nfe.png and tps.png over the ``settings`` that vary; returns (written files, notes).
    Raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r.get("status") == "ok"]
    vary = varying(ok, settings)
    written, notes = [], []
    if not ok:
        return written, ["no finished jobs: nothing to plot"]
    group = _group_key(ok, vary)
    groups: Dict[str, List[Dict[str, Any]]] = {}
    for r in ok:
        groups.setdefault(format_value(r.get(group)) if group else "", []).append(r)
    rest = [k for k in vary if k != group]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]  # tps.png

    fig = accuracy_figure(plt, ok, group, groups, rest)
    if fig is not None:
        written.append(_save_figure(plt, fig, Path(out_dir) / "accuracy_vs_nfe.png"))
    else:
        notes.append("no accuracy in the results (the task has no checker): accuracy_vs_nfe.png not written")

    tps_rows = [r for r in ok if is_number(r.get("tps"))]
    if tps_rows:
        params = _numeric_params(tps_rows, vary)
        if params:
            fig, axes = plt.subplots(1, len(params), figsize=(4.6 * len(params), 3.8), dpi=100, squeeze=False)
            for ax, p in zip(axes[0], params):
                others = [k for k in vary if k != p]
                lines: Dict[Tuple, List[Dict[str, Any]]] = {}
                for r in tps_rows:
                    lines.setdefault(tuple(sort_key(r.get(k)) for k in others), []).append(r)
                many = len(lines) > 8
                for i, (_, rs) in enumerate(sorted(lines.items())):
                    rs = sorted(rs, key=lambda r: r[p])
                    lab = _label(rs[0], others)
                    ax.plot([r[p] for r in rs], [r["tps"] for r in rs], marker="o", ms=4, lw=1,
                            color=colors[i % len(colors)], label=None if many or not lab else lab)
                xs = sorted({r[p] for r in tps_rows})
                if len(xs) <= 8:
                    ax.set_xticks(xs, [format_value(x) for x in xs])
                ax.set_ylim(bottom=0)
                ax.set_xlabel(p)
                ax.set_ylabel("TPS (generated tokens / s)")
                ax.grid(alpha=0.3)
                if not many and others:
                    ax.legend(fontsize=7)
            fig.suptitle("tokens per second")
        else:
            fig, ax = plt.subplots(figsize=(6.4, 0.35 * len(tps_rows) + 1.2), dpi=100)
            labels = [(_label(r, vary) or str(r.get("strategy") or r["job"]))[:48] for r in tps_rows]
            ax.barh(range(len(tps_rows)), [r["tps"] for r in tps_rows], color=colors[0])
            ax.set_yticks(range(len(tps_rows)), labels, fontsize=7)
            ax.set_xlabel("TPS (generated tokens / s)")
            ax.invert_yaxis()
            ax.grid(alpha=0.3, axis="x")
        written.append(_save_figure(plt, fig, Path(out_dir) / "tps.png"))
    return written, notes


def _save_figure(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
