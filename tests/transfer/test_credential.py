"""Role credentials (`credential.py`): a capability is valid only when a prefill
instance the deployment's root enrolled signed it, for itself. What a party holding a
decode host's or the proxy's files (its credential, the root's public key, the shared
token) can make is refused: a re-signed capability, one signed by a decode key, one
pointing to an endpoint of its own, one under a root of its own. The same attacks through
the serving plane: tests/serve/test_security.py; across hosts: tests/hosts."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from kvbridge.cli.main import main as cli
from kvbridge.connector import ConnectorRole, Credential, Identity, RootKey
from kvbridge.errors import ConfigError
from kvbridge.transfer.capability import Capability, check, issue
from kvbridge.transfer.errors import AuthError
from tests.credentials import ROOT, enrolled, resigned

PREFILL, DECODE = ConnectorRole.PRODUCER, ConnectorRole.CONSUMER


def capability(producer: str = "P", endpoint: str = "tcp://127.0.0.1:5000") -> Capability:
    return Capability("r1", producer, endpoint, [3, 1], 20, "D", time.time() + 60)


def test_a_capability_holds_only_for_its_reader_its_root_and_its_lifetime() -> None:
    cap = capability()
    data = issue(cap, enrolled(PREFILL, "P"))
    assert check(data, ROOT.public, "D") == cap
    for root, reader, now, words in (
        (ROOT.public, "X", None, r"issued to decode instance 'D', not to this one \('X'\)"),
        (RootKey.generate().public, "D", None, "not by this deployment's root"),
        (ROOT.public, "D", time.time() + 120, "expired"),
    ):
        with pytest.raises(AuthError, match=words):
            check(data, root, reader, now)
    with pytest.raises(AuthError, match="malformed"):
        check(b"\x93garbage", ROOT.public, "D")


def test_what_a_decode_host_holds_signs_no_capability_a_decode_instance_takes() -> None:
    """The attacks of a party holding a decode host's credential and the root's public
    key: each refused, naming why."""
    decode = enrolled(DECODE, "D")
    real = issue(capability(), enrolled(PREFILL, "P"))
    # re-signed with other prompt ids: the decode host's own key, the prefill's cert
    other_prompt = resigned(real, decode, prompt_digest=b"x" * 16)
    # a foreign endpoint, the signature kept
    moved = resigned(real, None, endpoint="tcp://10.9.9.9:1")
    # a root of its own enrolling a "prefill" under the real prefill's name
    own_root = RootKey.generate()
    attacks = {
        "signed by a decode key": (
            issue(capability(producer="D"), decode),
            "enrolled as a decode instance: only a prefill instance",
        ),
        "re-signed": (other_prompt, "not signed by the key certified for 'P'"),
        "foreign endpoint": (moved, "not signed by the key certified for 'P'"),
        "own root": (
            issue(capability(endpoint="tcp://10.9.9.9:1"), enrolled(PREFILL, "P", own_root)),
            "not by this deployment's root",
        ),
        "another prefill's name": (
            issue(capability(producer="P"), enrolled(PREFILL, "Q")),
            "names producer 'P' but is signed by 'Q'",
        ),
    }
    for data, words in attacks.values():
        with pytest.raises(AuthError, match=words):
            check(data, ROOT.public, "D")


def test_a_credential_file_is_private_and_names_its_role(tmp_path) -> None:
    cred = ROOT.enroll((PREFILL,), "prefill-a")
    path = tmp_path / "p.cred"
    cred.save(path)
    loaded = Credential.load(path)
    assert loaded == cred and loaded.instance_id.startswith("prefill-a@")
    assert loaded.identity.bind("prefill-a") == loaded.instance_id
    with pytest.raises(ConfigError, match="not for a decode instance; make one with"):
        loaded.check_role(DECODE, "--credential-file")
    os.chmod(path, 0o644)
    with pytest.raises(ConfigError, match="may be read by others"):
        Credential.load(path)
    other = tmp_path / "other.cred"
    other.write_bytes(b"{}")
    other.chmod(0o600)
    with pytest.raises(ConfigError, match="not a kvbridge credential"):
        Credential.load(other)


def make(root: Path, role: str, name: str, out: Path) -> int:
    """`kvbridge credential`, as the operator runs it for one host."""
    return cli(
        ["credential", "--root", str(root), "--role", role, "--name", name, "--out", str(out)]
    )


def test_one_command_makes_each_hosts_credential(tmp_path, capsys) -> None:
    root, p_file, d_file = tmp_path / "root.key", tmp_path / "p.cred", tmp_path / "d.cred"
    assert make(root, "prefill", "p", p_file) == 0
    assert "made the deployment's root key" in capsys.readouterr().out
    assert make(root, "decode", "d", d_file) == 0
    assert oct(root.stat().st_mode & 0o777) == "0o600"
    prefill, decode = Credential.load(p_file), Credential.load(d_file)
    assert prefill.root == decode.root == RootKey.load(root).public
    assert decode.roles == (DECODE,) and prefill.roles == (PREFILL,)
    assert root.read_bytes().strip() not in d_file.read_bytes()  # no secret of the root
    assert make(root, "decode", "d", d_file) == 2  # a credential is never overwritten
    data = issue(capability(producer=prefill.instance_id), prefill)
    assert check(data, decode.root, "D").producer == prefill.instance_id


def test_a_credential_whose_id_names_another_key_is_refused(tmp_path) -> None:
    path = tmp_path / "p.cred"
    ROOT.certify((PREFILL,), "p@" + "0" * 32, Identity.generate()).save(path)
    with pytest.raises(ConfigError, match=r"not a kvbridge credential.*bound to the key"):
        Credential.load(path)
