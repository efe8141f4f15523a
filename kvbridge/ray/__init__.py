"""kvbridge under Ray Serve LLM: vLLM's P/D deployed by Ray, KVBridgeConnector moving the KV.

A launcher beside `kvbridge.vllm.launch`, not part of the connector: Ray places and
restarts the vLLM engines, the connector in each engine is the one `kvbridge.vllm` ships.

- `app.py`: the application as plain dicts (`pd_serving_args`, what
  `ray.serve.llm.build_pd_openai_app` takes): two `LLMConfig`s pinned to nodes by custom
  resources, `kv_transfer_config` selecting KVBridgeConnector, secrets as file paths only.
- `enrollment.py`: role credentials for replicas Ray starts (a pool enrolled ahead of
  time by the holder of the root key, each credential claimed by one replica once).
- `backend.py`: the connector backend Ray runs in each replica before vLLM starts
  (`KVConnectorBackendFactory`): it binds the side channel to the node's address and
  claims the replica's credential.
- `deploy.py`: the Ray driver (`python -m kvbridge.ray.deploy APP.json`).
- `cluster.py`: a Ray cluster over three test hosts running the application
  (`make demo-ray`, `demo.py`; `make test-ray`, tests/ray/test_cluster.py).

docs/ray.md says how to deploy it on a real cluster and what was verified here.
"""
