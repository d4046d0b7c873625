"""The stage-boundary codec: a stage's output as it crosses a link, and back (paper eq. 1).

On an uncompressed replica the message is the hidden state in the wire dtype; on a compressed
one it is X~ = (X - T_perp[x]) U and the token ids, from which the next stage rebuilds
X^ = X~ U^T + T_perp[x]. Pure torch (no DeepSpeed, no processes): the engine's PipelineModule
holds a `BoundaryCodec` at each end of its stage, the per-replica simulator one per virtual
stage, and the batched simulator calls `encode_hidden` / `decode_hidden` under vmap, so every
driver truncates a boundary with the same operations.
"""
from __future__ import annotations

import torch
from torch import nn

from . import sizes, subspace
from .model import residual_dtype


def encode_hidden(hidden: torch.Tensor, ids: torch.Tensor | None, perp: torch.Tensor | None,
                  basis: torch.Tensor | None, wire_dtype: torch.dtype) -> torch.Tensor:
    """The hidden part of a message: (X - T_perp[x]) U with a basis, X without, in `wire_dtype`."""
    if basis is None:
        return hidden.to(wire_dtype)
    return subspace.encode(hidden.float(), ids, perp, basis).to(wire_dtype)


def decode_hidden(message: torch.Tensor, ids: torch.Tensor | None, perp: torch.Tensor | None,
                  basis: torch.Tensor | None) -> torch.Tensor:
    """X^ from the hidden part of a message, in the residual stream's dtype."""
    hidden = message if basis is None else subspace.decode(message.float(), ids, perp, basis)
    return hidden.to(residual_dtype(hidden))


class BoundaryCodec(nn.Module):
    """Encodes a stage's output for the wire and decodes the previous stage's message.

    `basis` is None on uncompressed replicas. `perp` is T_perp (the stage's StageAlgorithm
    owns it). `wire_dtype` is what crosses the link (bf16 under bf16 training).
    """

    def __init__(self, hidden_size: int, vocab_size: int, basis: torch.Tensor | None = None,
                 wire_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.hidden_size = hidden_size
        self.register_buffer("basis", basis, persistent=False)
        self.register_buffer("perp", None, persistent=False)
        self.wire_dtype = wire_dtype
        self.id_dtype = {1: torch.int8, 2: torch.int16, 4: torch.int32}[sizes.id_bytes(vocab_size)]

    @property
    def compressed(self) -> bool:
        return self.basis is not None

    @property
    def width(self) -> int:
        """Elements per token of the boundary tensor: k on a compressed replica, d otherwise."""
        return self.basis.shape[1] if self.compressed else self.hidden_size

    def message_spec(self, micro_batch: int, seq_len: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """(shape, dtype) of each tensor `encode` puts on the wire, in order."""
        spec = [((micro_batch, seq_len, self.width), self.wire_dtype)]
        if self.compressed:
            id_bytes = torch.empty((), dtype=self.id_dtype).element_size()
            spec.append(((micro_batch, seq_len * id_bytes), torch.uint8))
        return spec

    def encode(self, outputs):
        hidden, ids = outputs
        if not self.compressed:
            return encode_hidden(hidden, None, None, None, self.wire_dtype)
        # Ids travel as the bytes of the narrowest integer type: NCCL has no int16, so they
        # are viewed as uint8 on the wire (same bytes) and viewed back on receipt.
        return (encode_hidden(hidden, ids, self.perp, self.basis, self.wire_dtype),
                ids.to(self.id_dtype).view(torch.uint8))

    def decode(self, message):
        if not self.compressed:
            return decode_hidden(message, None, None, None), None
        reduced, ids = message
        ids = ids.view(self.id_dtype).long()
        return decode_hidden(reduced, ids, self.perp, self.basis), ids
