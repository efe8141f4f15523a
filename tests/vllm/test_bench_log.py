"""`kvbridge bench vllm`: why a setup failed, from the instance's log (the exception
that ended its last traceback, not the last line that mentions an error); the same span
for every connector from its hooks' trace; the rows, their ratios and their JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kvbridge.bench.client import Streamed
from kvbridge.bench.vllm import HOOKS_DIR, last_error, num_requests
from kvbridge.bench.vllm_report import Connector, Phase, Setup, pull_lines, rows_json, rows_of
from kvbridge.bench.vllm_trace import parse_line, pull_timelines, read_traces, step_costs
from kvbridge.transfer.pull import PullPhases

# the shape of vLLM 0.32's log when NixlConnector refuses prefill tp 2 -> decode tp 1
# with one KV head (measured 2026-12-04, `kvbridge bench vllm --model tiny-kv1 --pairs 2:1`)
NIXL_LOG = """\
(Worker pid=19518) INFO 12-04 16:40:00 [base_worker.py:2255] Transfer plan: TransferTopology(tp_ratio=-2)
(Worker pid=19518) ERROR 12-04 16:40:00 [base_worker.py:1318] NIXL transfer failure: handshake_setup_failed
(Worker pid=19518) ERROR 12-04 16:40:00 [base_worker.py:1318] Traceback (most recent call last):
(Worker pid=19518) ERROR 12-04 16:40:00 [base_worker.py:1318]   File "base_worker.py", line 2302, in add_remote_agent
(Worker pid=19518) ERROR 12-04 16:40:00 [base_worker.py:1318]     self._validate_remote_agent_handshake(
(Worker pid=19518) ERROR 12-04 16:40:00 [base_worker.py:1318]   File "base_worker.py", line 2450, in _validate_remote_agent_handshake
(Worker pid=19518) ERROR 12-04 16:40:00 [base_worker.py:1318]     tp_ratio < 0 and self.transfer_topo.is_kv_replicated(remote_engine_id)
(Worker pid=19518) ERROR 12-04 16:40:00 [base_worker.py:1318]     ^^^^^^^^^^^^
(Worker pid=19518) ERROR 12-04 16:40:00 [base_worker.py:1318] AssertionError
(APIServer pid=19473) ERROR 12-04 16:40:00 [serving.py:203] Request cmpl-b40d failed with an internal error during generation
"""


def test_a_bare_assert_is_named_with_the_line_that_raised_it() -> None:
    assert last_error(NIXL_LOG) == (
        "AssertionError at `tp_ratio < 0 and self.transfer_topo.is_kv_replicated(remote_engine_id)`"
    )


def test_an_exception_with_a_message_is_given_as_it_is() -> None:
    log = NIXL_LOG.replace("] AssertionError", "] RuntimeError: the handshake timed out")
    assert last_error(log) == "RuntimeError: the handshake timed out"


def test_without_a_traceback_the_last_error_line_or_the_last_line() -> None:
    assert last_error("starting\nERROR: port in use\nbye\n") == "ERROR: port in use"
    assert last_error("starting\nbye\n") == "bye"
    assert last_error("") == "(empty log)"


# -- the same span for every connector: the hooks' trace and what the bench makes of it --

# one decode instance of tp 2: request r1 pulled (two workers report it), r2 colocated
# (no pull), r0 before the window; a line cut short at the end
TRACE = """\
100.000 10 arrive r0 0
100.500 10 arrive r1 0
100.510 10 alloc r1 288
100.511 10 meta - 0.0002
100.512 11 start - 0.001
100.513 12 start - 0.003
100.540 11 done r1 0
100.550 12 done r1 0
100.551 11 fin - 0.0001
100.552 12 fin - 0.0003
100.560 10 known r1 0
100.600 10 taken r1 0
100.700 10 arrive r2 0
100.80
"""


def _traced(tmp_path: Path) -> Path:
    (tmp_path / "10.trace").write_text(TRACE)
    return tmp_path


def test_a_pull_is_timed_from_its_arrival_to_its_last_workers_report(tmp_path: Path) -> None:
    events = read_traces(_traced(tmp_path))
    assert [ev.event for ev in events][:3] == ["arrive", "arrive", "alloc"]
    (pull,) = pull_timelines(events, since=100.1, until=101.0)
    assert pull.request_id == "r1" and pull.num_done == 2
    assert round(pull.transfer_s, 6) == 0.05  # 100.500 -> 100.550 (the second worker)
    assert round(pull.order_s, 6) == 0.01
    assert round(pull.pull_s, 6) == 0.04
    assert round(pull.report_s, 6) == 0.01
    assert round(pull.take_s, 6) == 0.04


# r3 loads in step on both workers of a tp 2 decode: allocated, never reported; its KV
# is in place when both workers' start_load_kv of that step returned
IN_STEP = """\
200.000 10 arrive r3 0
199.990 11 start - 0.0001
199.991 12 start - 0.0001
200.010 10 alloc r3 287
200.013 10 meta - 0.0002
200.030 11 bind - 0.02
200.031 11 start - 0.0
200.035 12 bind - 0.025
200.036 12 start - 0.0
"""


def test_an_in_step_pull_is_in_place_when_every_worker_started_its_step(tmp_path: Path) -> None:
    (tmp_path / "10.trace").write_text(IN_STEP)
    (pull,) = pull_timelines(read_traces(tmp_path), 199.0, 201.0)
    assert pull.in_step and pull.num_done == 2
    # each worker's first start_load_kv that returned after the allocation (200.031,
    # 200.036; not the step's before it), the later of the two
    assert round(pull.done - 200.036, 6) == 0 and pull.known == pull.taken == pull.done
    assert round(pull.transfer_s, 6) == 0.036 and round(pull.pull_s, 6) == 0.026
    assert (pull.report_s, pull.take_s) == (0.0, 0.0)


def test_a_cut_or_foreign_line_is_no_event() -> None:
    assert parse_line("100.80") is None
    assert parse_line("x 1 arrive r 0") is None
    assert parse_line("1.5 2 taken r9 0") is not None


def test_step_costs_are_medians_per_call(tmp_path: Path) -> None:
    costs = step_costs(read_traces(_traced(tmp_path)), 100.0, 101.0)
    assert {k: round(v, 6) for k, v in costs.items()} == {
        "meta": 0.0002,
        "bind": 0.0,  # none traced
        "start": 0.002,  # the median of the two workers' calls
        "save": 0.0,  # none traced
        "fin": 0.0002,
    }


def test_requests_come_in_whole_rounds() -> None:
    assert [num_requests(8, c) for c in (1, 4, 8, 3)] == [8, 8, 8, 9]
    assert num_requests(2, 8) == 8


def _phase(ttft_ms: float, tpot_ms: float, texts: list[str]) -> Phase:
    streams = [Streamed(ttft_ms / 1e3, tpot_ms / 1e3, t) for t in texts]
    return Phase(streams, 100.1, 101.0)


def test_rows_give_ratios_to_colocated_and_json_names_every_field(tmp_path: Path) -> None:
    coloc = Setup(Connector.COLOCATED, phases={1: _phase(40, 10, ["a"])})
    coloc.idle_cpu = {"decode": 0.4}
    kv = Setup(Connector.KVBRIDGE, phases={1: _phase(60, 10.5, ["a"])})
    kv.phases[1].own_count, kv.phases[1].own_sum_s = 2.0, 0.04
    kv.trace = read_traces(_traced(tmp_path))
    nixl = Setup(Connector.NIXL, failure="the decode instance answered 500")
    rows = rows_of("1->2", coloc, [kv, nixl])
    assert [(r.connector, r.concurrency) for r in rows] == [
        ("colocated", 1),
        ("kvbridge", 1),
        ("nixl", 1),
    ]
    base, ours, theirs = rows
    assert (base.ttft_ratio, base.tpot_ratio, base.idle_cpu_pct) == (1.0, 1.0, 0.4)
    assert round(ours.ttft_ratio, 6) == 1.5 and round(ours.tpot_ratio, 6) == 1.05
    assert round(ours.transfer_ms, 3) == 50.0 and ours.token_exact is True
    assert ours.pulls_per_request == 2.0 and round(ours.own_transfer_ms, 3) == 20.0
    assert ours.steps_ms == {"order": 10.0, "pull": 40.0, "report": 10.0, "take": 40.0}
    assert theirs.failure == "the decode instance answered 500" and theirs.ttft_ms != theirs.ttft_ms
    decoded = json.loads(rows_json(rows))
    assert {"pair", "concurrency", "connector", "transfer_ms", "ttft_ms", "tpot_ms"} <= set(
        decoded[1]
    )
    assert {"ttft_ratio", "tpot_ratio"} <= set(decoded[1])
    assert decoded[1]["pair"] == "1->2" and decoded[1]["connector"] == "kvbridge"
    assert decoded[0]["transfer_ms"] is None  # colocated: nothing pulled
    assert decoded[2]["ttft_ms"] is None  # NaN is not JSON


def test_tokens_that_differ_from_colocated_are_named(tmp_path: Path) -> None:
    coloc = Setup(Connector.COLOCATED, phases={1: _phase(40, 10, ["a b"])})
    kv = Setup(Connector.KVBRIDGE, phases={1: _phase(60, 10, ["a c"])})
    kv.trace = read_traces(_traced(tmp_path))
    row = rows_of("1->1", coloc, [kv])[1]
    assert row.token_exact is False and row.mismatches == ["'a c' != colocated 'a b'"]


# a stand-in for the two vLLM modules the hooks patch, to see the patch-on-import and
# the lines they write (the bench's runs use the real ones)
FAKE_SCHEDULER = """
class Scheduler:
    def add_request(self, request): pass
    def _update_from_kv_xfer_finished(self, output): pass
    def _update_waiting_for_remote_kv(self, request): pass
"""
FAKE_FACTORY = """
class KVConnectorFactory:
    @classmethod
    def create_connector(cls, config, role, kv_cache_config):
        from types import SimpleNamespace as NS
        return NS(
            get_num_new_matched_tokens=lambda request, n: (96, True),
            update_state_after_alloc=lambda request, blocks, n: None,
            build_connector_meta=lambda out: "meta",
            bind_connector_metadata=lambda meta: None,
            start_load_kv=lambda ctx: None,
            wait_for_save=lambda: None,
            get_transfer_results=lambda ids: NS(finished_recving={"r1"}),
        )
"""
DRIVE = """
from types import SimpleNamespace as NS
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.v1.core.sched.scheduler import Scheduler
r = NS(request_id="r1")
s = Scheduler()
s.add_request(r)
c = KVConnectorFactory.create_connector(None, None, None)
assert c.get_num_new_matched_tokens(r, 0) == (96, True)
c.update_state_after_alloc(r, [], 96)
assert c.build_connector_meta(None) == "meta"
c.bind_connector_metadata("meta")
c.start_load_kv(None)
c.wait_for_save()
c.get_transfer_results(set())
s._update_from_kv_xfer_finished(NS(finished_recving={"r1"}))
s._update_waiting_for_remote_kv(r)
"""


def test_the_hooks_trace_vllms_connector_api_in_a_process_they_start_in(tmp_path: Path) -> None:
    for rel, text in (
        ("vllm/v1/core/sched/scheduler.py", FAKE_SCHEDULER),
        ("vllm/distributed/kv_transfer/kv_connector/factory.py", FAKE_FACTORY),
    ):
        path = tmp_path / "site" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        for folder in path.relative_to(tmp_path / "site").parents:  # packages of their own,
            (tmp_path / "site" / folder / "__init__.py").touch()  # where vLLM is installed
    trace = tmp_path / "trace"
    trace.mkdir()
    env = {
        **os.environ,
        "PYTHONPATH": f"{HOOKS_DIR}:{tmp_path / 'site'}",
        "KVBRIDGE_BENCH_TRACE": str(trace),
    }
    subprocess.run([sys.executable, "-c", DRIVE], env=env, check=True, timeout=60)
    events = read_traces(trace)
    assert [(ev.event, ev.request_id) for ev in events] == [
        ("arrive", "r1"),
        ("matched", "r1"),
        ("alloc", "r1"),
        ("meta", "-"),
        ("bind", "-"),
        ("start", "-"),
        ("save", "-"),
        ("fin", "-"),
        ("done", "r1"),
        ("known", "r1"),
        ("taken", "r1"),
    ]
    assert events[1].value == 96 and events[2].value == 96
    (pull,) = pull_timelines(events, 0.0, float("inf"))
    assert pull.num_done == 1 and pull.transfer_s >= 0


# a KVBridgeConnector decode worker's pull, as `RoleWorkers` logs it in vLLM's log
PULL_LOG = (
    "(Worker pid=29474) INFO 12-07 03:06:29 [roles.py:219] kvbridge decode worker 1 pulled "
    "r1: tokens [0, 208), 9584640 bytes (+0 copied from a sibling) in 23.1 ms, "
    "60 descriptors, phases ms 0.50/2.00/15.00/0.00/5.60/0.00\n"
    "(Worker pid=29475) INFO 12-07 03:06:29 [roles.py:219] kvbridge decode worker 0 pulled "
    "r1: tokens [0, 208), 9584640 bytes (+0 copied from a sibling) in 21.0 ms, "
    "40 descriptors, phases ms 0.30/1.00/13.00/0.00/6.60/0.40\n"
)


def test_kvbridge_pulls_give_their_descriptors_and_phases(tmp_path: Path) -> None:
    logged = pull_lines(PULL_LOG)
    assert logged == {
        "r1": [(60, (0.5, 2.0, 15.0, 0.0, 5.6, 0.0)), (40, (0.3, 1.0, 13.0, 0.0, 6.6, 0.4))]
    }
    coloc = Setup(Connector.COLOCATED, phases={1: _phase(40, 10, ["a"])})
    kv = Setup(Connector.KVBRIDGE, phases={1: _phase(60, 10, ["a"])}, pulls=logged)
    kv.trace = read_traces(_traced(tmp_path))
    row = rows_of("1->2", coloc, [kv])[1]
    assert row.descriptors_per_pull == 50  # the median over the workers
    assert row.pull_phases_ms == {
        "queued": 0.4,
        "post": 1.5,
        "read": 14.0,
        "digest": 0.0,
        "confirm": 6.1,
        "cast": 0.2,
    }


def test_a_pulls_phases_are_logged_in_their_order() -> None:
    phases = PullPhases(
        queued_s=0.001, post_s=0.002, read_s=0.003, digest_s=0, confirm_s=0.0045, cast_s=0.0005
    )
    assert phases.ms == (1.0, 2.0, 3.0, 0.0, 4.5, 0.5)
