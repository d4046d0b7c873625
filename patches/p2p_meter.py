"""Count the bytes of every pipeline send and receive.

Wraps: `deepspeed.runtime.pipe.p2p.send` and `deepspeed.runtime.pipe.p2p.recv` (checked against
DeepSpeed 0.19.8). PipelineEngine calls them through the module (`p2p.send(...)`), so wrapping
the module attributes sees every activation, gradient and tensor-meta message. The kind
(activation / activation_grad) is set by the engine around its send/recv instructions.
"""
import deepspeed.runtime.pipe.p2p as ds_p2p

from hetloco_ds.meter import get_meter

_SEND = ds_p2p.send
_RECV = ds_p2p.recv


def _send(tensor, dest_stage, async_op=False):
    get_meter().sent(tensor)
    return _SEND(tensor, dest_stage, async_op=async_op)


def _recv(tensor, src_stage, async_op=False):
    result = _RECV(tensor, src_stage, async_op=async_op)
    get_meter().recv(tensor)
    return result


def apply() -> None:
    if ds_p2p.send is not _send:
        ds_p2p.send = _send
        ds_p2p.recv = _recv
