"""One row of the batched simulator spread over G processes, each holding M/G of its replicas.

A row of M replicas on one device is bound by that device: at 105M parameters the paper's row
(M = 8) takes longer than one GPU session gives. `Shards` splits the replicas into G contiguous
blocks, process g holding replicas [g M/G, (g+1) M/G) stacked as `batched.BatchedSimulation`
stacks all M, and is the one place where the blocks meet: every quantity that couples replicas
is gathered into the tensor a single process would hold - every replica's payload of a stage in
replica order (`core.outer_step_all`), the per-sync diagnostics' dense mean and error norms, the
gradients AdamW mode averages every step, the replicas' widths, their losses and validation
losses - and then the same operation runs on it. So the method's math stays in the shared
objects, and a sharded row computes what the single-process row computes from the same tensors.

Every gather is `transport.static.all_gather_payloads` over the row's process group (NCCL's
all_gather on GPUs, gloo's receive-first exchange on the CPU), and every process reaches each
one at the same point of the row: they run the same steps, outer steps, flushes and boundary
decisions, and a decision taken from local time (the deadline) is rank 0's, broadcast
(`Shards.first`). With G = 1 every method returns its input: the single-process row unchanged.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as tdist

from ..config import ConfigError
from ..transport.static import all_gather_payloads


@dataclass(frozen=True)
class Shards:
    """Which of a row's `replicas` this process holds: block `index` of `count`, the blocks being
    the ranks of the torch.distributed world (one row per world)."""

    replicas: int
    count: int = 1
    index: int = 0

    def __post_init__(self):
        if self.count < 1 or self.replicas % self.count:
            raise ConfigError(f"{self.replicas} replicas cannot be split evenly over {self.count} processes "
                              "(the number of processes must divide the replicas)")

    @classmethod
    def of_world(cls, replicas: int, count: int) -> "Shards":
        """This process's block of a row run by `count` processes: the torch.distributed world,
        which must exist when `count` > 1 (`init_group`) and have exactly that size."""
        if count == 1:
            return cls(replicas)
        if not tdist.is_initialized() or tdist.get_world_size() != count:
            world = tdist.get_world_size() if tdist.is_initialized() else None
            raise ConfigError(f"a row sharded over {count} processes needs a torch.distributed world of {count} "
                              f"(this process has {world or 'none'})")
        return cls(replicas, count, tdist.get_rank())

    @property
    def local(self) -> int:
        """Replicas held here."""
        return self.replicas // self.count

    @property
    def ids(self) -> range:
        """The global ids of the replicas held here, in order."""
        return range(self.index * self.local, (self.index + 1) * self.local)

    @property
    def rank0(self) -> bool:
        return self.index == 0

    def gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """This process's per-replica `tensor` (its `local` replicas along `dim`) -> every replica's,
        the blocks concatenated in process order, i.e. replica order; the tensor itself when G = 1.
        Every process must call it at the same point with a tensor of the same shape and dtype."""
        if self.count == 1:
            return tensor
        assert tensor.shape[dim] == self.local, (tensor.shape, dim, self.local)
        return torch.cat(all_gather_payloads(tensor.contiguous()), dim)

    def mine(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """This process's block of an every-replica `tensor` (along `dim`); the tensor itself when G = 1."""
        return tensor if self.count == 1 else tensor.narrow(dim, self.index * self.local, self.local)

    def gather_list(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each local replica's tensor (alike in shape and dtype) -> every replica's, in replica order."""
        if self.count == 1:
            return list(tensors)
        return list(self.gather(torch.stack(tensors)).unbind(0))

    def first(self, value):
        """Rank 0's `value` on every process (a decision all of them must take alike)."""
        if self.count == 1:
            return value
        box = [value]
        tdist.broadcast_object_list(box, src=0)
        return box[0]

    def every(self, value) -> list:
        """Every process's `value`, in process order (`[value]` when G = 1)."""
        if self.count == 1:
            return [value]
        out = [None] * self.count
        tdist.all_gather_object(out, value)
        return out

    def state_path(self, path: str | None) -> str | None:
        """Where this process saves its block's state: `path` itself when G = 1, else `path`.g<index>
        (a row resumes on the same G)."""
        return path if (path is None or self.count == 1) else f"{path}.g{self.index}"


def init_group(count: int, device: str) -> torch.device:
    """Join the row's process group of `count` processes from the launcher's environment (RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK): NCCL with each process on GPU LOCAL_RANK of
    the ones it sees, gloo on the CPU. Returns the device this process computes on."""
    if device == "cuda":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(dev)
    else:
        dev = torch.device(device)
    if count > 1 and not tdist.is_initialized():
        tdist.init_process_group("nccl" if dev.type == "cuda" else "gloo", device_id=dev if dev.type == "cuda" else None)
    return dev
