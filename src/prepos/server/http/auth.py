"""Optional API keys (Bearer). A key's owner id tags every session it creates and scopes
its name (`names.scoped`); the engine shows a session only to its owner, so another key's request
gets 404, and may create a session of the same name, never a hint that the session exists.
Keys are kept as SHA-256 digests; the raw key is never stored or logged.
Without keys the server is open: every client is the one owner (None), sharing its sessions,
caches, implicit sessions and stored responses (`open_warning` says so at startup).
The same check guards `/metrics` with its own keys (`--metrics-key`), where given."""

from __future__ import annotations

import hashlib
import ipaddress
import os
from collections.abc import Iterable
from pathlib import Path

from starlette.requests import Request

from prepos.server.http.errors import ApiError


def owner_id(key: str) -> str:
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:16]


def load_keys(keys: Iterable[str] = (), keys_file: str | None = None,
              env: str = "PREPOS_API_KEYS") -> tuple[str, ...]:
    """Keys from the command line, a file (one a line, # comments) and the environment
    (comma-separated)."""
    out = [k.strip() for k in keys if k and k.strip()]
    if keys_file:
        for line in Path(keys_file).read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                out.append(line)
    out += [k.strip() for k in os.environ.get(env, "").split(",") if k.strip()]
    return tuple(dict.fromkeys(out))


def open_warning(host: str, keys: Iterable[str]) -> str | None:
    """The startup warning for a server with no keys that binds a non-loopback address
    (None where it has keys, or listens on loopback only)."""
    if any(keys) or loopback(host):
        return None
    return (f"no API keys and listening on {host}: every client that reaches it is the same "
            "owner, sharing all sessions (listed, read, written and closed by anyone), "
            "caches, implicit sessions and stored responses; pass --api-key (or "
            "PREPOS_API_KEYS) to give each client its own")


def loopback(host: str) -> bool:
    if host.strip().lower() in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


class Keys:
    def __init__(self, keys: Iterable[str] = (), what: str = "API key"):
        self._owners = {hashlib.sha256(k.encode()).digest(): owner_id(k) for k in keys}
        self.what = what  # as errors name it

    def owner(self, request: Request) -> str | None:
        """The owner id of the request's key; None when keys are off. 401 otherwise."""
        return self.owner_of(request.headers.get("authorization")) if self._owners else None

    def owner_of(self, header: str | None) -> str | None:
        """`owner`, from the request's Authorization header (None: not sent)."""
        if not self._owners:
            return None
        if not header:
            raise ApiError(401, "missing_api_key",
                           f"this needs a key ({self.what}): send 'Authorization: Bearer "
                           "<key>'",
                           headers={"WWW-Authenticate": "Bearer"})
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise ApiError(401, "invalid_api_key",
                           "the Authorization header must be 'Bearer <key>'",
                           headers={"WWW-Authenticate": "Bearer"})
        digest = hashlib.sha256(key.strip().encode()).digest()
        owner = self._owners.get(digest)  # keyed by digest: timing says nothing of the key
        if owner is None:
            raise ApiError(401, "invalid_api_key", f"the {self.what} is not valid",
                           headers={"WWW-Authenticate": "Bearer"})
        return owner

    def admits(self, request: Request) -> bool:
        """Whether the request may see what only key holders see (always, with keys off)."""
        try:
            self.owner(request)
        except ApiError:
            return False
        return True
