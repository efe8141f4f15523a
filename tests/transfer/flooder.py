"""A token holder's handshake flood from one network address, as a process of its own.

    python -m tests.transfer.flooder ENDPOINT SOURCE MIN_COUNT MAX_COUNT MAX_S  (token: stdin)

Reads the deployment's token (hex) from its first line of stdin, then sends the prefill
worker's side channel valid Hellos from loopback address SOURCE (ZMQ's
``tcp://SOURCE:0;HOST:PORT``) in batches of `BATCH`, each batch over a new connection
with a fresh key of its own, every other Hello in an id bound to that key, the others
unbound. The Hellos' model and layout (`ModelWire`, `LayoutWire`, JSON) come in the
environment (FLOOD_MODEL, FLOOD_LAYOUT). Prints one JSON line ``{"full": T}`` at its
first "busy" refusal, then floods on until stdin says ``stop`` (having sent at least
MIN_COUNT), or MAX_COUNT were sent, or MAX_S seconds passed; then prints one JSON line of
what it saw (T: `time.monotonic()`, comparable between processes of one machine):

    {"sent": n, "replies": {"welcome": n, "busy": n, ...}, "unanswered": n,
     "first_busy_at": T, "last_reply_at": T, "max_wait_s": s, "reasons": [...]}
"""

from __future__ import annotations

import collections
import json
import os
import select
import sys
import time

import msgspec

from kvbridge.transfer.identity import Identity
from kvbridge.transfer.messages import Hello, LayoutWire, ModelWire, Refused, Welcome
from kvbridge.transfer.side_channel import SideChannelClient

#: Hellos per connection (and key): a prefill worker serves up to 64 messages per poll
BATCH = 16
#: How long one Hello may wait for its reply before it counts as unanswered (seconds)
REPLY_TIMEOUT_S = 30.0


def _told_to_stop() -> bool:
    ready, _, _ = select.select([sys.stdin], [], [], 0)
    return bool(ready) and sys.stdin.readline().strip() in ("stop", "")


def main(argv: list[str]) -> int:
    endpoint, source = argv[0], argv[1]
    min_count, max_count, max_s = int(argv[2]), int(argv[3]), float(argv[4])
    token = bytes.fromhex(sys.stdin.readline().strip())
    model = msgspec.json.decode(os.environ["FLOOD_MODEL"], type=ModelWire)
    layout = msgspec.json.decode(os.environ["FLOOD_LAYOUT"], type=LayoutWire)
    target = endpoint.replace("tcp://", f"tcp://{source}:0;")
    kinds: collections.Counter[str] = collections.Counter()
    reasons: dict[str, str] = {}  # the first reason of each kind of refusal
    sent = unanswered = 0
    first_busy_at = last_reply_at = max_wait = 0.0
    stop, deadline = False, time.monotonic() + max_s
    while sent < max_count and time.monotonic() < deadline and not (stop and sent >= min_count):
        key = Identity.generate()
        client = SideChannelClient(target, token, 1 << 24, identity=key)
        try:
            asked: dict[bytes, float] = {}
            for i in range(sent, min(sent + BATCH, max_count)):
                iid = key.bind(f"flood-{source}-{i}") if i % 2 else f"flood-{source}-{i}"
                nonce = os.urandom(16)
                client.send(Hello(iid, 0, model, layout, nonce))
                asked[nonce] = time.monotonic()
            sent += len(asked)
            wait_until = time.monotonic() + REPLY_TIMEOUT_S
            while asked and time.monotonic() < wait_until:
                reply = client.try_recv()
                if reply is None:
                    time.sleep(0.001)
                    continue
                now = time.monotonic()
                if isinstance(reply, Welcome):
                    kind, nonce = "welcome", reply.hello_nonce
                else:  # a Refused names no Hello: it answers the oldest one asked
                    assert isinstance(reply, Refused), reply
                    kind, nonce = reply.kind, next(iter(asked))
                    reasons.setdefault(kind, reply.reason)
                    if kind == "busy" and not first_busy_at:
                        first_busy_at = now
                        print(json.dumps({"full": now}), flush=True)
                max_wait = max(max_wait, now - asked.pop(nonce))
                kinds[kind] += 1
                last_reply_at = now
            unanswered += len(asked)
        finally:
            client.close()
        stop = stop or _told_to_stop()
    report = {
        "sent": sent,
        "replies": dict(kinds),
        "unanswered": unanswered,
        "first_busy_at": first_busy_at,
        "last_reply_at": last_reply_at,
        "max_wait_s": max_wait,
        "reasons": sorted(reasons.values()),
    }
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
