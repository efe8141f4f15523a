"""`kvbridge plan --svg FILE`: the plan drawn as a map (matplotlib, imported on use).

Prefill workers stand in a column on the left, decode workers in a column on the
right, each a box naming its rank, tp/pp ranks, heads and layers (half-open, global).
Workers of one pp stage share a shaded band when an instance has more than one stage.
A worker that holds the same heads as others of its stage (tp > num_kv_heads) is a
replica and has a dashed edge; a prefill replica no decode worker reads from is
greyed out. Every `Read` is one arrow from its prefill worker to its decode worker,
labelled with its heads, layers and bytes per token, and carries the SVG id
`read-{i}` (its index in `plan.reads`), so a reader of the file can count them.
Where things stand is `plan_map_page`'s business; this module only draws.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from kvbridge.cli.plan_map_page import BOX_H, BOX_W, MARGIN_X, Column, fit_page
from kvbridge.cli.plan_report import format_bytes
from kvbridge.errors import ConfigError
from kvbridge.plan.layout import WorkerShard
from kvbridge.plan.planner import Read, TransferPlan

if TYPE_CHECKING:
    from matplotlib.axes import Axes

#: one per prefill worker that is read from (tab10 without grey, which marks unused ones)
ARROW_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b",
                "#e377c2", "#bcbd22")  # fmt: skip
INK, GREY, NOTE = "#222222", "#a0a0a0", "#555555"
FILL = {"prefill": "#e8f0fa", "decode": "#fdf0e2"}
LEGEND = (
    "One arrow per read: for every request the decode worker pulls these heads and layers "
    "from the prefill worker. Ranges are half-open, heads and layers global.\n"
    "Dashed edge: a replica (other workers of its stage hold the same heads); grey: an "
    "unused prefill replica (no reader; it frees its blocks once prefill is done)."
)


def _r(r: tuple[int, int]) -> str:
    return f"[{r[0]},{r[1]})"


def _read_label(r: Read) -> str:
    return f"heads {_r(r.kv_heads)} L{_r(r.layers)} {format_bytes(r.bytes_per_token)}/tok"


def _source_colors(plan: TransferPlan) -> dict[int, str]:
    """One colour per prefill worker that is read from, in rank order."""
    sources = sorted({r.prefill_rank for r in plan.reads})
    return {rank: ARROW_COLORS[k % len(ARROW_COLORS)] for k, rank in enumerate(sources)}


def _replicas(workers: tuple[WorkerShard, ...]) -> dict[int, tuple[int, int]]:
    """rank -> (k, n) for workers whose stage has n > 1 workers holding the same heads."""
    groups: dict[tuple[int, tuple[int, int]], list[int]] = defaultdict(list)
    for w in workers:
        groups[(w.pp_rank, w.kv_heads)].append(w.rank)
    return {
        rank: (k + 1, len(ranks))
        for ranks in groups.values()
        if len(ranks) > 1
        for k, rank in enumerate(ranks)
    }


def _status(
    plan: TransferPlan, w: WorkerShard, is_prefill: bool, replica: tuple[int, int] | None
) -> str:
    """A box's last line: readers (prefill) or bytes read (decode), and replica rank."""
    if is_prefill:
        num = plan.expected_notifications[w.rank]
        status = f"{num} reader{'s' * (num != 1)}" if num else "no readers"
    else:
        total = sum(r.bytes_per_token for r in plan.reads_for(w.rank))
        status = f"reads {format_bytes(total)}/tok"
    unused = is_prefill and plan.expected_notifications[w.rank] == 0
    if replica is not None:
        return f"{'unused replica' if unused else 'replica'} {replica[0]}/{replica[1]} · {status}"
    return f"unused · {status}" if unused else status


def _draw_column(
    ax: Axes, col: Column, plan: TransferPlan, workers: tuple[WorkerShard, ...]
) -> None:
    from matplotlib.patches import FancyBboxPatch, Rectangle

    is_prefill = col.side == "prefill"
    if len(col.stages) > 1:
        for pp, top, bottom in col.stages:
            ax.add_patch(
                Rectangle(
                    (col.x - 0.12, bottom + 0.04),
                    BOX_W + 0.24,
                    top - bottom - 0.08,
                    facecolor="#ececec",
                    edgecolor="none",
                    zorder=0,
                )
            )
            layers = next(w.layers for w in workers if w.pp_rank == pp)
            ax.text(
                col.x - 0.24 if is_prefill else col.x + BOX_W + 0.24,
                (top + bottom) / 2,
                f"pp{pp} · layers {_r(layers)}",
                rotation=90,
                ha="center",
                va="center",
                fontsize=7.5,
                color=NOTE,
            )
    replicas = _replicas(workers)
    colors = _source_colors(plan)
    letter = "P" if is_prefill else "D"
    for w in workers:
        y = col.centre_y[w.rank]
        unused = is_prefill and plan.expected_notifications[w.rank] == 0
        edge = (GREY if unused else colors.get(w.rank, INK)) if is_prefill else INK
        ax.add_patch(
            FancyBboxPatch(
                (col.x, y - BOX_H / 2),
                BOX_W,
                BOX_H,
                boxstyle="round,pad=0,rounding_size=0.06",
                facecolor="#f4f4f4" if unused else FILL[col.side],
                edgecolor=edge,
                linewidth=1.3,
                linestyle=(0, (4, 2)) if w.rank in replicas else "solid",
                zorder=2,
                gid=f"{col.side}-{w.rank}",
            )
        )
        ink = GREY if unused else INK
        ax.text(
            col.x + 0.1,
            y + BOX_H / 2 - 0.09,
            f"{letter}{w.rank} tp{w.tp_rank}/pp{w.pp_rank}",
            ha="left",
            va="top",
            fontsize=9,
            fontweight="bold",
            color=ink,
            zorder=3,
            gid=f"{col.side}-{w.rank}-name",
        )
        ax.text(
            col.x + 0.1,
            y - BOX_H / 2 + 0.08,
            f"heads {_r(w.kv_heads)}  layers {_r(w.layers)}\n"
            + _status(plan, w, is_prefill, replicas.get(w.rank)),
            ha="left",
            va="bottom",
            fontsize=7.5,
            linespacing=1.35,
            color=ink,
            zorder=3,
            gid=f"{col.side}-{w.rank}-text",
        )


def draw_plan(plan: TransferPlan, path: str | Path) -> int:
    """Write the map of `plan` to `path` as SVG; return the number of arrows (reads).

    Raises ConfigError when matplotlib is not installed, OSError when `path` cannot be
    written. Uses no pyplot and leaves matplotlib's global settings as they were."""
    try:
        import matplotlib
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import FancyArrowPatch
    except ImportError:
        raise ConfigError("--svg needs matplotlib; pip install 'kvbridge[map]'") from None

    # fixed ids (hashsalt) so the same plan gives the same file; text kept as text
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "kvbridge-plan"}):
        fig = Figure()
        canvas = FigureCanvasAgg(fig)  # measures the labels; savefig switches to SVG
        ax = fig.add_axes((0.0, 0.0, 1.0, 1.0))
        ax.set_axis_off()

        colors = _source_colors(plan)
        white = {"boxstyle": "round,pad=0.15", "facecolor": "white", "edgecolor": "none"}
        labels = [
            ax.text(
                0,
                0,
                _read_label(r),
                rotation_mode="anchor",
                ha="center",
                va="center",
                fontsize=7.5,
                color=colors[r.prefill_rank],
                zorder=5,
                bbox={**white, "alpha": 0.9},
            )
            for r in plan.reads
        ]
        renderer = canvas.get_renderer()
        sizes = []
        for label in labels:
            extent = label.get_window_extent(renderer)  # unturned, in pixels
            sizes.append((extent.width / fig.dpi + 0.06, extent.height / fig.dpi + 0.05))
        page = fit_page(plan, sizes)
        fig.set_size_inches(page.width, page.height)
        ax.set_xlim(0, page.width)
        ax.set_ylim(0, page.height)

        model = replace(plan.model, name=Path(plan.model.name).name)  # no local paths
        middle = page.width / 2
        ax.text(middle, page.height - 0.22, model.describe(), ha="center", va="top", fontsize=11)
        ax.text(
            middle,
            page.height - 0.47,
            f"prefill {plan.prefill.describe()}  →  decode {plan.decode.describe()}   "
            f"({len(plan.reads)} reads, {format_bytes(plan.bytes_per_token)} per token)",
            ha="center",
            va="top",
            fontsize=9,
            color="#444444",
        )
        for col, workers in ((page.left, plan.prefill_workers), (page.right, plan.decode_workers)):
            n = len(workers)
            ax.text(
                col.x + BOX_W / 2,
                page.top + 0.12,
                f"{col.side} ({n} worker{'s' * (n != 1)})",
                ha="center",
                va="bottom",
                fontsize=10,
                fontweight="bold",
            )
            _draw_column(ax, col, plan, workers)
        ax.text(MARGIN_X, 0.38, LEGEND, va="center", fontsize=7, linespacing=1.5, color=NOTE)

        for i, (r, (start, end)) in enumerate(zip(plan.reads, page.arrows, strict=True)):
            ax.add_patch(
                FancyArrowPatch(
                    start,
                    end,
                    arrowstyle="-|>",
                    mutation_scale=9,
                    shrinkA=0,
                    shrinkB=0,
                    linewidth=1.0,
                    color=colors[r.prefill_rank],
                    zorder=4,
                    gid=f"read-{i}",
                )
            )
            (x0, y0), (x1, y1) = start, end
            labels[i].set_rotation(math.degrees(math.atan2(y1 - y0, x1 - x0)))  # equal aspect
            labels[i].set_position(tuple(page.labels[i].mean(axis=0)))

        fig.savefig(
            path,
            format="svg",
            metadata={"Date": None, "Title": f"kvbridge plan: {model.describe()}"},
        )
    return len(plan.reads)
