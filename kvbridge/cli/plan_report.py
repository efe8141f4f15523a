"""Human-readable tables for `kvbridge plan` (rich)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from kvbridge.plan.planner import TransferPlan
from kvbridge.plan.verifier import VerifyReport


def _r(r: tuple[int, int]) -> str:
    return f"[{r[0]}, {r[1]})"


def format_bytes(n: float) -> str:
    """`n` bytes in B, KiB, MiB or GiB, e.g. "7.5 KiB"."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def print_plan(
    plan: TransferPlan,
    counts: dict[int, tuple[int, int]],
    counted_tokens: int,
    report: VerifyReport | None,
    console: Console | None = None,
) -> None:
    console = console or Console(highlight=False, width=max(Console().width, 110))
    m = plan.model
    console.print(f"[bold]model[/] {m.describe()}")
    console.print(
        f"[bold]prefill[/] {plan.prefill.describe()}  ->  [bold]decode[/] {plan.decode.describe()}"
    )

    dec_blocks = -(-counted_tokens // plan.decode.block_size)
    reads = Table(title="Reads (per request; ranges are half-open, heads global)")
    for col in (
        "decode rank",
        "tp/pp",
        "heads",
        "layers",
        "from prefill rank",
        "bytes/token",
        "runs/block (unmerged)",
    ):
        reads.add_column(col, justify="right")
    for d in plan.decode_workers:
        mine = plan.reads_for(d.rank)
        unmerged, merged = counts.get(d.rank, (0, 0))
        per_block = f"{merged / dec_blocks:.1f} ({unmerged / dec_blocks:.1f})"
        for i, r in enumerate(mine):
            first = i == 0
            reads.add_row(
                str(d.rank) if first else "",
                f"{d.tp_rank}/{d.pp_rank}" if first else "",
                _r(r.kv_heads),
                _r(r.layers),
                str(r.prefill_rank),
                format_bytes(r.bytes_per_token),
                per_block if first else "",
            )
    console.print(reads)

    prod = Table(title="Prefill workers")
    for col in (
        "prefill rank",
        "tp/pp",
        "heads",
        "layers",
        "read by decode ranks",
        "expected notifications",
    ):
        prod.add_column(col, justify="right")
    for w in plan.prefill_workers:
        readers = plan.readers_of(w.rank)
        note = str(plan.expected_notifications[w.rank])
        if not readers:
            note += " (unused replica: free blocks after prefill)"
        prod.add_row(
            str(w.rank),
            f"{w.tp_rank}/{w.pp_rank}",
            _r(w.kv_heads),
            _r(w.layers),
            ", ".join(map(str, readers)) or "-",
            note,
        )
    console.print(prod)

    per_worker = {
        d.rank: sum(r.bytes_per_token for r in plan.reads_for(d.rank)) for d in plan.decode_workers
    }
    console.print(
        f"bytes per token: {format_bytes(plan.bytes_per_token)} read in total, "
        f"{format_bytes(max(per_worker.values()))} by the busiest decode worker"
    )
    if report is not None:
        console.print(
            f"[bold green]verified byte-exact[/]: {report.num_tokens}-token request over "
            f"shuffled, non-contiguous blocks; {format_bytes(report.bytes_copied)} copied in "
            f"{report.descriptors} descriptors ({report.descriptors_unmerged} before merging); "
            "every other byte on the decode workers unchanged"
        )


def print_fan_out(
    plan: TransferPlan,
    fan: TransferPlan,
    num_tokens: int,
    report: VerifyReport | None,
    console: Console | None = None,
) -> None:
    """The bytes over the link and on the decode hosts per token and per request of
    `num_tokens`, for prefill and decode on different hosts: with the fan-out the runtime
    does there by default (each byte over the link once per decode host, then copied on
    the host) and without it (`--kv-fan-out off`: every decode worker reads its bytes)."""
    console = console or Console(highlight=False, width=max(Console().width, 110))
    distinct = plan.model.bytes_per_token
    assert fan.decode_hosts is not None
    num_hosts = len(set(fan.decode_hosts))
    if fan.local_copies:
        copies = Table(
            title=f"Fan-out on {num_hosts} decode host(s) (kvbridge serve's default with "
            "the prefill on another host)"
        )
        for col in ("decode rank", "host", "heads", "layers", "copies from decode rank"):
            copies.add_column(col, justify="right")
        for c in fan.local_copies:
            copies.add_row(
                str(c.decode_rank),
                fan.decode_hosts[c.decode_rank],
                _r(c.kv_heads),
                _r(c.layers),
                str(c.source_rank),
            )
        console.print(copies)
    rows = (
        ("fan-out (default)", fan.link_bytes_per_token, fan.local_bytes_per_token),
        ("--kv-fan-out off", plan.link_bytes_per_token, plan.local_bytes_per_token),
    )
    table = Table(
        title=f"Bytes with prefill and decode on different hosts (distinct KV "
        f"{format_bytes(distinct)}/token; a request of {num_tokens} tokens)"
    )
    for col in ("", "link/token", "x distinct", "local/token", "link/request", "local/request"):
        table.add_column(col, justify="right")
    for name, link, local in rows:
        table.add_row(
            name,
            format_bytes(link),
            f"{link / distinct:.2f}",
            format_bytes(local),
            format_bytes(link * num_tokens),
            format_bytes(local * num_tokens),
        )
    console.print(table)
    if report is not None:
        console.print(
            f"[bold green]fan-out verified byte-exact[/]: {report.num_tokens}-token "
            f"request; {format_bytes(report.link_bytes)} read over the link, "
            f"{format_bytes(report.local_bytes)} copied on the decode hosts"
        )
