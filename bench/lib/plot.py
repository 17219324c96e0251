"""The benchmark's figure: time per request, speed-ups, achieved FLOP/s against the matmul peak, throughput."""

from __future__ import annotations

import matplotlib

from bench.lib import arms

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

GRID = arms.of("grid")
ARM_STYLE = {name: (arm.title, arm.colour) for name, arm in GRID.items()}  # the grid's arms: label and colour


def _label(c: dict) -> str:
    """Axis label of a cell."""
    return f"{c['doc_tokens_target']}t\n{c['questions']}q/{c['options']}o"


def _short(workload: str) -> str:
    """A throughput workload as '3q/300t'."""
    return workload.replace(" questions over ", "q/").replace(" question over ", "q/").replace(" tokens", "t")


def _bars(ax, cells: list[dict], value, arms: list[str], log: bool = True) -> None:
    """Grouped bars, one group per cell; hatched where the arm's figure was scaled from a subsample."""
    width = 0.8 / len(arms)
    for j, arm in enumerate(arms):
        name, colour = ARM_STYLE.get(arm, (arm, None))
        xs = [i + (j - (len(arms) - 1) / 2) * width for i in range(len(cells))]
        ys = [value(c, arm) for c in cells]
        hatch = ["//" if c["arms"].get(arm, {}).get("extrapolated") else "" for c in cells]
        for x, y, h in zip(xs, ys, hatch):
            ax.bar(
                x, y, width, color=colour, hatch=h, edgecolor="white", linewidth=0.3, label=name if x == xs[0] else None
            )
    ax.set_xticks(range(len(cells)), [_label(c) for c in cells], fontsize=7)
    if log:
        ax.set_yscale("log")


def plot(res: dict, path: str) -> None:
    """Write the four-panel figure of a results dict to `path` (PNG)."""
    cells = res["cells"]
    fig, axes = plt.subplots(2, 2, figsize=(15, 9.5))
    arms = list(ARM_STYLE)

    ax = axes[0][0]
    _bars(ax, cells, lambda c, a: c["arms"][a]["wall_s"], arms)
    ax.set_title("wall time per request (s, log); hatched: scaled from a subsample of the questions", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")

    ax = axes[0][1]
    peers = [name for name, arm in GRID.items() if arm.runs]
    width = 0.8 / (2 * len(peers))
    k = 0
    for blink_arm in ("blink_plain", "blink_prefix"):
        for peer in peers:
            xs = [i + (k - (2 * len(peers) - 1) / 2) * width for i in range(len(cells))]
            ys = [c["speedup"][blink_arm][peer] for c in cells]
            ax.bar(
                xs,
                ys,
                width,
                color=ARM_STYLE[peer][1],
                alpha=1.0 if blink_arm == "blink_plain" else 0.55,
                label=f"{ARM_STYLE[blink_arm][0]} vs {ARM_STYLE[peer][0]}",
            )
            k += 1
    ax.plot(
        range(len(cells)),
        [c["speedup"]["blink_prefix"]["blink_plain"] for c in cells],
        "o-",
        color=ARM_STYLE["blink_prefix"][1],
        label="shared prefix vs blink plain",
    )
    ax.axhline(1, color="black", lw=0.8)
    ax.axhline(3, color="#d62728", lw=0.8, ls="--")
    ax.axhline(4, color="#17becf", lw=0.8, ls="--")
    ax.set_yscale("log")
    ax.set_xticks(range(len(cells)), [_label(c) for c in cells], fontsize=7)
    ax.set_title("speed-up of blink (x, log); dashed: targets 3x (per-option), 4x (prefix)", fontsize=9)
    ax.legend(fontsize=6, ncol=2, loc="upper left")

    ax = axes[1][0]
    _bars(ax, cells, lambda c, a: c["arms"][a].get("gflops_body_attention", 0), arms, log=False)
    ax.axhline(res["matmul_gflops"], color="black", ls="--", lw=1)
    ax.text(0, res["matmul_gflops"] * 0.97, f"measured matmul {res['matmul_gflops']:.0f} GFLOP/s", fontsize=8, va="top")
    ax.set_title("achieved prefill GFLOP/s (body matmuls + attention) against the machine's matmul", fontsize=9)

    ax = axes[1][1]
    rows = [r for r in res.get("throughput", []) if "requests_per_s" in r]
    if rows:
        names = [
            f"{r['target'].split(' ')[0]}\n{'' if r['window_ms'] is None else str(r['window_ms']) + ' ms'}"
            f"{' prefix' if r.get('prefix_cache') else ''}\n{_short(r.get('workload', ''))}"
            for r in rows
        ]
        ax.bar(range(len(rows)), [r["requests_per_s"] for r in rows], color="#1f77b4")
        for i, r in enumerate(rows):
            ax.text(
                i,
                r["requests_per_s"],
                f"p50 {r['p50_ms']:.0f}\np99 {r['p99_ms']:.0f} ms",
                ha="center",
                va="bottom",
                fontsize=6,
            )
        ax.set_xticks(range(len(rows)), names, fontsize=6)
        ax.set_title(f"throughput: requests/s, {rows[-1]['clients']} concurrent clients", fontsize=9)
    else:
        ax.set_axis_off()

    fig.suptitle(
        f"blink bench: {res['model']} ({res['dtype']}, {res['device']}), {res['hardware']}, "
        f"{res['threads']['threads']} thread(s) — {res['mode']}{' --quick' if res.get('quick') else ''} run",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
