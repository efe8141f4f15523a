"""Tensor-parallel plumbing: collectives between the workers of one instance and the
driver's handle on its worker processes."""

from kvbridge.engine.parallel.base import Communicator, SingleProcessCommunicator

__all__ = ["Communicator", "SingleProcessCommunicator"]
