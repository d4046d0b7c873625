"""The rounds of one elastic exchange attempt (transport/elastic.py): the frames each replica sends
(hello, payload, vote, each with its MAC under the fleet secret) and the decisions read from them.

Pure functions of the gathered bytes, with no process group and no torchft: every replica runs them
on the same bytes, so every replica reaches the same decisions (who is heard, the fleet's step and
chain, whose payload is accepted), and a test drives them without a fleet.
"""
from __future__ import annotations

import collections
import hashlib
import json
import struct
from dataclasses import dataclass

import torch

from ..sparseloco.payload import FLAG_FINITE, HEADER
from .auth import MAC_BYTES, tag, verify

_HELLO = struct.Struct("<4sBBHqII32s64s")  # magic, version, flags, name length, step, length, fingerprint, chain, name
_HELLO_BYTES = 128
_VOTE_BYTES = 32  # a SHA-256 digest of the accepted set
_MAGIC, _VERSION = b"HLE1", 1
_CONTRIBUTING, _OK = 1, 2


@dataclass(frozen=True)
class Hello:
    """The first message of an attempt: who this is, where it stands, what it will send."""

    rank: int
    name: str
    step: int
    contributing: bool
    ok: bool
    length: int
    fingerprint: int
    chain: bytes
    mac: bytes


def pack_hello(name: str, step: int, contributing: bool, ok: bool, length: int, fingerprint: int,
                chain: bytes) -> bytes:
    flags = (_CONTRIBUTING if contributing else 0) | (_OK if ok else 0)
    raw = name.encode()
    body = _HELLO.pack(_MAGIC, _VERSION, flags, len(raw), step, length, fingerprint, chain, raw)
    return body.ljust(_HELLO_BYTES, b"\0")


def _unpack_hello(rank: int, body: bytes, mac: bytes) -> Hello | None:
    magic, version, flags, n, step, length, fp, chain, raw = _HELLO.unpack_from(body)
    if magic != _MAGIC or version != _VERSION or n > 64:
        return None
    try:
        name = raw[:n].decode()
    except UnicodeDecodeError:
        return None
    return Hello(rank, name, step, bool(flags & _CONTRIBUTING), bool(flags & _OK), length, fp, chain, mac)


def _mode(values):
    """Most common value; ties go to the smallest, so every replica picks the same one."""
    counts = collections.Counter(values)
    best = max(counts.values())
    return min(v for v, c in counts.items() if c == best)


def _payload_key(body: bytes) -> tuple:
    """A payload's header without its flags: what must agree for payloads to be summed."""
    magic, version, _flags, _zero, fp, length = HEADER.unpack_from(body)
    return (magic, version, fp, length)


def excluded_copy(payload: torch.Tensor) -> torch.Tensor:
    """`payload` with the finite flag cleared and a zero body: `finish` applies no update for it but
    still restores the parameters to the synced ones."""
    magic, version, flags, zero, fp, length = HEADER.unpack_from(payload[: HEADER.size].numpy().tobytes())
    out = torch.zeros_like(payload)
    header = HEADER.pack(magic, version, flags & ~FLAG_FINITE, zero, fp, length)
    out[: HEADER.size] = torch.frombuffer(bytearray(header), dtype=torch.uint8)
    return out


def payload_fingerprint(payload: torch.Tensor) -> int:
    """The fingerprint in `payload`'s header, what its hello announces; 0 when it has no header
    (a replica that takes part without a payload)."""
    if payload.numel() < HEADER.size:
        return 0
    return HEADER.unpack_from(payload[: HEADER.size].numpy().tobytes())[4]


def read_hellos(secret: bytes, frames: list[bytes]) -> tuple[dict[int, Hello], list[tuple[str, str]], list[int]]:
    """The hellos that authenticate, by quorum position; (who, why) for those dropped; and the
    payload lengths announced by every hello that parses, signed or not (see `plan`)."""
    heard: dict[int, Hello] = {}
    dropped: list[tuple[str, str]] = []
    lengths: list[int] = []
    names: set[str] = set()
    for r, raw in enumerate(frames):
        body, mac = raw[:_HELLO_BYTES], raw[_HELLO_BYTES:]
        h = _unpack_hello(r, body, mac)
        if h is not None:
            lengths.append(h.length)
        if h is None or not verify(secret, mac, b"hello", body):
            dropped.append((f"quorum position {r}", "its messages are not signed with the fleet secret"))
        elif h.name in names:
            dropped.append((f"quorum position {r}", f"a second replica named {h.name!r}"))
        else:
            heard[r] = h
            names.add(h.name)
    return heard, dropped, lengths


def refused(heard: dict[int, Hello], n: int) -> bool:
    """Whether the replicas that authenticate with this one's secret are a minority of the quorum
    (a tie goes to the side holding quorum position 0)."""
    return 2 * len(heard) < n or (2 * len(heard) == n and 0 not in heard)


@dataclass(frozen=True)
class Plan:
    """What the hellos decide before any payload moves."""

    step: int
    """The fleet's step: the highest among the heard; a replica below it is behind."""
    chain: bytes
    """The fleet's history: the most common chain among replicas at that step that are ok."""
    candidates: dict[int, Hello]
    """Contributors at the fleet's step with the fleet's chain, by quorum position."""
    length: int
    """Payload bytes of this round: the most common length announced by any hello. Unsigned hellos
    count too, so that a replica that hears no one (a wrong secret) still posts receives of the
    size the others send: gloo aborts the process on a message larger than the receive posted
    for it (gloo/transport/tcp/pair.cc, "Received data size doesn't match expected size")."""


def plan(heard: dict[int, Hello], own_chain: bytes, lengths: list[int]) -> Plan:
    step = max(h.step for h in heard.values())
    live = [h for h in heard.values() if h.ok and h.step == step]
    chain = _mode([h.chain for h in live]) if live else own_chain
    candidates = {h.rank: h for h in live if h.contributing and h.chain == chain}
    return Plan(step, chain, candidates, _mode(lengths))


def accept(secret: bytes, p: Plan, frames: list[torch.Tensor]) -> tuple[list[tuple[str, int]], list[tuple[str, str]]]:
    """Candidates whose payload authenticates and whose header (magic, version, fingerprint,
    length) is the most common one, as sorted (name, position); and (who, why) for those dropped."""
    keys: dict[int, tuple] = {}
    dropped: list[tuple[str, str]] = []
    for r, h in sorted(p.candidates.items()):
        body, mac = frames[r][: p.length], frames[r][p.length:].numpy().tobytes()
        if h.length != p.length or p.length < HEADER.size:
            dropped.append((h.name, f"payload of {h.length} bytes, the fleet's are {p.length}"))
        elif not verify(secret, mac, b"payload", h.mac, body.numpy()):
            dropped.append((h.name, "payload does not authenticate"))
        else:
            keys[r] = _payload_key(body[: HEADER.size].numpy().tobytes())
    fleet = _mode(list(keys.values())) if keys else None
    for r in sorted(keys):
        if keys[r] != fleet:
            dropped.append((p.candidates[r].name, f"payload header {keys[r]} differs from the fleet's {fleet}"))
    return sorted((p.candidates[r].name, r) for r in keys if keys[r] == fleet), dropped


def accepted_digest(accepted: list[tuple[str, int]], frames: list[torch.Tensor], length: int) -> bytes:
    return hashlib.sha256(json.dumps([[nm, frames[r][length:].numpy().tobytes().hex()]
                                      for nm, r in accepted]).encode()).digest()


def payload_frame(secret: bytes, hello_mac: bytes, payload: torch.Tensor | None, length: int) -> torch.Tensor:
    """payload + its MAC bound to the sender's hello; zeros (authenticating as nothing) if none."""
    frame = torch.zeros(length + MAC_BYTES, dtype=torch.uint8)
    if payload is not None:
        frame[:length] = payload
        frame[length:] = torch.frombuffer(bytearray(tag(secret, b"payload", hello_mac, payload.numpy())),
                                          dtype=torch.uint8)
    return frame


def committed_bytes(peers: int, payload_bytes: int) -> int:
    """Bytes one stage rank sends (and receives) in an attempt that commits with `peers` other
    participants: the hello, payload and vote rounds of `ElasticTransport._rounds`, each frame with its MAC."""
    return peers * (_HELLO_BYTES + MAC_BYTES + payload_bytes + MAC_BYTES + _VOTE_BYTES + MAC_BYTES)
