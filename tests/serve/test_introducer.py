"""The proxy's introducer over scripted instances (the end-to-end check with real
instances started after the proxy is in test_introduction.py): whatever the order the
instances come up in, every decode instance is introduced to every prefill instance,
again after a restart or an outage, and tries again with backoff until its workers
have met the peer."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import httpx

from kvbridge.serve.introducer import Introducer

P, D = "http://prefill", "http://decode"


class Instances:
    """Scripted /internal/info and /internal/connect answers."""

    def __init__(self) -> None:
        self.info: dict[str, dict[str, object] | None] = {P: None, D: None}  # None: down
        self.met: set[tuple[str, str]] = set()  # (decode id, prefill id) met
        self.connects: list[Mapping[str, object]] = []
        self.meet_after = 0  # how many calls a handshake takes

    async def probe(self, url: str) -> Mapping[str, object] | str:
        answer = self.info[url]
        return answer if answer is not None else "unreachable: ConnectError()"

    async def connect(self, url: str, body: Mapping[str, object]) -> httpx.Response:
        answer = self.info[url]
        if answer is None:
            raise httpx.ConnectError("refused")
        self.connects.append(body)
        did = str(answer["instance_id"])
        connected = []
        for endpoint, pid in zip(body["endpoints"], body["instance_ids"], strict=True):  # type: ignore[call-overload]
            if (did, pid) in self.met:
                connected.append(endpoint)
            elif self.meet_after <= 0:
                self.met.add((did, pid))  # met by the time it is asked again
            else:
                self.meet_after -= 1
        return httpx.Response(200, json={"connecting": body["endpoints"], "connected": connected})


def _run(inst: Instances, steps: list[object], **kw: float) -> Introducer:
    """Run the introducer's rounds; a callable in `steps` changes the instances."""

    async def main() -> Introducer:
        intro = Introducer([P], [D], inst.probe, inst.connect, **kw)
        for step in steps:
            if callable(step):
                step()
            else:
                await intro.step()
                await asyncio.sleep(float(step))  # type: ignore[arg-type]
        return intro

    return asyncio.run(main())


def _up(inst: Instances, url: str, iid: str) -> None:
    endpoint = "tcp://127.0.0.1:5600" if url == P else ""
    inst.info[url] = {"instance_id": iid, "endpoint": endpoint}


def test_instances_that_come_up_after_the_proxy_are_introduced():
    inst = Instances()
    fast = dict(probe_s=0.0, retry_s=0.0, refresh_s=60.0)
    intro = _run(inst, [0, 0], **fast)
    assert intro.snapshot()[D][P].startswith("waiting")
    assert not inst.connects  # nobody is up: nobody is called
    intro = _run(
        inst,
        [0, lambda: _up(inst, P, "p1"), 0, lambda: _up(inst, D, "d1"), 0, 0],
        **fast,
    )
    assert intro.snapshot()[D][P] == "connected"
    assert inst.connects[-1] == {"endpoints": ["tcp://127.0.0.1:5600"], "instance_ids": ["p1"]}
    assert intro.instance_id(D) == "d1"


def test_an_introduction_is_asked_about_again_with_backoff_until_met():
    inst = Instances()
    _up(inst, P, "p1")
    _up(inst, D, "d1")
    inst.meet_after = 3  # the handshake takes a while
    intro = _run(inst, [0.01] * 8, probe_s=0.0, retry_s=0.001, max_retry_s=0.004, refresh_s=60.0)
    assert intro.snapshot()[D][P] == "connected"
    # a pair not met yet is not asked about on every round, but after its backoff
    slow = Instances()
    _up(slow, P, "p1")
    _up(slow, D, "d1")
    slow.meet_after = 100
    intro = _run(slow, [0.0] * 5, probe_s=0.0, retry_s=10.0)
    assert len(slow.connects) == 1
    assert intro.snapshot()[D][P] == "pending: the decode workers have not all met it yet"


def test_a_restarted_prefill_instance_is_introduced_again_under_its_new_id():
    inst = Instances()
    _up(inst, P, "p1")
    _up(inst, D, "d1")
    fast = dict(probe_s=0.0, retry_s=0.0, refresh_s=60.0)
    intro = _run(
        inst,
        [0, 0, lambda: _up(inst, P, "p2"), 0, 0],
        **fast,
    )
    assert intro.snapshot()[D][P] == "connected"
    assert ("d1", "p2") in inst.met
    assert inst.connects[-1]["instance_ids"] == ["p2"]


def test_an_instance_back_after_an_outage_is_introduced_again():
    inst = Instances()
    _up(inst, P, "p1")
    _up(inst, D, "d1")
    fast = dict(probe_s=0.0, retry_s=0.0, refresh_s=60.0)

    def outage() -> None:
        inst.info[D] = None
        inst.met.clear()  # the decode instance forgot its peers meanwhile

    intro = _run(inst, [0, 0, outage, 0], **fast)
    snap = intro.snapshot()[D][P]
    assert snap.startswith("waiting") and "unreachable" in snap
    calls = len(inst.connects)
    intro = _run(inst, [0, 0, outage, 0, lambda: _up(inst, D, "d1"), 0, 0], **fast)
    assert intro.snapshot()[D][P] == "connected"
    assert len(inst.connects) > calls


def test_a_decode_instance_without_a_connector_is_not_asked_again_and_again():
    async def no_connector(url: str, body: Mapping[str, object]) -> httpx.Response:
        calls.append(url)
        return httpx.Response(404, json={"error": {"message": "only a decode instance ..."}})

    calls: list[str] = []
    inst = Instances()
    _up(inst, P, "p1")
    _up(inst, D, "d1")

    async def main() -> str:
        intro = Introducer([P], [D], inst.probe, no_connector, probe_s=0.0, retry_s=0.0)
        for _ in range(5):
            await intro.step()
        return intro.snapshot()[D][P]

    assert asyncio.run(main()).startswith("unsupported")
    assert len(calls) == 1


def test_close_stops_the_background_task():
    inst = Instances()

    async def main() -> bool:
        intro = Introducer([P], [D], inst.probe, inst.connect, probe_s=0.01)
        intro.start()
        await asyncio.sleep(0.05)
        task = intro._task
        await intro.close()
        return task is not None and task.done()

    assert asyncio.run(main())


def _waited(inst: Instances, *waits: tuple[str, str, float], **kw: float) -> list[str]:
    """Run the introducer's background task; each of `waits` (decode id, prefill id,
    timeout) is one request's `wait_met` after the one before; their answers. Probes
    and retries are slow (`kw` may say otherwise): only a waiting request speeds them."""

    async def main() -> list[str]:
        kw.setdefault("probe_s", 60.0)
        kw.setdefault("retry_s", 60.0)
        intro = Introducer([P], [D], inst.probe, inst.connect, **kw)
        intro.start()
        try:
            return [await intro.wait_met(D, P, d, p, t) for d, p, t in waits]
        finally:
            await intro.close()

    return asyncio.run(main())


def test_a_request_waits_for_its_pairs_introduction_in_flight():
    """The first request comes while the decode workers are still meeting the prefill
    instance (asked again only after a minute here): it waits until they have, asked
    about every WAITED_RETRY_S meanwhile, rather than pulling over cold paths."""
    inst = Instances()
    _up(inst, P, "p1")
    _up(inst, D, "d1")
    inst.meet_after = 3
    assert _waited(inst, ("d1", "p1", 30.0)) == ["connected"]
    assert len(inst.connects) == 5  # not met, 3 times not yet, then met


def test_a_request_to_a_restarted_prefill_instance_waits_for_its_new_introduction():
    """The pair met under the prefill's old id; a request's prefill came from the
    instance restarted (a new id) before the next probe (a minute away): the request
    has it probed at once and waits until the decode instance has met the new one."""
    inst = Instances()
    _up(inst, P, "p1")
    _up(inst, D, "d1")
    got = asyncio.run(_restart(inst))
    assert got == "connected" and ("d1", "p2") in inst.met
    assert inst.connects[-1]["instance_ids"] == ["p2"]


async def _restart(inst: Instances) -> str:
    intro = Introducer([P], [D], inst.probe, inst.connect, probe_s=60.0, retry_s=60.0)
    intro.start()
    try:
        assert await intro.wait_met(D, P, "d1", "p1", 30.0) == "connected"
        _up(inst, P, "p2")
        return await intro.wait_met(D, P, "d1", "p2", 30.0)
    finally:
        await intro.close()


def test_a_pair_a_request_waited_for_in_vain_is_not_waited_for_again():
    """A decode instance that never meets the prefill instance (here it always says not
    yet) holds one request up to the bound; the next request for the same pair goes on
    at once (it handshakes on its own, as it always could)."""
    inst = Instances()
    _up(inst, P, "p1")
    _up(inst, D, "d1")
    inst.meet_after = 10**9

    async def main() -> tuple[str, int, str, int]:
        intro = Introducer([P], [D], inst.probe, inst.connect, probe_s=60.0, retry_s=60.0)
        intro.start()
        try:
            first = await intro.wait_met(D, P, "d1", "p1", 0.3)
            calls = len(inst.connects)
            second = await intro.wait_met(D, P, "d1", "p1", 30.0)
            return first, calls, second, len(inst.connects)
        finally:
            await intro.close()

    first, calls, second, after = asyncio.run(main())
    assert first.startswith("pending") and second == first
    assert calls >= 2  # asked again while the first request waited
    assert after == calls  # the second one did not wait for another round
