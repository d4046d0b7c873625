"""The stage-boundary codec: a stage's output as it crosses a link, and back (paper eq. 1).

`BoundaryCodec` is the protocol every codec implements; `CODECS` the registry the typed config
selects from (`hetloco.subspace.codec` names the codec of the compressed replicas; the others use
"identity"). Two are built in:

    identity   the hidden state in the wire dtype (an uncompressed replica)
    subspace   X~ = (X - T_perp[x]) U and the token ids; the receiver rebuilds X^ = X~ U^T + T_perp[x]

A researcher adds one by subclassing `BoundaryCodec` and decorating it with `register_codec`
(docs/extending.md; tests/test_codec_variant.py does it in a test file alone).

Every driver gets its codecs from `StageAlgorithm.codec`, which builds them from the config: the
engine's PipelineModule holds its rank's at each end of the stage, the per-replica simulator one
per virtual stage, and the batched simulator calls the same pure functions (`encode_hidden` /
`decode_hidden`) under vmap over the stacked `tensors()` of a row's replicas, so every driver
truncates a boundary with the same operations. Pure torch (no DeepSpeed, no processes).

What travels backward is not written by a codec: the engine sends autograd's gradient of each
floating-point tensor of the forward message (`grad_spec`), which for the subspace codec is
grad(X^) U, computed by autograd through X~ U^T. A codec that wants another backward message
puts a `torch.autograd.Function` in its pure functions; the wire then carries that function's
gradient, in the shapes of `grad_spec`.

T_perp is not a codec's state: it belongs to the embedding split (`EmbeddingSplit`, the TE
adaptation of paper section 2.4 and eqs. 3-4), which every replica of a fleet holds alike once any
replica compresses with a codec that asks for one (`BoundaryCodec.embedding_split`). StageAlgorithm
owns it and saves it; a codec reads it (`perp`) and its pure functions take it as an argument.
"""
from __future__ import annotations

from typing import Callable, ClassVar, Sequence

import torch
from torch import Tensor

from . import sizes, subspace
from .model import residual_dtype

Spec = list[tuple[tuple[int, ...], torch.dtype]]
"""(shape, dtype) of each tensor of one micro-batch's message, in the order it is sent."""


def wire_dtype_of(bf16: bool) -> torch.dtype:
    """What crosses a stage link: bf16 under bf16 training, else fp32."""
    return torch.bfloat16 if bf16 else torch.float32


class EmbeddingSplit:
    """TE = T_S + T_perp with T_S in Col(`basis`) (paper 2.4) and its re-projection after every
    outer sync (eqs. 3-4): the TE adaptation a codec that rebuilds X^ from T_perp[x] asks for.

    One per stage of every replica of a fleet where some replica's codec asks for it (the basis
    is the fleet's, `subspace.split_basis`); `perp` is None until `split_` runs."""

    def __init__(self, basis: Tensor):
        self.basis = basis
        self.perp: Tensor | None = None

    @torch.no_grad()
    def split_(self, table: Tensor, embeddings) -> None:
        """T_S = TE U U^T into every embedding given, T_perp = TE - T_S kept here and read by them."""
        t_s, self.perp = subspace.split_embedding(table, self.basis)
        for emb in embeddings:
            emb.weight.copy_(t_s)
            emb.perp = self.perp

    def off_subspace(self, t_s: Tensor) -> Tensor:
        """T_S - Pi(T_S): what eqs. 3-4 move into T_perp."""
        return t_s - subspace.project(t_s, self.basis)

    @torch.no_grad()
    def project_(self, embeddings) -> None:
        """T_S = Pi(T_S) on every embedding given."""
        subspace.project_embeddings_(embeddings, self.basis)

    @torch.no_grad()
    def decay_(self, embeddings, decay: float) -> None:
        """T_perp's share of an AdamW step's decay, taken by T_S (`subspace.decay_perp_share_`)."""
        subspace.decay_perp_share_(embeddings, self.perp, decay)

    @torch.no_grad()
    def resync_(self, avg: Tensor, outer_lr: float, embeddings) -> None:
        """Eqs. 3-4 from the outer step's aggregate of T_S alone (`subspace.resync_embedding_`),
        then T_S = Pi(T_S) on every embedding given."""
        subspace.resync_embedding_(None, self.perp, avg, outer_lr, self.basis)
        self.project_(embeddings)


class BoundaryCodec:
    """The protocol of a stage-boundary codec, with the defaults a codec may keep.

    A codec must give `width` and the two pure functions `encode_hidden` / `decode_hidden`; the rest
    has defaults. One instance per stage of a replica, built by `from_config` (every stage of a
    replica alike); `split` is the fleet's embedding split (or None), set by StageAlgorithm.

    - forward: `encode(outputs)` / `decode(message)` (the engine's module and the per-replica
      simulator), made of `encode_hidden` / `decode_hidden`, which take the codec's `tensors()` and
      T_perp as arguments so that the batched simulator can vmap them over a row's replicas;
    - backward: autograd's gradient of the message's floating-point tensors (`grad_spec`; the
      module docstring says how a codec changes it);
    - wire size: `message_spec` / `grad_spec` per micro-batch (the stage links allocate receives and
      the copy engines size their slots from them; the meter counts what is sent);
    - state: `tensors()`, built from the config on every rank alike (never sent, never saved);
      T_perp is the embedding split's (StageAlgorithm's state_dict, checkpoints, elastic transfer);
    - TE adaptation: `embedding_split` (the fleet's, asked of the compressed replicas' codec class)
      and `after_inner_step` (what the codec does to the stage's weights after each inner step).
    """

    name: ClassVar[str] = ""
    """Its key in `CODECS` (set by `register_codec`)."""
    compressed: ClassVar[bool] = True
    """Whether the message is anything but the hidden state in the wire dtype."""
    sends_ids: ClassVar[bool] = False
    """Whether the token ids travel with the hidden part (a decoder that reads T_perp[x] needs them)."""

    def __init__(self, hidden_size: int, vocab_size: int, wire_dtype: torch.dtype = torch.float32):
        self.hidden_size = hidden_size
        self.wire_dtype = wire_dtype
        self.id_dtype = {1: torch.int8, 2: torch.int16, 4: torch.int32}[sizes.id_bytes(vocab_size)]
        self.split: EmbeddingSplit | None = None

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_config(cls, sub, *, replica: int, num_replicas: int, hidden_size: int, vocab_size: int,
                    wire_dtype: torch.dtype, device) -> "BoundaryCodec":
        """This replica's codec from `sub` (`hetloco.subspace`); the same on every stage and rank."""
        return cls(hidden_size, vocab_size, wire_dtype)

    @classmethod
    def embedding_split(cls, sub, num_replicas: int, hidden_size: int, device) -> EmbeddingSplit | None:
        """The fleet's TE adaptation when its compressed replicas use this codec, or None (T_S is
        then the whole table, and no stage holds T_perp)."""
        return None

    # ------------------------------------------------------------------ wire
    @property
    def width(self) -> int:
        """Elements per token of the hidden part of the message."""
        raise NotImplementedError

    def message_spec(self, micro_batch: int, seq_len: int) -> Spec:
        """(shape, dtype) of each tensor `encode` puts on the wire, in order."""
        spec = [((micro_batch, seq_len, self.width), self.wire_dtype)]
        if self.sends_ids:
            id_bytes = torch.empty((), dtype=self.id_dtype).element_size()
            spec.append(((micro_batch, seq_len * id_bytes), torch.uint8))
        return spec

    def grad_spec(self, micro_batch: int, seq_len: int) -> Spec:
        """What travels backward: the gradient of each floating-point tensor of the message."""
        return [s for s in self.message_spec(micro_batch, seq_len) if s[1].is_floating_point]

    def nbytes(self, micro_batch: int, seq_len: int) -> tuple[int, int]:
        """(forward, backward) bytes one micro-batch puts on one boundary."""
        def total(spec: Spec) -> int:
            return sum(torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size() for shape, dt in spec)
        return total(self.message_spec(micro_batch, seq_len)), total(self.grad_spec(micro_batch, seq_len))

    # ------------------------------------------------------------------ forward
    @property
    def perp(self) -> Tensor | None:
        """T_perp, read through the embedding split (None when the fleet has none)."""
        return None if self.split is None else self.split.perp

    def encode(self, outputs):
        """A stage's (hidden, ids) as its message."""
        hidden, ids = outputs
        message = self.encode_hidden(self.tensors(), hidden, ids, self.perp, self.wire_dtype)
        if not self.sends_ids:
            return message
        # Ids travel as the bytes of the narrowest integer type: NCCL has no int16, so they
        # are viewed as uint8 on the wire (same bytes) and viewed back on receipt.
        return message, ids.to(self.id_dtype).view(torch.uint8)

    def decode(self, message):
        """The previous stage's message as (X^, ids); ids None when they did not travel."""
        if not self.sends_ids:
            return self.decode_hidden(self.tensors(), message, None, self.perp), None
        hidden, ids = message
        ids = ids.view(self.id_dtype).long()
        return self.decode_hidden(self.tensors(), hidden, ids, self.perp), ids

    # ------------------------------------------------------------------ pure functions (vmapped)
    def tensors(self) -> dict[str, Tensor]:
        """The tensors the pure functions read besides T_perp (fixed from construction on)."""
        return {}

    @staticmethod
    def encode_hidden(tensors: dict[str, Tensor], hidden: Tensor, ids: Tensor | None, perp: Tensor | None,
                      wire_dtype: torch.dtype) -> Tensor:
        """The hidden part of the message, in `wire_dtype`."""
        raise NotImplementedError

    @staticmethod
    def decode_hidden(tensors: dict[str, Tensor], message: Tensor, ids: Tensor | None,
                      perp: Tensor | None) -> Tensor:
        """X^ from the hidden part of a message, in the residual stream's dtype (`model.residual_dtype`)."""
        raise NotImplementedError

    @classmethod
    def stack(cls, codecs: Sequence["BoundaryCodec | None"], widths: Sequence[int]) -> dict[str, Tensor]:
        """The `tensors()` of a row's replicas stacked [M, ...] for vmap; None marks a replica of
        another codec (its row is computed on zeros and discarded). `widths`: the widths of the
        replicas of this codec in the whole row (a sharded row's other blocks' too). Default: every
        replica's tensors have one shape."""
        like = next(c for c in codecs if c is not None).tensors()
        out = {}
        for key, ref in like.items():
            rows = [torch.zeros_like(ref) if c is None else c.tensors()[key] for c in codecs]
            if any(r.shape != ref.shape for r in rows):
                raise ValueError(f"codec {cls.name!r}: replicas' {key} differ in shape; the batched simulator "
                                 "stacks them (override BoundaryCodec.stack, or simulate --per-replica)")
            out[key] = torch.stack(rows)
        return out

    # ------------------------------------------------------------------ inner loop
    def after_inner_step(self, embeddings, layers) -> None:
        """After each optimizer step of a SparseLoCo run, on the stage's T_S copies and DecoderLayers."""


CODECS: dict[str, type[BoundaryCodec]] = {}
"""Every registered codec by name: `hetloco.subspace.codec` chooses among them."""


def register_codec(name: str) -> Callable[[type[BoundaryCodec]], type[BoundaryCodec]]:
    """Class decorator: `cls` becomes `CODECS[name]`. Another class under a taken name is an error;
    the same class again (its module imported anew) replaces it."""
    def register(cls: type[BoundaryCodec]) -> type[BoundaryCodec]:
        if name in CODECS and CODECS[name].__qualname__ != cls.__qualname__:
            raise ValueError(f"boundary codec {name!r} is already registered ({CODECS[name].__qualname__})")
        cls.name = name
        CODECS[name] = cls
        return cls
    return register


def codec_class(name: str) -> type[BoundaryCodec]:
    """`CODECS[name]`, or a ConfigError naming the key and what is registered."""
    if name not in CODECS:
        from .config import ConfigError  # not at the top: config loads sparseloco/, which pipe/module never may

        raise ConfigError(f"hetloco.subspace.codec = {name!r} is not a registered boundary codec "
                          f"(registered: {', '.join(sorted(CODECS))}; boundary.register_codec adds one)")
    return CODECS[name]


def codec_name(sub, replica: int, num_replicas: int) -> str:
    """The codec replica `replica` uses: `sub.codec` when it is compressed, else identity."""
    return sub.codec if sub.compressed(replica, num_replicas) else "identity"


@register_codec("identity")
class IdentityCodec(BoundaryCodec):
    """The hidden state in the wire dtype (an uncompressed replica)."""

    compressed = False
    basis = None
    """No U (read by code that asks any codec for one)."""

    @property
    def width(self) -> int:
        return self.hidden_size

    @staticmethod
    def encode_hidden(tensors, hidden, ids, perp, wire_dtype):
        return hidden.to(wire_dtype)

    @staticmethod
    def decode_hidden(tensors, message, ids, perp):
        return message.to(residual_dtype(message))


@register_codec("subspace")
class SubspaceCodec(BoundaryCodec):
    """X~ = (X - T_perp[x]) U with the ids; X^ = X~ U^T + T_perp[x] (paper eq. 1).

    U is this replica's basis (k = d / its ratio); the fleet's embedding split lives in the
    smallest compressed replica's subspace, which every replica's contains (bases of one seed
    nest). `every_step` / `residual` are the ablations `subspace.project_embedding_every_step`
    and Table 5b's `project_residual_weights`, both onto this replica's U."""

    sends_ids = True

    def __init__(self, hidden_size: int, vocab_size: int, basis: Tensor, wire_dtype: torch.dtype = torch.float32,
                 every_step: bool = False, residual: bool = False):
        super().__init__(hidden_size, vocab_size, wire_dtype)
        self.basis = basis
        self.every_step, self.residual = every_step, residual

    @classmethod
    def from_config(cls, sub, *, replica, num_replicas, hidden_size, vocab_size, wire_dtype, device):
        k = sizes.subspace_dim(hidden_size, sub.ratio_for(replica, num_replicas))
        basis = subspace.make_basis(hidden_size, k, sub.seed).to(device)
        return cls(hidden_size, vocab_size, basis, wire_dtype, sub.project_embedding_every_step,
                   sub.project_residual_weights)

    @classmethod
    def embedding_split(cls, sub, num_replicas, hidden_size, device):
        basis = subspace.split_basis(sub, num_replicas, hidden_size, sub.seed)
        return None if basis is None else EmbeddingSplit(basis.to(device))

    @property
    def width(self) -> int:
        return self.basis.shape[1]

    def tensors(self) -> dict[str, Tensor]:
        return {"basis": self.basis}

    @staticmethod
    def encode_hidden(tensors, hidden, ids, perp, wire_dtype):
        return subspace.encode(hidden.float(), ids, perp, tensors["basis"]).to(wire_dtype)

    @staticmethod
    def decode_hidden(tensors, message, ids, perp):
        hidden = subspace.decode(message.float(), ids, perp, tensors["basis"])
        return hidden.to(residual_dtype(hidden))

    @classmethod
    def stack(cls, codecs, widths):
        """Bases zero-padded to the row's largest k: the extra columns carry zeros both ways, so
        replicas of different ratios share one batched codec (and a replica of another codec
        computes on a zero basis, its row discarded)."""
        ref = next(c for c in codecs if c is not None).basis
        basis = torch.zeros(len(codecs), ref.shape[0], max(widths), device=ref.device)
        for m, c in enumerate(codecs):
            if c is not None:
                basis[m, :, :c.width] = c.basis
        return {"basis": basis}

    @torch.no_grad()
    def after_inner_step(self, embeddings, layers) -> None:
        if self.every_step:
            subspace.project_embeddings_(embeddings, self.basis)
        if self.residual:
            subspace.project_residual_weights_(layers, self.basis)


def build_codec(sub, *, replica: int, num_replicas: int, hidden_size: int, vocab_size: int,
                wire_dtype: torch.dtype, device) -> BoundaryCodec:
    """Replica `replica`'s codec from the config (`codec_name`)."""
    return codec_class(codec_name(sub, replica, num_replicas)).from_config(
        sub, replica=replica, num_replicas=num_replicas, hidden_size=hidden_size, vocab_size=vocab_size,
        wire_dtype=wire_dtype, device=device)


def fleet_split(sub, num_replicas: int, hidden_size: int, device) -> EmbeddingSplit | None:
    """The fleet's embedding split: asked of the compressed replicas' codec, None when none compresses."""
    if not sub.any_compressed:
        return None
    return codec_class(sub.codec).embedding_split(sub, num_replicas, hidden_size, device)
