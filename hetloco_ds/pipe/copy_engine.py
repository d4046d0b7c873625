"""Stage links inside one host moved by the GPUs' copy engines: a waiting receive holds no SM.

NCCL moves a point-to-point message with a kernel, and the overlapped schedule posts its receives
ahead, so that kernel waits on the device beside the stage's compute. Even at one CTA it slows the
GEMMs (bench/results/resident_link_h100.json: a persistent GEMM's grid runs in two waves when one
SM is taken). Here nothing waits on an SM:

* Each directed link (sender rank -> receiver rank) has `depth` message slots and `depth` "ready"
  flags in the receiver's memory, and `depth` "free" flags in the sender's memory, all shared once
  at start through CUDA IPC and mapped into the peer's own device context.
* Send (message `seq`, slot `seq % depth`), on the link's send stream after the compute that made the
  message: wait until free[slot] >= seq - depth + 1 (the receiver has copied message seq - depth
  out), copy the tensors into the peer's slot (a peer copy over NVLink or PCIe), write
  ready[slot] = seq + 1.
* Receive, posted ahead on the link's receive stream: wait until ready[slot] >= seq + 1, copy the
  slot into fresh tensors, write the sender's free[slot] = seq + 1. The compute stream waits on that
  stream's event only where it uses the message.
* The waits and writes are the driver's stream memory operations (cuStreamWaitValue32,
  cuStreamWriteValue32): the GPU's front end polls the flag, no kernel runs. A write carries a
  memory fence, so the slot's bytes are visible before its flag.

Messages keep their order per direction, as on a process group. A send needs only that message
`seq - depth` has been received; NCCL's rendezvous needs message `seq`'s own receive posted, so
any schedule that runs on NCCL runs here with depth >= 1 (depth 2 lets a copy-out and the next copy-in
overlap). Both ranks of a link must share a host and see each other's GPU.

Setting up is collective and all-or-nothing: every rank learns whether every rank of the job could
map its peers, and if one could not, all raise `CopyEngineUnavailable` together (naming that rank),
so a caller that may fall back to a process group does so on every rank at once.

A peer that dies leaves its neighbour's wait pending on the device for good, as a hung NCCL
receive does; `hetloco-ds train`'s watchdog (hetloco_ds/watchdog.py) sees the stalled progress
and ends the job with a line naming the rank.
"""
from __future__ import annotations

import ctypes
from typing import Sequence

import torch
import torch.distributed as tdist

ALIGN = 256  # bytes: each tensor of a message starts aligned for any dtype and for the copy engines
CU_STREAM_WAIT_VALUE_GEQ = 0x0  # wait until (int32)(*addr - value) >= 0: wrap-safe counters


class CopyEngineUnavailable(RuntimeError):
    """Some rank of the job could not set up its copy-engine links; raised on every rank at once."""


class StreamMemOps:
    """cuStreamWaitValue32 / cuStreamWriteValue32 from the CUDA driver. torch exposes a write
    (`_SymmetricMemory.stream_write_value32`) but no wait."""

    def __init__(self):
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            self._wait, self._write = lib.cuStreamWaitValue32_v2, lib.cuStreamWriteValue32_v2
        except (OSError, AttributeError) as e:
            raise RuntimeError(f"the copy-engine link transport needs the CUDA driver's stream memory "
                               f"operations (libcuda.so.1, cuStreamWaitValue32_v2): {e}") from e
        for fn in (self._wait, self._write):
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]

    def wait_geq(self, stream: torch.cuda.Stream, ptr: int, value: int) -> None:
        self._check(self._wait(stream.cuda_stream, ptr, value & 0xFFFFFFFF, CU_STREAM_WAIT_VALUE_GEQ),
                    "cuStreamWaitValue32")

    def write(self, stream: torch.cuda.Stream, ptr: int, value: int) -> None:
        # flags 0: a memory fence first, so what the stream wrote before the flag is seen before it
        self._check(self._write(stream.cuda_stream, ptr, value & 0xFFFFFFFF, 0), "cuStreamWriteValue32")

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} returned CUresult {rc}")


class CudaBackend:
    """What the protocol needs from a device: memory a peer process on the host can map, ordered
    queues of work (streams), flag waits and writes, copies. The CUDA one: the caching allocator's
    memory shared through CUDA IPC, CUDA streams, the driver's stream memory operations."""

    def __init__(self, device: torch.device):
        if device.type != "cuda":
            raise ValueError(f'hetloco.pipeline.link_transport = "copy_engine" needs CUDA GPUs; this rank runs on {device}')
        self.device, self.ops = device, StreamMemOps()
        # A driver may refuse stream memory operations (CUresult 801) only when they are first
        # issued; find out here, where the job can still choose another transport.
        flag, s = self.zeros(1, torch.int32), self.stream()
        self.write(s, flag, 0, 1)
        self.wait_geq(s, flag, 0, 1)
        s.synchronize()

    def zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        t = torch.zeros(numel, dtype=dtype, device=self.device)
        torch.cuda.synchronize(self.device)  # zeroed before any peer can map and read it
        return t

    def export(self, tensor: torch.Tensor) -> tuple:
        """The storage's CUDA IPC handle; the tensor must stay alive while the peer uses it."""
        return (self.device.index, tensor.untyped_storage()._share_cuda_())

    def map_peer(self, exported: tuple, dtype: torch.dtype, numel: int, peer: int) -> torch.Tensor:
        """The peer's tensor, mapped into this process's context on this rank's own device (not the
        peer's device index, which may name another GPU or none here): copies and flag writes then
        run on this device's streams and reach the peer's memory over NVLink or PCIe."""
        peer_gpu, handle = exported
        # indices compare only where both ranks see the same GPUs (one per rank: both say 0)
        if peer_gpu != self.device.index and (peer_gpu >= torch.cuda.device_count()
                                              or not torch.cuda.can_device_access_peer(self.device, peer_gpu)):
            raise RuntimeError(f'hetloco.pipeline.link_transport = "copy_engine": GPU {self.device.index} cannot '
                               f"reach GPU {peer_gpu} of rank {peer} (no NVLink or PCIe peer access)")
        storage = torch.UntypedStorage._new_shared_cuda(self.device.index, *handle[1:])
        return torch.empty(0, dtype=dtype, device=self.device).set_(storage, 0, (numel,), (1,))

    def stream(self):
        return torch.cuda.Stream(self.device)

    def after_compute(self, stream) -> None:
        """`stream`'s later work waits for what the compute stream has been given so far."""
        stream.wait_stream(torch.cuda.current_stream(self.device))

    def wait_geq(self, stream, flags: torch.Tensor, i: int, value: int) -> None:
        self.ops.wait_geq(stream, flags.data_ptr() + i * flags.element_size(), value)

    def write(self, stream, flags: torch.Tensor, i: int, value: int) -> None:
        self.ops.write(stream, flags.data_ptr() + i * flags.element_size(), value)

    def copy(self, stream, dst: torch.Tensor, src: torch.Tensor) -> None:
        """The caller keeps both alive until the work recorded after it has been waited on (StageLinks
        holds a message until then). No record_stream: it would hold the memory until everything
        queued on `stream` at the time of the free is done, including waits for later messages."""
        with torch.cuda.stream(stream):
            dst.copy_(src)

    def record(self, stream) -> "_StreamWork":
        done = torch.cuda.Event()
        done.record(stream)
        return _StreamWork(done, self.device)


class _StreamWork:
    """A transfer's completion, as a process group's work: `wait()` makes the caller's current
    stream wait for it (no host wait)."""

    def __init__(self, event: torch.cuda.Event, device: torch.device):
        self.event, self.device = event, device

    def wait(self) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.event)


def layout(spec: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> tuple[list[int], int]:
    """Byte offset of each tensor of a message in its slot, and the slot size the message needs."""
    offsets, end = [], 0
    for shape, dtype in spec:
        offsets.append(end)
        end += _aligned(_nbytes(shape, dtype))
    return offsets, max(end, ALIGN)


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _nbytes(shape, dtype: torch.dtype) -> int:
    return torch.Size(shape).numel() * dtype.itemsize


class _Link:
    def __init__(self, slots: torch.Tensor, ready: torch.Tensor, free: torch.Tensor, slot_bytes: int, stream):
        self.slots, self.ready, self.free = slots, ready, free  # uint8 [depth * slot_bytes], int32 [depth] x 2
        self.slot_bytes = slot_bytes  # the receiver's
        self.stream = stream
        self.seq = 0


class CopyEngineLinks:
    """The copy-engine links of this rank: one per direction of every stage link it is on.

    `replica_ranks[m]` lists replica m's global ranks by stage; every rank of the world constructs
    it at the same point (one all-gather of the shared-memory handles, one of the mapping outcomes;
    `CopyEngineUnavailable` on every rank if any rank failed).
    `slot_bytes`: the largest message this rank receives (`layout`); a sender fills its receiver's
    slots. `backend`: the device's primitives (`CudaBackend` for `device`'s GPU when None)."""

    def __init__(self, replica_ranks: Sequence[Sequence[int]], me: int, device: torch.device,
                 slot_bytes: int, depth: int = 2, backend=None):
        slot_bytes = _aligned(slot_bytes)  # every slot starts aligned too
        self.depth = depth
        pairs = [(a, b) for ranks in replica_ranks for a, b in zip(ranks, ranks[1:])]
        directed = [d for a, b in pairs for d in ((a, b), (b, a)) if me in d]  # (sender, receiver)
        owned: dict[tuple, torch.Tensor] = {}  # kept alive for the peers that map them
        exports, failed = {}, None
        try:
            self.backend = backend if backend is not None else CudaBackend(device)
            for src, dst in directed:
                if dst == me:  # the receiver holds the slots and their ready flags
                    owned["slots", src, dst] = self.backend.zeros(depth * slot_bytes, torch.uint8)
                    owned["ready", src, dst] = self.backend.zeros(depth, torch.int32)
                else:  # the sender holds the free flags
                    owned["free", src, dst] = self.backend.zeros(depth, torch.int32)
            exports = {key: self.backend.export(t) for key, t in owned.items()}
        except Exception as e:  # noqa: BLE001 - every rank must learn of any failure, or its peers wait for good
            failed = str(e)
        every: list = [None] * tdist.get_world_size()
        tdist.all_gather_object(every, (slot_bytes, exports, failed))
        _agree([f for _, _, f in every])
        self._owned = owned
        self.out: dict[int, _Link] = {}  # receiver rank -> link I send on
        self.inb: dict[int, _Link] = {}  # sender rank -> link I receive on
        try:
            for src, dst in directed:
                peer = dst if src == me else src
                peer_slot_bytes, theirs, _ = every[peer]
                if src == me:
                    self.out[dst] = _Link(
                        self.backend.map_peer(theirs["slots", src, dst], torch.uint8, depth * peer_slot_bytes, peer),
                        self.backend.map_peer(theirs["ready", src, dst], torch.int32, depth, peer),
                        owned["free", src, dst], peer_slot_bytes, self.backend.stream())
                else:
                    self.inb[src] = _Link(owned["slots", src, dst], owned["ready", src, dst],
                                          self.backend.map_peer(theirs["free", src, dst], torch.int32, depth, peer),
                                          slot_bytes, self.backend.stream())
        except Exception as e:  # noqa: BLE001 - as above
            failed = str(e)
        # also the barrier: every peer mapped before the first message may touch a flag
        mapped: list = [None] * tdist.get_world_size()
        tdist.all_gather_object(mapped, failed)
        _agree(mapped)

    def _views(self, link: _Link, slot: int, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        spec = [(tuple(t.shape), t.dtype) for t in tensors]
        offsets, need = layout(spec)
        if need > link.slot_bytes:
            raise ValueError(f"a {need}-byte message does not fit the copy-engine link's {link.slot_bytes}-byte slots")
        base = slot * link.slot_bytes
        return [link.slots[base + off: base + off + _nbytes(shape, dtype)].view(dtype).view(shape)
                for off, (shape, dtype) in zip(offsets, spec)]

    def send(self, tensors: Sequence[torch.Tensor], dst: int) -> list:
        link, b = self.out[dst], self.backend
        seq, slot = link.seq, link.seq % self.depth
        link.seq += 1
        b.after_compute(link.stream)  # the message is computed
        if seq >= self.depth:  # message seq - depth has left this slot
            b.wait_geq(link.stream, link.free, slot, seq - self.depth + 1)
        for view, t in zip(self._views(link, slot, tensors), tensors):
            b.copy(link.stream, view, t)
        b.write(link.stream, link.ready, slot, seq + 1)
        return [b.record(link.stream)]

    def recv(self, tensors: Sequence[torch.Tensor], src: int) -> list:
        link, b = self.inb[src], self.backend
        seq, slot = link.seq, link.seq % self.depth
        link.seq += 1
        b.after_compute(link.stream)  # the fresh tensors may reuse memory the compute has just released
        b.wait_geq(link.stream, link.ready, slot, seq + 1)
        for view, t in zip(self._views(link, slot, tensors), tensors):
            b.copy(link.stream, t, view)
        b.write(link.stream, link.free, slot, seq + 1)
        return [b.record(link.stream)]


def _agree(failures: Sequence[str | None]) -> None:
    """Every rank's setup outcome, gathered: raise on all of them if any failed."""
    for rank, failed in enumerate(failures):
        if failed is not None:
            raise CopyEngineUnavailable(f"rank {rank}: {failed}")
