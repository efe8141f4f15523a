"""Slows NIXL's progress thread in vLLM processes that run NixlConnector on a CPU host
(`kvbridge bench vllm` puts this folder on their PYTHONPATH; nothing else imports it).

NIXL's Python API starts each agent with its progress thread on and a delay of 0 between
polls (`nixl_agent.__init__` sets `pthrDelay = 0`), and vLLM's NixlConnector takes that
default: on a GPU host the thread spins on a core of its own; on a host with as few
cores as vLLM workers it takes one from the engine, steps slow down, leases expire.
With KVBRIDGE_NIXL_PTHR_DELAY_US set, every agent made in this process polls at most
once per that many microseconds instead (the agent's own `pthrDelay` setting).
"""

import os

_DELAY_US = os.environ.get("KVBRIDGE_NIXL_PTHR_DELAY_US")


def _pace(delay_us: int) -> None:
    try:
        from nixl_cu12 import _api
    except ImportError:
        return
    make_agent = _api.nixlBind.nixlAgent

    def paced_agent(name, config):  # type: ignore[no-untyped-def]
        config.pthrDelay = delay_us
        return make_agent(name, config)

    _api.nixlBind.nixlAgent = paced_agent


if _DELAY_US:
    _pace(int(_DELAY_US))
