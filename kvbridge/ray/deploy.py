"""The Ray driver: deploy the P/D application on a running Ray cluster.

    python -m kvbridge.ray.deploy APP.json --address HEAD:6379 [--num-nodes N]

APP.json is `{"serving_args": pd_serving_args(cfg), "name": ..., "http_port": ...}`
(`app.py`). The driver waits until the cluster has `--num-nodes` nodes, registers the
connector backend (`backend.register`), starts Serve's HTTP proxy on the head node on
every interface of it, deploys the application and returns once Serve reports it
running (Serve keeps it after the driver exits). It holds no secret: the application
names files.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def wait_for_nodes(num_nodes: int, timeout_s: float) -> None:
    import ray

    deadline = time.monotonic() + timeout_s
    while (alive := sum(n["Alive"] for n in ray.nodes())) < num_nodes:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{alive} of {num_nodes} Ray nodes joined in {timeout_s:.0f} s")
        time.sleep(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvbridge.ray.deploy")
    parser.add_argument("app", type=Path, help="the application document (JSON)")
    parser.add_argument("--address", required=True, help="the Ray head's HOST:PORT")
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--nodes-timeout-s", type=float, default=120)
    args = parser.parse_args(argv)
    doc = json.loads(args.app.read_text())

    import ray
    from ray import serve
    from ray.serve.llm import build_pd_openai_app

    from kvbridge.ray.backend import register

    ray.init(address=args.address, logging_level="WARNING")
    wait_for_nodes(args.num_nodes, args.nodes_timeout_s)
    register()
    serve.start(
        proxy_location="HeadOnly", http_options={"host": "0.0.0.0", "port": doc["http_port"]}
    )
    started = time.monotonic()
    serve.run(build_pd_openai_app(doc["serving_args"]), name=doc["name"], route_prefix="/")
    print(f"deployed {doc['name']!r} in {time.monotonic() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
