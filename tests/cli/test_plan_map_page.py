"""The plan map's page geometry: labels that stand clear of boxes and of each other."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from kvbridge.cli.plan_map_page import BOX_H, BOX_W, count_overlaps, fit_page, rectangle
from kvbridge.plan.geometry import load_model_spec
from kvbridge.plan.layout import InstanceLayout
from kvbridge.plan.planner import make_plan


def _cross(o: np.ndarray, a: np.ndarray, b: np.ndarray) -> float:
    return float((a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0]))


def _overlap_by_edges(a: np.ndarray, b: np.ndarray) -> bool:
    """Reference: two convex quads (corners counter-clockwise) overlap when a corner of
    one lies inside the other or two of their edges cross."""

    def inside(p: np.ndarray, quad: np.ndarray) -> bool:
        return all(_cross(quad[k], quad[(k + 1) % 4], p) >= 0 for k in range(4))

    def crossing(p1, p2, q1, q2) -> bool:
        d1, d2 = _cross(q1, q2, p1), _cross(q1, q2, p2)
        d3, d4 = _cross(p1, p2, q1), _cross(p1, p2, q2)
        return d1 * d2 < 0 and d3 * d4 < 0

    if any(inside(p, b) for p in a) or any(inside(q, a) for q in b):
        return True
    return any(
        crossing(a[i], a[(i + 1) % 4], b[j], b[(j + 1) % 4]) for i in range(4) for j in range(4)
    )


rects = st.tuples(
    st.tuples(st.floats(-3, 3), st.floats(-3, 3)),
    st.floats(0.05, 3),
    st.floats(0.05, 1),
    st.floats(-math.pi / 2, math.pi / 2),
)


@given(rects, rects)
def test_overlap_agrees_with_edge_crossings(r1, r2):
    (c1, w1, h1, t1), (c2, w2, h2, t2) = r1, r2
    eps = 1e-6  # leave out pairs that only touch: there the two tests may differ
    shrunk = _overlap_by_edges(rectangle(c1, w1 - eps, h1 - eps, t1), rectangle(c2, w2, h2, t2))
    grown = _overlap_by_edges(rectangle(c1, w1 + eps, h1 + eps, t1), rectangle(c2, w2, h2, t2))
    assume(shrunk == grown)
    a, b = rectangle(c1, w1, h1, t1), rectangle(c2, w2, h2, t2)
    assert count_overlaps(a, [b]) == int(grown) == count_overlaps(b, [a])


def test_overlap_of_turned_labels_is_not_their_bounding_boxes():
    # two parallel labels at 30 degrees, 0.3 apart across: their bounding boxes overlap,
    # they do not; the same labels crossing as an X overlap with no corner inside
    t = math.radians(30)
    normal = np.array([-math.sin(t), math.cos(t)])
    a = rectangle((0.0, 0.0), 2.0, 0.17, t)
    b = rectangle(tuple(0.3 * normal), 2.0, 0.17, t)
    x = rectangle((0.0, 0.0), 2.0, 0.17, -t)
    assert count_overlaps(a, [b]) == 0
    assert count_overlaps(a, [x, b, a]) == 2


@pytest.mark.parametrize(
    "config, prefill, decode",
    [
        ("smollm2-135m", (3, 1), (9, 3)),  # 27 reads, nine from each prefill worker
        ("llama-3.2-1b", (2, 2), (4, 1)),  # arrows of the two stages cross
        ("llama-3.2-1b", (2, 2), (8, 3)),  # 32 reads
    ],
)
def test_labels_stand_clear_between_the_columns(config, prefill, decode):
    plan = make_plan(
        load_model_spec(config),
        InstanceLayout(tp_size=prefill[0], pp_size=prefill[1]),
        InstanceLayout(tp_size=decode[0], pp_size=decode[1]),
    )
    page = fit_page(plan, [(2.1, 0.17)] * len(plan.reads))  # the size of "heads [0,2) L[..."
    assert page.clashes == 0
    boxes = [
        rectangle((col.x + BOX_W / 2, y), BOX_W, BOX_H)
        for col in (page.left, page.right)
        for y in col.centre_y.values()
    ]
    for i, (r, ((x0, y0), (x1, y1))) in enumerate(zip(plan.reads, page.arrows, strict=True)):
        # from the prefill box's right edge to the decode box's left edge
        assert x0 == page.left.x + BOX_W and x1 == page.right.x
        assert abs(y0 - page.left.centre_y[r.prefill_rank]) < BOX_H / 2
        assert abs(y1 - page.right.centre_y[r.decode_rank]) < BOX_H / 2
        label = page.labels[i]
        assert (label[:, 0] > x0).all() and (label[:, 0] < x1).all()
        others = [b for j, b in enumerate(page.labels) if j != i]
        assert count_overlaps(label, boxes + others) == 0
