"""The fleet's shared secret and the message authentication codes built from it.

The secret comes from a file or an environment variable, never from the command line (a command
line is visible to every user of the machine in `ps`). A secret file must not be readable by
group or others, as ssh requires of private keys.

Every message a replica accepts from another is authenticated with HMAC-SHA256 under the secret;
the first argument of `tag` names the kind of message, so a MAC of one kind is never valid for
another (a payload MAC cannot be replayed as a vote, a state request as a state response).
"""
from __future__ import annotations

import hashlib
import hmac
import os
import stat

SECRET_ENV = "HETLOCO_FLEET_SECRET"
MIN_SECRET_BYTES = 16
MAC_BYTES = 32


class FleetRefused(RuntimeError):
    """This replica was refused by the fleet, or refuses the fleet: the secrets differ."""


def read_fleet_secret(path: str | None = None, env: str = SECRET_ENV) -> bytes:
    """The secret from `path` if given, else from the environment variable `env`.

    Leading and trailing whitespace (a trailing newline from `echo`) is not part of the secret.
    """
    if path is not None:
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            raise ValueError(f"fleet secret file {path} does not exist") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ValueError(f"fleet secret file {path} is accessible by group or others "
                             f"(mode {stat.S_IMODE(mode):o}); run chmod 600 {path}")
        with open(path, "rb") as f:
            secret = f.read().strip()
        where = f"file {path}"
    else:
        value = os.environ.get(env)
        if value is None:
            raise ValueError(f"no fleet secret: give a secret file or set {env} "
                             "(the secret is never read from the command line)")
        secret = value.encode().strip()
        where = f"${env}"
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"fleet secret in {where} has {len(secret)} bytes; use at least {MIN_SECRET_BYTES} "
                         "(e.g. `openssl rand -hex 32`)")
    return secret


def tag(secret: bytes, kind: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 over kind and parts, each length-prefixed so that no two splits collide."""
    h = hmac.new(secret, digestmod=hashlib.sha256)
    for part in (kind, *parts):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()


def verify(secret: bytes, mac: bytes, kind: bytes, *parts: bytes) -> bool:
    return hmac.compare_digest(mac, tag(secret, kind, *parts))
