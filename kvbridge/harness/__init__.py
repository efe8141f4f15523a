"""The harness that tests and benchmarks the transfer runtime, apart from the runtime.

Real worker processes, each with a pattern-filled cache, one NIXL agent and a
`KVProducer` or `KVConsumer`, driven by a parent over pipes with msgspec commands
(`cluster`, `worker`, `commands`): `kvbridge transfer-check` (`check`) and `kvbridge
bench transfer` (`kvbridge.bench.transfer`); test hosts on one machine, as network
namespaces on a bridge (`hosts`). An engine embeds `kvbridge.transfer` and never needs this package.
"""
