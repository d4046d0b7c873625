"""`pipe.copy_engine`'s primitives on the CPU, so its protocol (slots, sequence numbers, ready and
free flags, flow control, message layout) runs under the real schedules in CPU tests.

What stands in for what: a file in /dev/shm that the peer process maps for CUDA IPC memory; a
thread per stream, running its work in order, for a CUDA stream; a poll of the flag by that thread
for cuStreamWaitValue32; a store for cuStreamWriteValue32 (x86 keeps stores in order, as the
driver's fence does). The compute "stream" is the calling thread, which is synchronous on the
CPU, so `after_compute` has nothing to wait for. A wait that outlasts `timeout` fails the
stream's later work instead of hanging the test.
"""
from __future__ import annotations

import os
import queue
import threading
import time

import torch


class _Stream:
    def __init__(self, timeout: float):
        self.timeout, self.error = timeout, None
        self._work: queue.Queue = queue.Queue()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            fn = self._work.get()
            if self.error is None:
                try:
                    fn()
                except BaseException as e:  # noqa: BLE001 - surfaced by the next wait on this stream
                    self.error = e
            elif isinstance(fn, _Done):
                fn.event.set()

    def put(self, fn) -> None:
        self._work.put(fn)


class _Done:
    def __init__(self, stream: _Stream):
        self.stream, self.event = stream, threading.Event()

    def __call__(self) -> None:
        self.event.set()

    def wait(self) -> None:
        if not self.event.wait(self.stream.timeout):
            raise TimeoutError(f"host stream work not done after {self.stream.timeout} s")
        if self.stream.error is not None:
            raise RuntimeError(f"host stream failed: {self.stream.error}") from self.stream.error


class HostStreamsBackend:
    def __init__(self, tag: str, rank: int, timeout: float = 60.0):
        self.dir, self.rank, self.timeout = os.path.join("/dev/shm", f"hetloco-test-{tag}"), rank, timeout
        os.makedirs(self.dir, exist_ok=True)
        self._paths: dict[int, str] = {}

    def zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        path = os.path.join(self.dir, f"rank{self.rank}-{len(self._paths)}")
        with open(path, "wb") as fh:
            fh.truncate(numel * torch.empty(0, dtype=dtype).element_size())
        t = torch.from_file(path, shared=True, size=numel, dtype=dtype)
        self._paths[t.data_ptr()] = path
        return t

    def export(self, tensor: torch.Tensor) -> str:
        return self._paths[tensor.data_ptr()]

    def map_peer(self, path: str, dtype: torch.dtype, numel: int, peer: int) -> torch.Tensor:
        return torch.from_file(path, shared=True, size=numel, dtype=dtype)

    def stream(self) -> _Stream:
        return _Stream(self.timeout)

    def after_compute(self, stream: _Stream) -> None:
        pass

    def wait_geq(self, stream: _Stream, flags: torch.Tensor, i: int, value: int) -> None:
        def poll():
            deadline = time.monotonic() + stream.timeout
            while ((int(flags[i]) - value + 2**31) % 2**32) - 2**31 < 0:  # int32 wrap, as GEQ
                if time.monotonic() > deadline:
                    raise TimeoutError(f"flag {i} stayed below {value} for {stream.timeout} s")
                time.sleep(0.0002)
        stream.put(poll)

    def write(self, stream: _Stream, flags: torch.Tensor, i: int, value: int) -> None:
        stream.put(lambda: flags.__setitem__(i, value))

    def copy(self, stream: _Stream, dst: torch.Tensor, src: torch.Tensor) -> None:
        stream.put(lambda: dst.copy_(src))

    def record(self, stream: _Stream) -> _Done:
        done = _Done(stream)
        stream.put(done)
        return done
