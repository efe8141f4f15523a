"""Run on a test host: send a prefill worker's side channel a Hello in each given
instance's name, as a holder of the deployment's token would, and print each reply as
one JSON line ({"kind": ..., "reason": ...}; kind "welcome" for a Welcome).

    python -m tests.hosts.claim_hello ENDPOINT TOKEN_FILE INSTANCE_ID...

A process of its own, started inside the host's network namespace: ZMQ's I/O thread
connects from the namespace its process made it in."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from kvbridge.transfer.messages import Hello, LayoutWire, ModelWire, Refused, Welcome
from kvbridge.transfer.side_channel import SideChannelClient
from tests.transfer.fakes import DECODE, MODEL


def main(argv: list[str]) -> int:
    endpoint, token = argv[0], Path(argv[1]).read_bytes().strip()
    for claimed in argv[2:]:
        hello = Hello(claimed, 0, ModelWire.of(MODEL), LayoutWire.of(DECODE), os.urandom(16))
        client = SideChannelClient(endpoint, token, 1 << 22)  # an ephemeral key of its own
        try:
            reply = client.call(hello, timeout_s=30)
        finally:
            client.close()
        if isinstance(reply, Welcome):
            print(json.dumps({"kind": "welcome", "reason": ""}), flush=True)
        else:
            assert isinstance(reply, Refused), reply
            print(json.dumps({"kind": reply.kind, "reason": reply.reason}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
