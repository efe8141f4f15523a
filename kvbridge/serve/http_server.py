"""Run an ASGI app under uvicorn in a background thread (tests, demo, one-process serve)."""

from __future__ import annotations

import threading
import time
from typing import Any

import uvicorn

from kvbridge.errors import KVBridgeError


class ServerThread:
    """A uvicorn server on `host:port` (port 0 picks a free one) in a daemon thread.

    `start()` returns once the socket listens (or raises within `timeout`); `stop()`
    shuts it down and joins the thread.
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0) -> None:
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)
        self.host = host
        self.port = port

    def start(self, timeout: float = 30.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive():
                raise KVBridgeError(f"HTTP server on {self.host}:{self.port} failed to start")
            if time.monotonic() > deadline:
                raise KVBridgeError(
                    f"HTTP server on {self.host}:{self.port} did not start within {timeout:.0f} s"
                )
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
