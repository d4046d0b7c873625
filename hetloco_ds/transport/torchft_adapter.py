"""What the elastic transport (transport/elastic.py) changes in torchft 0.2.0, and the sockets it binds.

torchft binds every interface and meets each group rank's peers in a process group of their own;
a fleet that authenticates its peers and mixes depths can keep neither. What we change:

* `replica_store`: a replica's TCPStore listening on `bind` only (c10d's listens everywhere);
* `manager_server_bound_to`: torchft's ManagerServer (which answers an unauthenticated Kill RPC)
  on `bind`, where torchft hard-codes every interface;
* `BlockGroups`: the process group torchft reconfigures at each quorum, one gloo group per
  outer-sync block the rank holds, with its sockets on `advertise or bind`;
* `install_source_rank_zero`: a healer asks the recovery source's stage 0 for its checkpoint
  metadata (the replica's block -> address map), not its own group rank, which a source of another
  depth may not have;
* torchft's logs of a refused heal and of its missing flight recorder, dropped.

Imported by elastic.py only, after it has set RUST_LOG (torchft's extension reads it at import).
"""
from __future__ import annotations

import logging
import socket
from contextlib import contextmanager
from datetime import timedelta
from typing import Callable

import torch
import torchft.manager as _tfm
from torch.distributed import ProcessGroup as _C10dGroup
from torch.distributed import TCPStore
from torchft.manager import Manager
from torchft.process_group import ProcessGroupGloo

from .auth import FleetRefused
from .state_transfer import url_host

# What we rely on in torchft beyond its documented Manager API; checked here so that an upgrade
# that moves them fails at import instead of silently binding every interface.
TORCHFT_CHECKED_AGAINST = "0.2.0"
if not callable(getattr(_tfm, "ManagerServer", None)) or not isinstance(getattr(_tfm, "REPLICA_ID_KEY", None), str):
    raise ImportError("torchft.manager no longer has ManagerServer / REPLICA_ID_KEY; hetloco_ds.transport.elastic "
                      f"supports torchft {TORCHFT_CHECKED_AGAINST}")


def replica_store(host: str, port: int = 0, timeout: timedelta = timedelta(seconds=300)) -> TCPStore:
    """A TCPStore server for one replica's stage ranks (and the rendezvous of the cross-replica groups
    when this replica is their primary) that listens on `host` only; c10d's own binds every interface."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host.strip("[]"), port))
    sock.listen(128)
    port = sock.getsockname()[1]
    return TCPStore(host.strip("[]"), port, is_master=True, wait_for_workers=False, timeout=timeout,
                    master_listen_fd=sock.detach())


class _BoundGloo(ProcessGroupGloo):
    """torchft's reconfigurable gloo group, with its sockets on `host` (torchft's uses the address
    the machine's hostname resolves to, torchft/process_group.py ProcessGroupGloo._create_pg)."""

    def __init__(self, host: str, timeout: timedelta):
        super().__init__(timeout=timeout)
        self._host = host

    def _create_pg(self, store, rank: int, world_size: int):
        opts = torch._C._distributed_c10d.ProcessGroupGloo._Options()
        opts._timeout = self._timeout
        opts._devices = [torch._C._distributed_c10d.ProcessGroupGloo.create_device(hostname=self._host)]
        backend = torch._C._distributed_c10d.ProcessGroupGloo(store, rank, world_size, opts)
        backend._set_sequence_number_for_group()
        pg = _C10dGroup(store, rank, world_size)
        pg._set_default_backend(_C10dGroup.BackendType.GLOO)
        pg._register_backend(torch.device("cpu"), _C10dGroup.BackendType.GLOO, backend)
        return pg


@contextmanager
def manager_server_bound_to(host: str, applied: list):
    """torchft 0.2.0 builds its ManagerServer with bind=f"[::]:{port}" (torchft/manager.py, in
    Manager.__init__), i.e. on every interface, and that server answers an unauthenticated Kill RPC.
    While the Manager is built, hand it a ManagerServer that binds `host` instead."""
    real = _tfm.ManagerServer

    def bound(*, bind: str, **kwargs):
        applied.append(True)
        return real(bind=f"{url_host(host)}:{bind.rpartition(':')[2]}", **kwargs)

    _tfm.ManagerServer = bound
    try:
        yield
    finally:
        _tfm.ManagerServer = real


class BlockGroups:
    """The process group torchft's Manager reconfigures at each new quorum: one torchft gloo group
    per outer-sync block this rank holds (rank = the replica's position in the quorum, world = the
    quorum's size). Every participating replica has exactly one rank holding a block, so its group
    is well defined whatever the replicas' depths.

    One depth: one group, at the store address torchft gives this group rank, as torchft makes it.
    Mixed depths: torchft picks a group rank's store by the group rank (the quorum's replica
    `group_rank % n`, torchft manager.rs compute_quorum_results), and one block's holders have other
    group ranks in replicas of other depths; so every block's group meets at the store torchft gives
    group rank 0, the same for every replica (`rank_zero_store`), under a prefix of the block."""

    def __init__(self, host: str, timeout: timedelta, blocks: tuple[int, ...], mixed: bool,
                 rank_zero_store: Callable[[int, int, str], str]):
        self.blocks, self.mixed, self._rank_zero_store = blocks, mixed, rank_zero_store
        self.groups = [_BoundGloo(host, timeout) for _ in blocks]

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int, quorum_id=None,
                  group_rank=None, group_world_size=None, global_ranks=None) -> None:
        if not self.mixed:
            self.groups[0].configure(store_addr, replica_id, rank, world_size, quorum_id, group_rank,
                                     group_world_size, global_ranks)
            return
        host = self._rank_zero_store(quorum_id, group_rank, store_addr.partition("/")[0])
        # In block order on every rank: a rank waits in one block's rendezvous only for ranks that are
        # done with every earlier block's.
        for b, g in zip(self.blocks, self.groups):
            g.configure(f"{host}/torchft/{quorum_id}/block{b}", replica_id, rank, world_size, quorum_id,
                        group_rank, group_world_size, global_ranks)

    def errored(self):
        return next((e for e in (g.errored() for g in self.groups) if e is not None), None)

    def shutdown(self) -> None:
        for g in self.groups:
            g.shutdown()


class _SourceRankZero:
    """torchft 0.2.0 heals a rank with the checkpoint metadata of its own group rank in the recovery
    source (Manager._async_quorum: `primary_client._checkpoint_metadata(self._group_rank)`); a source
    of another depth may have no such rank, or other layers on it. Every rank's metadata carries its
    replica's whole block map (`AuthenticatedStateTransport.metadata`), so the healer asks the
    source's rank 0, which every replica has, and fetches each block it holds from the source's rank
    that holds it."""

    def __init__(self, client):
        self._client = client

    def _checkpoint_metadata(self, rank: int, timeout: timedelta) -> str:
        return self._client._checkpoint_metadata(0, timeout=timeout)

    def __getattr__(self, name: str):
        return getattr(self._client, name)


def install_source_rank_zero() -> None:
    """Our one lasting override of torchft internals (idempotent; checked against torchft 0.2.0):
    every ManagerClient torchft.manager builds answers `_checkpoint_metadata` with rank 0's."""
    import importlib.metadata
    import inspect
    import re

    real = _tfm.ManagerClient
    if getattr(real, "_hetloco_source_rank_zero", False):
        return
    found = importlib.metadata.version("torchft")
    source = inspect.getsource(Manager._async_quorum)
    if (found != TORCHFT_CHECKED_AGAINST or not callable(getattr(Manager, "_manager_state_dict", None))
            or not re.search(r"primary_client = ManagerClient\(", source)
            or not re.search(r"primary_client\._checkpoint_metadata\(\s*self\._group_rank", source)):
        raise ImportError(f"torchft {found}: Manager._async_quorum no longer asks ManagerClient(...)."
                          "_checkpoint_metadata(self._group_rank) when it heals, or Manager._manager_state_dict is "
                          f"gone; hetloco_ds heals replicas of mixed depths against torchft {TORCHFT_CHECKED_AGAINST}")

    def client(*args, **kwargs):
        return _SourceRankZero(real(*args, **kwargs))

    client._hetloco_source_rank_zero = True
    _tfm.ManagerClient = client


class _QuietTorchft(logging.Filter):
    """torchft logs a failed heal with its traceback; a refusal is reported once, by us, in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], FleetRefused):
            return False
        # Logged at every reconfiguration on builds without NCCL's flight recorder (CPU): noise here.
        return "flight recorder" not in str(record.msg)


logging.getLogger(_tfm.__name__).addFilter(_QuietTorchft())
