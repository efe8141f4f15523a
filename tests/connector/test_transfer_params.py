"""A request's hand-over record as vLLM's `kv_transfer_params`: what a proxy sends a
prefill instance, what that instance answers and a decode instance reads back (vLLM's
P/D keys, which its proxies and NixlConnector share, and kvbridge's own)."""

from __future__ import annotations

import binascii

import pytest

from kvbridge.connector.metadata import (
    CAPABILITY_KEY,
    READER_KEY,
    RemoteDecode,
    RemotePrefill,
    decode_transfer_params,
    encode_transfer_params,
)


def test_a_prefill_request_is_what_vllm_proxies_send() -> None:
    assert encode_transfer_params(RemoteDecode()) == {"do_remote_decode": True}
    named = encode_transfer_params(RemoteDecode("decode-a"))
    assert named == {"do_remote_decode": True, READER_KEY: "decode-a"}
    assert decode_transfer_params(named) == RemoteDecode("decode-a")


def test_a_prefill_answer_reads_back_without_its_first_token() -> None:
    answer = RemotePrefill(7, b"\x00signed\xff", "prefill-a")
    params = encode_transfer_params(answer, "p-1")
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_engine_id"] == "prefill-a" and params["remote_request_id"] == "p-1"
    assert decode_transfer_params(params) == RemotePrefill(
        None, b"\x00signed\xff", "prefill-a", "p-1"
    )  # vLLM samples the first token again


def test_no_hand_over_and_a_bad_capability() -> None:
    assert decode_transfer_params({}) is None
    assert decode_transfer_params({"do_remote_prefill": False, CAPABILITY_KEY: "AA=="}) is None
    with pytest.raises(binascii.Error):
        decode_transfer_params({"do_remote_prefill": True, CAPABILITY_KEY: "not base64!"})
