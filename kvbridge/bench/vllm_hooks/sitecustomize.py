"""Hooks `kvbridge bench vllm` puts into the vLLM processes it starts (it puts this
folder on their PYTHONPATH; nothing else imports it). Each is on only where its
environment variable is set.

KVBRIDGE_BENCH_TRACE (a folder): every process appends one line per event of a
request's hand-over to `<folder>/<pid>.trace`, through vLLM's own connector API, the
same for every connector (`kvbridge.bench.vllm_trace` reads them):

    <time.time()> <pid> <event> <request id or -> <seconds the call took or a count>

  arrive   the decode's scheduler received the request (`Scheduler.add_request`)
  matched  the connector said it loads tokens (`get_num_new_matched_tokens`; the count)
  alloc    the scheduler allocated the blocks it loads into (`update_state_after_alloc`)
  done     a worker reported the KV in place (`get_transfer_results`: received)
  known    the scheduler learnt it (`_update_from_kv_xfer_finished`)
  taken    the step that takes the request (`_update_waiting_for_remote_kv`)
  meta / bind / start / save / fin   one call of `build_connector_meta`
           (scheduler) / `bind_connector_metadata`, `start_load_kv`, `wait_for_save`,
           `get_transfer_results` (workers): its seconds

KVBRIDGE_NIXL_PTHR_DELAY_US: NIXL's Python API starts each agent with its progress
thread on and a delay of 0 between polls (`nixl_agent.__init__` sets `pthrDelay = 0`),
and vLLM's NixlConnector takes that default: on a GPU host the thread spins on a core of
its own; on a host with as few cores as vLLM workers it takes one from the engine, steps
slow down, leases expire. With the variable set, every agent made in this process polls
at most once per that many microseconds instead (the agent's own `pthrDelay` setting).
"""

import importlib.abc
import importlib.machinery
import os
import sys
import time

_DELAY_US = os.environ.get("KVBRIDGE_NIXL_PTHR_DELAY_US")
_TRACE_DIR = os.environ.get("KVBRIDGE_BENCH_TRACE")


def _pace(delay_us: int) -> None:
    try:
        from nixl_cu12 import _api
    except ImportError:
        return
    make_agent = _api.nixlBind.nixlAgent

    def paced_agent(name, config):  # type: ignore[no-untyped-def]
        config.pthrDelay = delay_us
        return make_agent(name, config)

    _api.nixlBind.nixlAgent = paced_agent


_out = None


def _emit(event, rid, value=0.0):  # type: ignore[no-untyped-def]
    global _out
    if _out is None:
        assert _TRACE_DIR is not None
        _out = open(os.path.join(_TRACE_DIR, f"{os.getpid()}.trace"), "a", buffering=1)  # noqa: SIM115
    _out.write(f"{time.time():.6f} {os.getpid()} {event} {rid} {value:.6g}\n")


def _timed(obj, name, event, after=None):  # type: ignore[no-untyped-def]
    """Wrap `obj.name`: one `event` line with the call's seconds, then `after(args, out)`."""
    inner = getattr(obj, name)

    def call(*args, **kwargs):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        out = inner(*args, **kwargs)
        if event:
            _emit(event, "-", time.perf_counter() - t0)
        if after is not None:
            after(args, out)
        return out

    setattr(obj, name, call)


def _trace_connector(conn):  # type: ignore[no-untyped-def]
    def matched(args, out):  # type: ignore[no-untyped-def]
        if out and out[0]:
            _emit("matched", args[0].request_id, out[0])

    def alloc(args, out):  # type: ignore[no-untyped-def]
        if args[2] > 0:
            _emit("alloc", args[0].request_id, args[2])

    def done(args, out):  # type: ignore[no-untyped-def]
        for rid in out.finished_recving:
            _emit("done", rid)

    for name, event, after in (
        ("get_num_new_matched_tokens", "", matched),
        ("update_state_after_alloc", "", alloc),
        ("build_connector_meta", "meta", None),
        ("bind_connector_metadata", "bind", None),
        ("start_load_kv", "start", None),
        ("wait_for_save", "save", None),
        ("get_transfer_results", "fin", done),  # get_finished's caller
    ):
        _timed(conn, name, event, after)
    return conn


def _patch_factory(module):  # type: ignore[no-untyped-def]
    factory = module.KVConnectorFactory
    create = factory.create_connector

    def create_connector(*args, **kwargs):  # type: ignore[no-untyped-def]
        return _trace_connector(create(*args, **kwargs))

    factory.create_connector = staticmethod(create_connector)


def _patch_scheduler(module):  # type: ignore[no-untyped-def]
    sched = module.Scheduler

    def arrive(args, out):  # type: ignore[no-untyped-def]
        _emit("arrive", args[1].request_id)

    def known(args, out):  # type: ignore[no-untyped-def]
        for rid in args[1].finished_recving or ():
            _emit("known", rid)

    def taken(args, out):  # type: ignore[no-untyped-def]
        _emit("taken", args[1].request_id)

    _timed(sched, "add_request", "", arrive)
    _timed(sched, "_update_from_kv_xfer_finished", "", known)
    _timed(sched, "_update_waiting_for_remote_kv", "", taken)


_PATCHES = {
    "vllm.distributed.kv_transfer.kv_connector.factory": _patch_factory,
    "vllm.v1.core.sched.scheduler": _patch_scheduler,
}


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches each module of `_PATCHES` right after it is first executed."""

    def find_spec(self, fullname, path, target=None):  # type: ignore[no-untyped-def]
        patch = _PATCHES.get(fullname)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):  # type: ignore[no-untyped-def]
            exec_module(module)
            patch(module)

        spec.loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


if _DELAY_US:
    _pace(int(_DELAY_US))
if _TRACE_DIR:
    sys.meta_path.insert(0, _PatchOnImport())
