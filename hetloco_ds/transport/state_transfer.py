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
"""
from __future__ import annotations

import collections
import hashlib
import io
import logging
import secrets
import socket
import threading
import urllib.error
import urllib.request
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

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
                 timeout: timedelta = timedelta(seconds=60), name: str = "") -> None:
        advertise = advertise or bind
        if advertise in ("", "0.0.0.0", "::"):
            raise ValueError(f"state transfer binds {bind!r}: give the address peers reach it at (advertise)")
        self._secret = secret
        self._timeout = timeout
        self._name = name
        self._cond = threading.Condition()
        self._staged: tuple[int, bytes] | None = None
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
    def metadata(self) -> str:
        return self._url

    def send_checkpoint(self, dst_ranks, step: int, state_dict: dict, timeout: timedelta) -> None:
        buf = io.BytesIO()
        torch.save(state_dict, buf)
        with self._cond:
            self._staged = (int(step), buf.getvalue())
            self._cond.notify_all()

    def disallow_checkpoint(self) -> None:
        with self._cond:
            self._staged = None

    def _serve(self, req: BaseHTTPRequestHandler) -> None:
        parts = req.path.split("/")
        nonce = req.headers.get("X-Hetloco-Nonce", "")
        mac = req.headers.get("X-Hetloco-Mac", "")
        who = f"{req.headers.get('X-Hetloco-Replica', '?')!r} at {req.client_address[0]}"
        if len(parts) != 3 or parts[1] != "checkpoint" or not parts[2].lstrip("-").isdigit():
            req.send_error(404)
            return
        step = int(parts[2])
        try:
            mac_bytes = bytes.fromhex(mac)
        except ValueError:
            mac_bytes = b""
        if len(nonce) != 32 or not verify(self._secret, mac_bytes, b"state-request", str(step).encode(),
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
        if staged is None or staged[0] != step:
            req.send_error(409, f"no state staged for step {step}")
            return
        body = staged[1]
        resp_mac = tag(self._secret, b"state-response", str(step).encode(), nonce.encode(),
                       hashlib.sha256(body).digest())
        req.send_response(200)
        req.send_header("Content-Type", "application/octet-stream")
        req.send_header("Content-Length", str(len(body)))
        req.send_header("X-Hetloco-Mac", resp_mac.hex())
        req.end_headers()
        req.wfile.write(body)

    # ------------------------------------------------------------------ joiner side
    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> dict:
        nonce = secrets.token_hex(16)
        mac = tag(self._secret, b"state-request", str(step).encode(), nonce.encode(), metadata.encode())
        request = urllib.request.Request(f"{metadata}/checkpoint/{step}", headers={
            "X-Hetloco-Nonce": nonce, "X-Hetloco-Mac": mac.hex(), "X-Hetloco-Replica": self._name})
        try:
            with urllib.request.urlopen(request, timeout=timeout.total_seconds()) as resp:
                body = resp.read()
                resp_mac = resp.headers.get("X-Hetloco-Mac", "")
        except urllib.error.HTTPError as err:
            if err.code == 403:
                raise FleetRefused(f"refused by the fleet: the donor at {metadata} rejected this replica's "
                                   "fleet secret") from None
            raise StateTransferError(f"state transfer from {metadata} failed: HTTP {err.code} {err.reason}") from None
        except OSError as err:  # refused connection, timeout, reset: the donor is gone or unreachable
            raise StateTransferError(f"state transfer from {metadata} failed: {err}") from None
        try:
            resp_mac_bytes = bytes.fromhex(resp_mac)
        except ValueError:
            resp_mac_bytes = b""
        if not verify(self._secret, resp_mac_bytes, b"state-response", str(step).encode(), nonce.encode(),
                      hashlib.sha256(body).digest()):
            raise StateTransferError(f"state from {metadata} is not signed with the fleet secret; not loaded")
        return torch.load(io.BytesIO(body), weights_only=True, map_location="cpu")

    def shutdown(self, wait: bool = True) -> None:
        self._server.shutdown()
        self._server.server_close()
        if wait:
            self._thread.join()
