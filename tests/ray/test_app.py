"""The Ray Serve LLM application as plain dicts (`kvbridge.ray.app`) and the credential
pool its replicas claim from (`kvbridge.ray.enrollment`): no Ray needed."""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import threading
from pathlib import Path

import pytest

from kvbridge.connector import Credential, RootKey
from kvbridge.errors import ConfigError
from kvbridge.ray.app import POOL_KEY, Deployment, RayPDConfig, Side, pd_serving_args
from kvbridge.ray.enrollment import claim, claims, enroll_pool
from kvbridge.transfer.connector import ConnectorRole
from kvbridge.vllm.launch import LOADED_HOST_SETTINGS

TOKEN = "5f" * 32


@pytest.fixture
def deployment(tmp_path: Path) -> tuple[RayPDConfig, Path, list[Path]]:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    root = RootKey.generate()
    prefill = enroll_pool(root, "kv_producer", "prefill", 2, tmp_path / "pool-prefill")
    decode = enroll_pool(root, "kv_consumer", "decode", 2, tmp_path / "pool-decode")
    cfg = RayPDConfig(
        model="/models/smollm2",
        prefill=Deployment(1, "prefill_node", str(prefill)),
        decode=Deployment(3, "decode_node", str(decode), num_replicas=2),
        token_file=str(token_file),
        ingress_resource="head_node",
    )
    return cfg, tmp_path, sorted(prefill.glob("*.credential")) + sorted(decode.glob("*.credential"))


def test_each_deployment_is_pinned_to_its_nodes_on_cpu(deployment: tuple) -> None:
    cfg, _, _ = deployment
    args = pd_serving_args(cfg)
    for key, tp, resource, replicas in (
        ("prefill_config", 1, "prefill_node", 1),
        ("decode_config", 3, "decode_node", 2),
    ):
        llm = args[key]
        assert llm["accelerator_config"] == {"kind": "cpu"}
        assert llm["engine_kwargs"]["tensor_parallel_size"] == tp
        # every worker's bundle asks for the node resource: the whole replica on one node
        assert llm["placement_group_config"] == {
            "bundle_per_worker": {"CPU": 1, resource: 1},
            "strategy": "STRICT_PACK",
        }
        assert llm["deployment_config"] == {"num_replicas": replicas}
        assert llm["model_loading_config"] == {
            "model_id": "smollm2",
            "model_source": "/models/smollm2",
        }
    ingress = args["ingress_deployment_config"]["ray_actor_options"]
    assert ingress["resources"] == {"head_node": 1}


def test_the_connector_is_selected_with_each_sides_role(deployment: tuple) -> None:
    cfg, _, _ = deployment
    args = pd_serving_args(cfg)
    for key, kv_role, side in (
        ("prefill_config", "kv_producer", Side.PREFILL),
        ("decode_config", "kv_consumer", Side.DECODE),
    ):
        kv = args[key]["engine_kwargs"]["kv_transfer_config"]
        assert kv["kv_connector"] == "KVBridgeConnector"
        assert kv["kv_connector_module_path"] == "kvbridge.vllm"
        assert kv["kv_role"] == kv_role
        assert kv["kv_load_failure_policy"] == "fail"
        assert kv["kv_connector_extra_config"]["token_file"] == cfg.token_file
        # each replica claims its own credential: none is named for the deployment
        assert "credential_file" not in kv["kv_connector_extra_config"]
        pool = args[key]["experimental_configs"][POOL_KEY]
        assert pool == cfg.deployment(side).credential_pool
        assert kv["kv_connector_extra_config"]["lease_s"] == LOADED_HOST_SETTINGS["lease_s"]


def test_a_lease_is_set_for_both_sides_and_a_bad_one_refused(deployment: tuple) -> None:
    cfg, _, _ = deployment
    args = pd_serving_args(dataclasses.replace(cfg, lease_s=60))
    for key in ("prefill_config", "decode_config"):
        extra = args[key]["engine_kwargs"]["kv_transfer_config"]["kv_connector_extra_config"]
        assert extra["lease_s"] == 60
    with pytest.raises(ConfigError, match=r"lease_s=0: use a positive number of seconds"):
        dataclasses.replace(cfg, lease_s=0)


def test_no_secret_is_in_the_application_only_file_paths(deployment: tuple) -> None:
    cfg, tmp_path, credential_files = deployment
    text = json.dumps(pd_serving_args(cfg))
    assert TOKEN not in text
    for path in credential_files:
        cred = Credential.load(path)
        for secret in (cred.curve_secret.decode(), cred.signing_secret.hex()):
            assert secret not in text
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    for key in ("prefill_config", "decode_config"):
        env = pd_serving_args(cfg)[key]["runtime_env"]["env_vars"]
        assert not any(name.startswith("KVBRIDGE") for name in env)  # the token's variables
        assert TOKEN not in json.dumps(env)
    # the secrets' files are named by path, under the run's directory
    assert str(tmp_path) in text


def test_a_pool_gives_each_claim_its_own_credential_of_its_role(tmp_path: Path) -> None:
    root = RootKey.generate()
    pool = enroll_pool(root, "kv_producer", "prefill", 8, tmp_path / "pool")
    assert stat.S_IMODE(os.stat(pool).st_mode) == 0o700
    got: list[Path] = []
    lock = threading.Lock()

    def take(i: int) -> None:
        path = claim(pool, {"replica": i})
        with lock:
            got.append(path)

    threads = [threading.Thread(target=take, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(got)) == 8  # no two replicas hold one credential
    ids = {Credential.load(p).instance_id for p in got}
    assert len(ids) == 8
    assert all(Credential.load(p).roles == (ConnectorRole.PRODUCER,) for p in got)
    assert sorted(c["replica"] for c in claims(pool)) == list(range(8))
    with pytest.raises(ConfigError, match=r"all 8 credentials are claimed.*enroll more"):
        claim(pool, {"replica": 8})


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"tp_size": 0}, "tp_size=0"),
        ({"block_size": 48}, "block_size=48: vLLM's CPU build takes multiples of 32"),
        ({"node_resource": ""}, "name the custom resource"),
        ({"num_replicas": 0}, "num_replicas=0"),
    ],
)
def test_a_bad_deployment_is_refused_naming_the_field(kwargs: dict, words: str) -> None:
    fields = {"tp_size": 1, "node_resource": "n", "credential_pool": "/p", **kwargs}
    with pytest.raises(ConfigError, match=words):
        Deployment(**fields)


def test_a_pool_of_another_role_or_size_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="kv_role='kv_both_ways'"):
        enroll_pool(RootKey.generate(), "kv_both_ways", "x", 1, tmp_path / "p")
    with pytest.raises(ConfigError, match="count=0"):
        enroll_pool(RootKey.generate(), "kv_producer", "x", 0, tmp_path / "p")
