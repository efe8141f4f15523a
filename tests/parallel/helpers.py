"""Helpers the parallel tests share (in the test process; `workers.py` runs in workers)."""

from __future__ import annotations


def check_stress(results: list[dict | None]) -> None:
    for rank, result in enumerate(results):
        assert result is not None, f"rank {rank} died"
        assert result["failures"] == [], f"rank {rank}: {result['failures'][:5]}"
        assert all(n > 0 for n in result["kinds"].values()), result["kinds"]
    # every rank saw the very same bytes for every result
    assert len({r["digest"] for r in results if r is not None}) == 1
