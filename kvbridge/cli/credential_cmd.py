"""`kvbridge credential`: enroll one instance (a host's credential) with the deployment's
root key, making the root key first if its file does not exist yet."""

from __future__ import annotations

import argparse
import os

#: --role's words, and the connector roles each certifies
ROLE_CHOICES = ("prefill", "decode", "both")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "credential",
        help="make an instance's role credential, signed by the deployment's root key",
        description="Make the role credential of one prefill or decode instance (one "
        "command per host): a prefill instance signs its pull capabilities with it, a "
        "decode instance takes only capabilities of prefill instances the same root "
        "enrolled. Give it to the instance as --credential-file (kvbridge serve) or "
        "credential_file (vLLM's kv_connector_extra_config). The root key stays with the "
        "operator: it never goes to an instance's host.",
    )
    p.add_argument(
        "--root",
        required=True,
        metavar="FILE",
        help="the deployment's root key (mode 600); made if the file does not exist",
    )
    p.add_argument(
        "--role",
        required=True,
        choices=ROLE_CHOICES,
        help="prefill, decode, or both (a vLLM kv_both instance)",
    )
    p.add_argument(
        "--name", required=True, help="the instance's name (its id: NAME@key fingerprint)"
    )
    p.add_argument("--out", required=True, metavar="FILE", help="the credential file to make")
    p.set_defaults(handler=run, extra="transfer")


def run(args: argparse.Namespace) -> int:
    from kvbridge.connector import ConnectorRole, RootKey

    roles = {
        "prefill": (ConnectorRole.PRODUCER,),
        "decode": (ConnectorRole.CONSUMER,),
        "both": (ConnectorRole.PRODUCER, ConnectorRole.CONSUMER),
    }[args.role]
    if os.path.exists(args.root):
        root = RootKey.load(args.root)
    else:
        root = RootKey.generate()
        root.save(args.root)
        print(f"made the deployment's root key {args.root}: keep it with the operator only")
    if os.path.exists(args.out):
        print(f"--out {args.out} exists; choose a new file (a credential is never overwritten)")
        return 2
    credential = root.enroll(roles, args.name)
    credential.save(args.out)
    print(f"{args.out}: {args.role} instance {credential.instance_id} (mode 600)")
    return 0
