"""Errors of the tensor-parallel runtime (collectives and worker processes).

Every error names the rank it is about, so the engine can say which worker failed.
"""

from __future__ import annotations

from kvbridge.errors import KVBridgeError, WorkerError


class ParallelError(KVBridgeError):
    """Root of the tensor-parallel runtime's errors."""


class CommError(ParallelError):
    """A collective cannot complete. The communicator is unusable afterwards."""


class CommTimeoutError(CommError):
    """A collective waited longer than the communicator's timeout for some ranks."""

    def __init__(self, message: str, missing_ranks: list[int]) -> None:
        super().__init__(message)
        self.missing_ranks = missing_ranks


class PeerDiedError(CommError):
    """A peer rank's process died while the others waited for it."""

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


class PeerAbortedError(CommError):
    """A peer rank gave up on the group (it failed first); the root cause is in the message."""

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


class CommMismatchError(CommError):
    """Ranks called different collectives, or with different sizes or dtypes (an SPMD bug)."""


class CommUsageError(ParallelError):
    """A collective was called with an unsupported tensor (too large, wrong dtype or device)."""


# A worker's handler raising is the project's one `WorkerError` (rank + traceback text);
# the specific worker failures below are kinds of it.
__all__ = ["WorkerError"]


class WorkerDiedError(WorkerError, ParallelError):
    """A worker process exited while the driver waited for it."""

    def __init__(self, message: str, rank: int, exitcode: int | None) -> None:
        super().__init__(message, rank)
        self.exitcode = exitcode


class WorkerStartError(WorkerError, ParallelError):
    """Worker processes did not become ready (import error, init failure, timeout)."""


class WorkerTimeoutError(WorkerError, ParallelError):
    """A call's replies did not all arrive within its timeout."""


class WorkerGroupClosedError(WorkerError, ParallelError):
    """The group was closed, or broken by an earlier failure; start a new one."""
