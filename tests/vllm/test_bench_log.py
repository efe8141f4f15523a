"""`kvbridge bench vllm` says why a pair failed from the instance's log: the exception
that ended its last traceback, not the last line that mentions an error."""

from __future__ import annotations

from kvbridge.bench.vllm import last_error

# the shape of vLLM 0.32's log when NixlConnector refuses prefill tp 2 -> decode tp 1
# with one KV head (measured 2026-12-04, `kvbridge bench vllm --model tiny-kv1 --pairs 2:1`)
NIXL_LOG = """\
(Worker pid=19518) INFO 12-04 16:40:00 [base_worker.py:2255] Transfer plan: TransferTopology(tp_ratio=-2)
(Worker pid=19518) ERROR 12-04 16:40:00 [base_worker.py:1318] NIXL transfer failure: handshake_setup_failed
(Worker pid=19518) ERROR 12-04 16:40:00 [base_worker.py:1318] Traceback (most recent call last):
(Worker pid=19518) ERROR 12-04 16:40:00 [base_worker.py:1318]   File "base_worker.py", line 2302, in add_remote_agent
(Worker pid=19518) ERROR 12-04 16:40:00 [base_worker.py:1318]     self._validate_remote_agent_handshake(
(Worker pid=19518) ERROR 12-04 16:40:00 [base_worker.py:1318]   File "base_worker.py", line 2450, in _validate_remote_agent_handshake
(Worker pid=19518) ERROR 12-04 16:40:00 [base_worker.py:1318]     tp_ratio < 0 and self.transfer_topo.is_kv_replicated(remote_engine_id)
(Worker pid=19518) ERROR 12-04 16:40:00 [base_worker.py:1318]     ^^^^^^^^^^^^
(Worker pid=19518) ERROR 12-04 16:40:00 [base_worker.py:1318] AssertionError
(APIServer pid=19473) ERROR 12-04 16:40:00 [serving.py:203] Request cmpl-b40d failed with an internal error during generation
"""


def test_a_bare_assert_is_named_with_the_line_that_raised_it() -> None:
    assert last_error(NIXL_LOG) == (
        "AssertionError at `tp_ratio < 0 and self.transfer_topo.is_kv_replicated(remote_engine_id)`"
    )


def test_an_exception_with_a_message_is_given_as_it_is() -> None:
    log = NIXL_LOG.replace("] AssertionError", "] RuntimeError: the handshake timed out")
    assert last_error(log) == "RuntimeError: the handshake timed out"


def test_without_a_traceback_the_last_error_line_or_the_last_line() -> None:
    assert last_error("starting\nERROR: port in use\nbye\n") == "ERROR: port in use"
    assert last_error("starting\nbye\n") == "bye"
    assert last_error("") == "(empty log)"
