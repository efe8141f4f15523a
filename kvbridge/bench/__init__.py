"""Benchmarks that print figures (never tests), one module per `kvbridge bench` command.

`plan` (numpy only), `transfer` (+ `cma_floor`, the kernel's floor under UCX's same-host
transport), `comm`, `engine` (+ `floor`), `serve` (+ `multiturn`). Each exposes its
arguments and a runner; `kvbridge.cli.bench_cmd` only wires them under one command. A
benchmark imports the layers it measures; nothing in the runtime imports this package.
"""
