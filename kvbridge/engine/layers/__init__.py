"""Tensor-parallel building blocks of a decoder: each holds one worker's shard of a weight
and calls the worker's `Communicator` where the math needs the other shards."""
