"""Tensor-parallel plumbing: collectives between the workers of one instance and the
driver's handle on its worker processes.

- `Communicator` (base.py): the collective interface model layers call.
- `ShmCommunicator` (shm_comm.py): collectives through shared memory on one host, over
  the segment in shm_segment.py and the arrival protocol in shm_sync.py.
- `TorchDistCommunicator`, `make_communicator` (torch_dist.py): torch.distributed, and
  the factory that picks shared memory when every rank is on this host.
- `WorkerGroup` (worker_group.py), `WorkerContext` (worker.py): the driver's handle on
  tp worker processes and what each worker receives.
"""

from kvbridge.engine.parallel.base import Communicator, SingleProcessCommunicator
from kvbridge.engine.parallel.errors import (
    CommError,
    CommMismatchError,
    CommTimeoutError,
    CommUsageError,
    ParallelError,
    PeerAbortedError,
    PeerDiedError,
    WorkerDiedError,
    WorkerError,
    WorkerGroupClosedError,
    WorkerStartError,
    WorkerTimeoutError,
)
from kvbridge.engine.parallel.shm_comm import ShmCommunicator
from kvbridge.engine.parallel.shm_segment import DEFAULT_MAX_BYTES, ShmSegment
from kvbridge.engine.parallel.torch_dist import CommKind, TorchDistCommunicator, make_communicator
from kvbridge.engine.parallel.worker import WorkerContext
from kvbridge.engine.parallel.worker_group import CallHandle, WorkerGroup

__all__ = [
    "DEFAULT_MAX_BYTES",
    "CallHandle",
    "CommError",
    "CommKind",
    "CommMismatchError",
    "CommTimeoutError",
    "CommUsageError",
    "Communicator",
    "ParallelError",
    "PeerAbortedError",
    "PeerDiedError",
    "ShmCommunicator",
    "ShmSegment",
    "SingleProcessCommunicator",
    "TorchDistCommunicator",
    "WorkerContext",
    "WorkerDiedError",
    "WorkerError",
    "WorkerGroup",
    "WorkerGroupClosedError",
    "WorkerStartError",
    "WorkerTimeoutError",
    "make_communicator",
]
