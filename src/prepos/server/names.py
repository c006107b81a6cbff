"""Session names in an owner's namespace. A session's id is its name in its owner's
namespace: two API keys may each have a session "orders", and neither can learn that the
other has one. Inside the server (engine, journal, leases) a keyed owner's session is
`<name>~<owner's tag>`; `~` is in no name a client may choose, and every id a client reads is
the name alone. Shared by the HTTP layer and the store."""

from __future__ import annotations

SCOPE = "~"


def scoped(owner: str | None, name: str) -> str:
    """The server's id of the session `name` of key `owner` (None: an open server's)."""
    return name if owner is None else f"{name}{SCOPE}{owner.removeprefix('key-')}"


def public(sid: str) -> str:
    """The name a client knows the session `sid` by."""
    return sid.partition(SCOPE)[0]
