"""Where the parts of the plan map stand on the page (pure geometry, no matplotlib).

Distances are inches with y growing up: the map's axes span the whole figure at one
data unit per inch, so angles and distances computed here are the ones on the page.
Prefill boxes stand in a column on the left, decode boxes in a column on the right,
stage by stage; every read is a straight arrow from the right edge of its prefill box
to the left edge of its decode box, with its label laid along it where the label
overlaps no box and no other label.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from kvbridge.plan.layout import WorkerShard
from kvbridge.plan.planner import TransferPlan

BOX_W, BOX_H = 2.2, 0.66
ROW = 0.86  # pitch of the longer column's boxes
STAGE_GAP = 0.3  # between the bands of two pp stages
MARGIN_X, TOP, BOTTOM = 0.5, 1.05, 0.6  # TOP holds the title, BOTTOM the legend
#: Where along an arrow (0 at the prefill end) a label may go, most wanted first:
#: the middle, then alternately nearer either end.
LABEL_SPOTS = tuple((50 + sign * 4 * k) / 100 for k in range(10) for sign in (1, -1))[1:]
LABEL_CLEARANCE = 0.18  # between a label and a box side (room for the arrowhead)
#: (room between the columns, row pitch) tried in turn until every label stands clear
ROOMS = ((4.4, ROW), (5.2, ROW), (6.0, 1.25 * ROW), (7.0, 1.5 * ROW))

Point = tuple[float, float]


@dataclass(frozen=True)
class Column:
    """Where one instance's workers stand: box centres and pp stage bands."""

    side: str  # "prefill" or "decode"
    x: float  # left edge of the boxes
    centre_y: dict[int, float]  # rank -> y of the box centre
    stages: tuple[tuple[int, float, float], ...]  # (pp_rank, top y, bottom y)


@dataclass(frozen=True)
class MapPage:
    """Everything's place on one page; `arrows[i]` and `labels[i]` belong to plan.reads[i]."""

    width: float
    height: float
    left: Column  # prefill
    right: Column  # decode
    arrows: tuple[tuple[Point, Point], ...]  # (start, end)
    labels: tuple[np.ndarray, ...]  # the corners [4, 2] of each label
    clashes: int  # labels that overlap a box or an earlier label

    @property
    def top(self) -> float:
        """y of the columns' top edge."""
        return self.height - TOP


def rectangle(centre: Point, w: float, h: float, angle: float = 0.0) -> np.ndarray:
    """Corners [4, 2] of a w x h rectangle about `centre`, turned by `angle` radians."""
    c, s = math.cos(angle), math.sin(angle)
    half = np.array([[-w, -h], [w, -h], [w, h], [-w, h]]) / 2
    return half @ np.array([[c, s], [-s, c]]) + np.asarray(centre)


def count_overlaps(rect: np.ndarray, others: list[np.ndarray]) -> int:
    """How many of `others` the rectangle `rect` overlaps (corners as `rectangle` gives
    them). Two rectangles overlap unless the normal of one of their four distinct
    edges separates their projections."""
    if not others:
        return 0
    b = np.stack(others)  # [M, 4 corners, 2]
    turn = np.array([[0.0, 1.0], [-1.0, 0.0]])  # edge @ turn: its normal
    normals = np.concatenate(
        [
            np.broadcast_to((rect[1:3] - rect[0:2]) @ turn, (len(b), 2, 2)),
            (b[:, 1:3] - b[:, 0:2]) @ turn,
        ],
        axis=1,
    )  # [M, 4 normals, 2]
    pa = np.einsum("cd,mkd->mkc", rect, normals)  # [M, normal, corner]
    pb = np.einsum("mcd,mkd->mkc", b, normals)
    apart = (pa.max(-1) < pb.min(-1)) | (pb.max(-1) < pa.min(-1))
    return int((~apart.any(-1)).sum())


def place_label(
    size: Point, start: Point, end: Point, taken: list[np.ndarray]
) -> tuple[np.ndarray, int]:
    """The corners of a label of `size` (w, h) laid along the arrow start -> end at the
    first of LABEL_SPOTS where it overlaps nothing in `taken`, else where it overlaps
    fewest; and how many things it overlaps there."""
    (x0, y0), (x1, y1) = start, end
    angle = math.atan2(y1 - y0, x1 - x0)
    best: tuple[int, np.ndarray] | None = None
    for t in LABEL_SPOTS:
        box = rectangle((x0 + t * (x1 - x0), y0 + t * (y1 - y0)), *size, angle)
        overlaps = count_overlaps(box, taken)
        if best is None or overlaps < best[0]:
            best = (overlaps, box)
        if overlaps == 0:
            break
    assert best is not None
    return best[1], best[0]


def _column(
    side: str, workers: tuple[WorkerShard, ...], x: float, top: float, height: float
) -> Column:
    """Spread `workers` over `height` below `top`, stage by stage."""
    pp_ranks = sorted({w.pp_rank for w in workers})
    pitch = (height - (len(pp_ranks) - 1) * STAGE_GAP) / len(workers)
    centre_y: dict[int, float] = {}
    stages = []
    y = top
    for pp in pp_ranks:
        stage_top = y
        for w in sorted((w for w in workers if w.pp_rank == pp), key=lambda w: w.tp_rank):
            centre_y[w.rank] = y - pitch / 2
            y -= pitch
        stages.append((pp, stage_top, y))
        y -= STAGE_GAP
    return Column(side, x, centre_y, tuple(stages))


def _ports(
    ends: dict[int, list[tuple[float, int]]], centre_y: dict[int, float]
) -> dict[int, float]:
    """Spread the arrows meeting one box along its edge, in the order of their other
    ends (top first), so that the arrows of one box do not cross at the box.

    `ends[rank]` lists (y of the other end, read index); returns read index -> y."""
    out = {}
    for rank, items in ends.items():
        n = len(items)
        spread = min(BOX_H * 0.7, 0.14 * (n - 1))
        step = spread / (n - 1) if n > 1 else 0.0
        for k, (_, i) in enumerate(sorted(items, key=lambda t: (-t[0], t[1]))):
            out[i] = centre_y[rank] + spread / 2 - k * step
    return out


def map_page(plan: TransferPlan, label_sizes: list[Point], span: float, row: float) -> MapPage:
    """The page with columns `span` apart and the longer column's boxes `row` apart;
    `label_sizes[i]` is the (w, h) of read i's label."""
    content_h = max(
        len(plan.prefill_workers) * row + (plan.prefill.pp_size - 1) * STAGE_GAP,
        len(plan.decode_workers) * row + (plan.decode.pp_size - 1) * STAGE_GAP,
    )
    width = 2 * MARGIN_X + 2 * BOX_W + span
    height = TOP + content_h + BOTTOM
    top = height - TOP
    left = _column("prefill", plan.prefill_workers, MARGIN_X, top, content_h)
    right = _column("decode", plan.decode_workers, width - MARGIN_X - BOX_W, top, content_h)

    outgoing: dict[int, list[tuple[float, int]]] = defaultdict(list)
    incoming: dict[int, list[tuple[float, int]]] = defaultdict(list)
    for i, r in enumerate(plan.reads):
        outgoing[r.prefill_rank].append((right.centre_y[r.decode_rank], i))
        incoming[r.decode_rank].append((left.centre_y[r.prefill_rank], i))
    start_y, end_y = _ports(outgoing, left.centre_y), _ports(incoming, right.centre_y)
    arrows = tuple(
        ((left.x + BOX_W, start_y[i]), (right.x, end_y[i])) for i in range(len(plan.reads))
    )

    # labels keep clear of the boxes and of the arrowheads beside them
    taken = [
        rectangle((col.x + BOX_W / 2, y), BOX_W + 2 * LABEL_CLEARANCE, BOX_H)
        for col in (left, right)
        for y in col.centre_y.values()
    ]
    labels, clashes = [], 0
    for size, (start, end) in zip(label_sizes, arrows, strict=True):
        box, overlaps = place_label(size, start, end, taken)
        labels.append(box)
        taken.append(box)
        clashes += overlaps
    return MapPage(width, height, left, right, arrows, tuple(labels), clashes)


def fit_page(plan: TransferPlan, label_sizes: list[Point]) -> MapPage:
    """The first page of ROOMS on which no label overlaps a box or another label; if
    none is, the one with the fewest such labels (the most compact among equals)."""
    page = map_page(plan, label_sizes, *ROOMS[0])
    for room in ROOMS[1:]:
        if page.clashes == 0:
            break
        roomier = map_page(plan, label_sizes, *room)
        page = roomier if roomier.clashes < page.clashes else page
    return page
