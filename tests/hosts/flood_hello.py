"""Run on a test host: as a holder of the deployment's token, send a prefill worker's side
channel COUNT valid Hellos, each in the name of a fresh instance (a key of one's own each
would do as well), over one connection, BATCH at a time; print one JSON line counting the replies by kind
({"welcome": n, "busy": n, ...}) with the first refusal's reason.

    python -m tests.hosts.flood_hello ENDPOINT TOKEN_FILE GGUF PREFIX COUNT

A process of its own in the host's network namespace (ZMQ connects from it)."""

from __future__ import annotations

import collections
import json
import os
import sys
import time
from pathlib import Path

from kvbridge.engine.config import ModelConfig
from kvbridge.plan.layout import InstanceLayout
from kvbridge.plan.model_config import read_config
from kvbridge.transfer.messages import Hello, LayoutWire, ModelWire, Refused, Welcome
from kvbridge.transfer.side_channel import SideChannelClient

#: Hellos sent before reading their replies (a prefill worker serves up to 64 per poll)
BATCH = 64


def main(argv: list[str]) -> int:
    endpoint, token = argv[0], Path(argv[1]).read_bytes().strip()
    model = ModelWire.of(ModelConfig.from_config(read_config(argv[2])).kv_spec("float32"))
    prefix, count = argv[3], int(argv[4])
    layout = LayoutWire.of(InstanceLayout())
    kinds: collections.Counter[str] = collections.Counter()
    first = ""
    client = SideChannelClient(endpoint, token, 1 << 22)
    try:
        for start in range(0, count, BATCH):  # a batch per poll of the prefill worker
            batch = range(start, min(start + BATCH, count))
            for i in batch:
                client.send(Hello(f"{prefix}-{i}", 0, model, layout, os.urandom(16)))
            deadline = time.monotonic() + 60
            for _ in batch:
                reply = None
                while reply is None:
                    assert time.monotonic() < deadline, f"no reply; so far {dict(kinds)}"
                    reply = client.try_recv()
                    if reply is None:
                        time.sleep(0.002)
                if isinstance(reply, Welcome):
                    kinds["welcome"] += 1
                else:
                    assert isinstance(reply, Refused), reply
                    kinds[reply.kind] += 1
                    first = first or reply.reason
    finally:
        client.close()
    print(json.dumps({**kinds, "reason": first}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
