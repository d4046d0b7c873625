"""The micro-batches training reads: each replica's stream of packed blocks (`ReplicaBatches`),
the held-out batches (`validation_batches`), and a collated batch as the pipeline takes it.

Replica m's micro-batches are a pure function of a position counter, so every stage of a
replica, and a resumed run, produce the identical sequence. Only torch and `DataError`: the
simulator reads its batches here without loading the tokenizer libraries.
"""
from __future__ import annotations

import hashlib
from typing import Iterator

import torch

from .documents import DataError

def _epoch_seed(seed: int, epoch: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{epoch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class ReplicaBatches:
    """Endless `(inputs, labels)` micro-batches of replica `replica` of `num_replicas`.

    Epoch e permutes all N blocks with a generator seeded by (seed, e); replica m owns slots
    [m*S, (m+1)*S) of that permutation, S = N // num_replicas, so replicas are disjoint within an
    epoch (the N % num_replicas leftover blocks sit out that epoch; different ones each epoch).
    Item j of the replica's stream is slot m*S + j % S of epoch j // S, and micro-batch p is items
    p*b .. p*b+b-1 (a batch may straddle an epoch boundary). So batch p depends on nothing but
    (blocks, replica, num_replicas, b, seed, p): every pipeline stage of a replica builds its own
    iterator and sees the same sequence, and one constructed at `position=p` continues exactly
    where an uninterrupted run would be after p micro-batches.

    `blocks`: int [N, seq_len] token blocks; ids and labels are then separate int64 [b, seq_len]
    copies of the same blocks. Or any map-style dataset (`len`, `[i]`) of N samples, whose b
    samples `collate_fn` merges into a batch (default: torch's `default_collate`, as DeepSpeed's
    loader); `pipeline_batch` reads (inputs, labels) from that batch.
    """

    def __init__(self, blocks, replica: int, num_replicas: int, micro_batch_size: int,
                 seed: int = 0, position: int = 0, collate_fn=None):
        if isinstance(blocks, torch.Tensor) and blocks.dim() != 2:
            raise ValueError(f"blocks must be [N, seq_len], got shape {tuple(blocks.shape)}")
        if not 0 <= replica < num_replicas:
            raise ValueError(f"replica={replica} is not in [0, num_replicas={num_replicas})")
        if micro_batch_size < 1 or position < 0:
            raise ValueError(f"micro_batch_size={micro_batch_size} must be >= 1 and position={position} >= 0")
        n = len(blocks)
        if n < num_replicas:
            if not isinstance(blocks, torch.Tensor):
                raise DataError(f"the dataset has {n} samples but {num_replicas} replicas need at least one each")
            seq_len = blocks.shape[1]
            raise DataError(
                f"corpus has {n} blocks ({n * seq_len} tokens) but {num_replicas} replicas need at "
                f"least one block each ({num_replicas * seq_len} tokens at seq_len={seq_len})"
            )
        self.blocks, self.collate_fn = blocks, collate_fn
        self.replica, self.num_replicas, self.micro_batch_size, self.seed = replica, num_replicas, micro_batch_size, seed
        self.shard_size = n // num_replicas
        self._position = position
        self._perm: tuple[int, torch.Tensor] | None = None

    @property
    def position(self) -> int:
        """Micro-batches consumed so far; the next one yielded is `batch(position)`."""
        return self._position

    @property
    def epoch(self) -> int:
        """Epoch of the next item this replica reads."""
        return self._position * self.micro_batch_size // self.shard_size

    def _shard(self, epoch: int) -> torch.Tensor:
        if self._perm is None or self._perm[0] != epoch:
            g = torch.Generator().manual_seed(_epoch_seed(self.seed, epoch))
            perm = torch.randperm(len(self.blocks), generator=g)
            start = self.replica * self.shard_size
            self._perm = (epoch, perm[start : start + self.shard_size])
        return self._perm[1]

    def block_indices(self, position: int) -> torch.Tensor:
        """Row indices into `blocks` of micro-batch `position`."""
        first = position * self.micro_batch_size
        return torch.stack([
            self._shard(j // self.shard_size)[j % self.shard_size]
            for j in range(first, first + self.micro_batch_size)
        ])

    def batch(self, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Micro-batch `position` as (inputs, labels); does not move `.position`."""
        rows = self.block_indices(position)
        if isinstance(self.blocks, torch.Tensor) and self.collate_fn is None:
            ids = self.blocks[rows].long()
            return ids, ids.clone()
        from torch.utils.data import default_collate

        return pipeline_batch((self.collate_fn or default_collate)([self.blocks[int(i)] for i in rows]))

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.batch(self._position)
        self._position += 1
        return out

    def state_dict(self) -> dict:
        """What a checkpoint stores to resume this stream."""
        return {"position": self._position, "seed": self.seed, "replica": self.replica,
                "num_replicas": self.num_replicas, "micro_batch_size": self.micro_batch_size}

    def load_state_dict(self, state: dict) -> None:
        """Resume at `state["position"]`; the other fields must match (a position means nothing else)."""
        for name in ("seed", "replica", "num_replicas", "micro_batch_size"):
            if state[name] != getattr(self, name):
                raise ValueError(f"data state was saved with {name}={state[name]}, this run has {getattr(self, name)}")
        self._position = int(state["position"])


def validation_batches(blocks: torch.Tensor, micro: int):
    """The held-out blocks in order, `micro` at a time, cycling: the same batches at every validation."""
    n = blocks.shape[0]
    start = 0
    while True:
        idx = torch.arange(start, start + micro) % n
        ids = blocks[idx].long()
        yield ids, ids.clone()
        start = (start + micro) % n


def pipeline_batch(batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels) as the pipeline reads them, from a collated batch: an (inputs, labels)
    pair, as DeepSpeed's pipeline takes it; a tensor of token blocks or a mapping with
    `input_ids` (and optionally `labels`), whose labels are the ids (the loss shifts them)."""
    if isinstance(batch, torch.Tensor):
        ids = batch.long()
        return ids, ids.clone()
    if isinstance(batch, dict) and "input_ids" in batch:
        ids = torch.as_tensor(batch["input_ids"]).long()
        labels = batch.get("labels")
        return ids, ids.clone() if labels is None else torch.as_tensor(labels).long()
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return tuple(batch)
    kind = f"a mapping with keys {sorted(batch)}" if isinstance(batch, dict) else type(batch).__name__
    raise DataError(f"a collated micro-batch is {kind}; the pipeline needs (inputs, labels), a tensor of token "
                    "blocks or a mapping with input_ids")
