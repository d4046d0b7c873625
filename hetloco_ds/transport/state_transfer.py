"""Live state transfer to a joining replica, authenticated both ways: a torchft CheckpointTransport.

Why not torchft's own `HTTPTransport` (torchft 0.2.0, torchft/checkpointing/http_transport.py):
it binds every interface (`server_address = ("", 0)`), serves the state to anyone who asks, and
the receiver unpickles whatever it is sent (`_streaming_load(f, weights_only=False)`), so anyone
who can pose as a peer can run code on a joining replica. This transport

* binds the address it is given (localhost by default);
* serves only a request that carries HMAC(secret, step, nonce, this server's URL): a requester
  without the fleet secret gets `403` and not one byte of state. Nonces are remembered, so a
  captured request cannot be replayed to this server; the URL binds it to this server;
* authenticates the response too, HMAC(secret, step, nonce, sha256(body)), before loading it,
  and loads with `weights_only=True` (tensors, numbers, strings, lists, dicts; no code).

The state is not encrypted: run over a network you trust, or through a tunnel, if the weights are
secret. It is serialised when torchft hands it over (`send_checkpoint`, inside the donor's quorum),
so the donor may change its parameters right after without tearing what the joiner receives.

torchft calls `send_checkpoint` on the donor and `recv_checkpoint` on the joiner from its quorum
thread; `disallow_checkpoint` (from `Manager.should_commit`) ends the window in which the staged
state is served.

By block (replicas of mixed depths). A transport built with `blocks` (the outer-sync blocks its
rank holds) publishes its replica's whole map, block -> the address of the rank holding it, as
its metadata, and serves `/checkpoint/STEP/BLOCK`: its state with every `{"blocks": {...}}` entry
of the user state cut down to that block. A joiner fetches each block it holds from whichever
rank of the donor replica holds it and merges them. `allow` stages a state lazily (built when a
request comes, inside the window), so that every up-to-date rank can serve, not only those
torchft assigned to a joiner of its own group rank.
"""
from __future__ import annotations

import collections
import functools
import hashlib
import io
import json
import logging
import secrets
import socket
import threading
import urllib.error
import urllib.request
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Sequence

import torch
from torchft.checkpointing import CheckpointTransport

from .auth import FleetRefused, tag, verify

log = logging.getLogger(__name__)
_SEEN_NONCES = 4096


def url_host(host: str) -> str:
    """`host` as it goes into a URL or a host:port string (IPv6 in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


class StateTransferError(RuntimeError):
    """The state could not be fetched or did not authenticate (not a refusal of this replica)."""


class AuthenticatedStateTransport(CheckpointTransport[dict]):
    """Serves this replica's staged state to fleet members; fetches a donor's state for this one.

    `bind`: the address the server listens on; `advertise`: the host peers connect to (default:
    `bind`, which must then not be a wildcard address).
    """

    def __init__(self, secret: bytes, bind: str = "127.0.0.1", advertise: str | None = None,
                 timeout: timedelta = timedelta(seconds=60), name: str = "", blocks: Sequence[int] | None = None) -> None:
        advertise = advertise or bind
        if advertise in ("", "0.0.0.0", "::"):
            raise ValueError(f"state transfer binds {bind!r}: give the address peers reach it at (advertise)")
        self._secret = secret
        self._timeout = timeout
        self._name = name
        self._cond = threading.Condition()
        self._staged: tuple[int, Callable[[], dict]] | None = None
        self._blocks = None if blocks is None else [int(b) for b in blocks]
        self.replica_urls: Callable[[], dict[int, str]] | None = None
        """With `blocks`: block -> address of every rank of this replica (default: this rank's own)."""
        self._seen: collections.OrderedDict[str, None] = collections.OrderedDict()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            timeout = outer._timeout.total_seconds()  # socket timeout: a stalled client cannot pin a thread

            def do_GET(self):  # noqa: N802 - http.server's name
                outer._serve(self)

            def log_message(self, fmt, *args):  # http.server writes every request to stderr otherwise
                log.debug("state transfer %s: " + fmt, self.client_address[0], *args)

        family = socket.AF_INET6 if ":" in bind else socket.AF_INET

        class Server(ThreadingHTTPServer):
            address_family = family
            daemon_threads = True

        self._server = Server((bind.strip("[]"), 0), Handler)
        self._url = f"http://{url_host(advertise)}:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="hetloco-state-transfer",
                                        daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ donor side
    @property
    def url(self) -> str:
        return self._url

    def metadata(self) -> str:
        """This server's URL; with `blocks`, the replica's block map as JSON."""
        if self._blocks is None:
            return self._url
        urls = self.replica_urls() if self.replica_urls is not None else {b: self._url for b in self._blocks}
        return json.dumps({"blocks": {str(b): u for b, u in sorted(urls.items())}})

    def send_checkpoint(self, dst_ranks, step: int, state_dict: dict, timeout: timedelta) -> None:
        self.allow(step, lambda: state_dict, replace=True)

    def allow(self, step: int, state_dict: Callable[[], dict], replace: bool = False) -> None:
        """Serve `state_dict()` (called at the first request, once: each of a joiner's ranks asks for
        its own blocks of the same state) to requests for `step` until `disallow_checkpoint`; a
        state already staged for `step` stays unless `replace`."""
        with self._cond:
            if replace or self._staged is None or self._staged[0] != int(step):
                self._staged = (int(step), functools.cache(state_dict))
            self._cond.notify_all()

    def disallow_checkpoint(self) -> None:
        with self._cond:
            self._staged = None

    def _serve(self, req: BaseHTTPRequestHandler) -> None:
        parts = req.path.split("/")
        nonce = req.headers.get("X-Hetloco-Nonce", "")
        mac = req.headers.get("X-Hetloco-Mac", "")
        who = f"{req.headers.get('X-Hetloco-Replica', '?')!r} at {req.client_address[0]}"
        if (len(parts) not in (3, 4) or parts[1] != "checkpoint" or not parts[2].lstrip("-").isdigit()
                or (len(parts) == 4 and not parts[3].isdigit())):
            req.send_error(404)
            return
        step = int(parts[2])
        block = int(parts[3]) if len(parts) == 4 else None
        try:
            mac_bytes = bytes.fromhex(mac)
        except ValueError:
            mac_bytes = b""
        if len(nonce) != 32 or not verify(self._secret, mac_bytes, b"state-request", req.path.encode(),
                                          nonce.encode(), self._url.encode()):
            log.warning("refused state transfer to %s: request not signed with the fleet secret", who)
            req.send_error(403, "fleet secret mismatch")
            return
        with self._cond:
            if nonce in self._seen:
                log.warning("refused state transfer to %s: replayed request", who)
                req.send_error(403, "replayed request")
                return
            self._seen[nonce] = None
            while len(self._seen) > _SEEN_NONCES:
                self._seen.popitem(last=False)
            # The joiner may ask before the donor's quorum thread has staged the state.
            self._cond.wait_for(lambda: self._staged is not None and self._staged[0] == step,
                                timeout=self._timeout.total_seconds())
            staged = self._staged
            body = None
            if staged is not None and staged[0] == step:
                # Built and serialised inside the window: disallow_checkpoint (the commit) waits for it.
                state = staged[1]()
                if block is not None:
                    state = only_block(state, block)
                if state is not None:
                    buf = io.BytesIO()
                    torch.save(state, buf)
                    body = buf.getvalue()
        if staged is None or staged[0] != step:
            req.send_error(409, f"no state staged for step {step}")
            return
        if body is None:
            req.send_error(404, f"this rank holds no block {block}")
            return
        resp_mac = tag(self._secret, b"state-response", req.path.encode(), nonce.encode(),
                       hashlib.sha256(body).digest())
        req.send_response(200)
        req.send_header("Content-Type", "application/octet-stream")
        req.send_header("Content-Length", str(len(body)))
        req.send_header("X-Hetloco-Mac", resp_mac.hex())
        req.end_headers()
        req.wfile.write(body)

    # ------------------------------------------------------------------ joiner side
    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> dict:
        """The donor's state for `step`: `metadata` is its URL (the whole state), or its replica's
        block map (each block this rank holds, from the rank that holds it, merged)."""
        if not metadata.startswith("{"):
            return self._fetch(metadata, f"/checkpoint/{step}", timeout)
        if self._blocks is None:
            raise StateTransferError("the donor sent a block map; this transport holds no blocks")
        urls = {int(b): u for b, u in json.loads(metadata)["blocks"].items()}
        missing = [b for b in self._blocks if b not in urls]
        if missing:
            raise StateTransferError(f"the donor replica holds no block {missing[0]} (it has {sorted(urls)})")
        merged = None
        for b in self._blocks:
            part = self._fetch(urls[b], f"/checkpoint/{step}/{b}", timeout)
            merged = part if merged is None else merge_blocks(merged, part)
        return merged

    def _fetch(self, url: str, path: str, timeout: timedelta) -> dict:
        nonce = secrets.token_hex(16)
        mac = tag(self._secret, b"state-request", path.encode(), nonce.encode(), url.encode())
        request = urllib.request.Request(f"{url}{path}", headers={
            "X-Hetloco-Nonce": nonce, "X-Hetloco-Mac": mac.hex(), "X-Hetloco-Replica": self._name})
        try:
            with urllib.request.urlopen(request, timeout=timeout.total_seconds()) as resp:
                body = resp.read()
                resp_mac = resp.headers.get("X-Hetloco-Mac", "")
        except urllib.error.HTTPError as err:
            if err.code == 403:
                raise FleetRefused(f"refused by the fleet: the donor at {url} rejected this replica's "
                                   "fleet secret") from None
            raise StateTransferError(f"state transfer from {url} failed: HTTP {err.code} {err.reason}") from None
        except OSError as err:  # refused connection, timeout, reset: the donor is gone or unreachable
            raise StateTransferError(f"state transfer from {url} failed: {err}") from None
        try:
            resp_mac_bytes = bytes.fromhex(resp_mac)
        except ValueError:
            resp_mac_bytes = b""
        if not verify(self._secret, resp_mac_bytes, b"state-response", path.encode(), nonce.encode(),
                      hashlib.sha256(body).digest()):
            raise StateTransferError(f"state from {url} is not signed with the fleet secret; not loaded")
        return torch.load(io.BytesIO(body), weights_only=True, map_location="cpu")

    def shutdown(self, wait: bool = True) -> None:
        self._server.shutdown()
        self._server.server_close()
        if wait:
            self._thread.join()


def only_block(state: dict, block: int) -> dict | None:
    """`state` (torchft's {"user": {key: ...}, "torchft": ...}) with every user entry's "blocks"
    dict cut down to `block`; None if an entry has blocks but not that one."""
    user = {}
    for key, value in state["user"].items():
        if isinstance(value, dict) and isinstance(value.get("blocks"), dict):
            if block not in value["blocks"]:
                return None
            value = {**value, "blocks": {block: value["blocks"][block]}}
        user[key] = value
    return {**state, "user": user}


def merge_blocks(state: dict, more: dict) -> dict:
    """`state` with the "blocks" of `more`'s user entries added (the rest is the same on every rank
    of a replica: taken from `state`)."""
    user = dict(state["user"])
    for key, value in more["user"].items():
        if isinstance(value, dict) and isinstance(value.get("blocks"), dict):
            user[key] = {**user[key], "blocks": {**user[key]["blocks"], **value["blocks"]}}
    return {**state, "user": user}
