"""Sessions and their store. A session owns its committed conversation, its version and its
ready records; every mutation swaps the committed snapshot, bumps the version and clears the
ready records in one critical section (the never-stale invariant, docs/ARCHITECTURE.md),
once written ahead (`persist`). KV caches are not here: the model worker owns them (kv.py)."""

from __future__ import annotations

import contextlib
import itertools
import threading
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

from prepos.chat.conversation import awaits_tool, pending_calls
from prepos.chat.format import ChatFormat, Split
from prepos.engine.history import History
from prepos.engine.ready import ReadyRecord, ReadySet
from prepos.engine.session_spec import AGENTIC, STREAMING, SessionSpec
from prepos.errors import (
    Conflict,
    InvalidInput,
    NoToolResultAwaited,
    OverBudget,
    SessionBusy,
    SessionNotFound,
    ToolResultAwaited,
    TooManySessions,
    VersionNotFound,
    WrongSessionKind,
)

# an append that renders at most this many characters of conversation is quick: a few
# hundred microseconds (`Session.quick_append`); where the template renders a data line
# on its own (`ChatFormat.appends_locally`), the line's own characters count
QUICK_RENDER = 4096
FRAME_TOKENS = 64  # at most, the tokens a chat template frames one message with

HEADER = ("header",)  # the question-independent assistant header (streaming, relaxed match)
TURN = ("turn",)  # the generation prompt of an agentic session (exact match)
ENVELOPE = ("envelope",)  # the tool-result envelope of a session awaiting a tool result


def query_key(question: str) -> tuple:
    return ("query", question)


@dataclass(frozen=True)
class Snapshot:
    """One committed version of a session."""

    version: int
    messages: tuple[dict, ...]
    text: str
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class Entries:
    """Entry framings of one committed version, derived from the chat template."""

    header: tuple[int, ...]  # generic assistant header (the generation prompt)
    user: Split  # a user message (query) framing; its suffix ends with the header
    tool: Split | None  # the tool-result envelope, when a tool result is awaited


def check_context(n: int, more: int, max_context: int, budget: int | None = None,
                  what: str = "the prompt", more_is: str = "max_tokens") -> None:
    """The context-length check, the one every path makes (a prompt before its answer, a
    session before a commit, a conversation before its delta is committed, a text before
    it is tokenized further): `what`, `n` tokens, and `more` after it (`more_is`: an answer's
    max_tokens, the reserve a session keeps for a request) fit the model's context and, where
    one is given, a session's KV budget; OverBudget naming both numbers otherwise."""
    need = n + more
    plus = f"; with {more_is} {more} it needs {need}" if more else ""
    if need > max_context:
        raise OverBudget(f"{what} is {n} tokens{plus}, over the context of {max_context}")
    if budget is not None and need > budget:
        raise OverBudget(f"{what} is {n} tokens{plus}, over the session's budget of {budget} "
                         "KV cells")


class Session:
    def __init__(self, sid: str, spec: SessionSpec, fmt: ChatFormat, max_context: int,
                 max_versions: int, shift_keep: float, reserve: int,
                 history: Sequence[tuple[int, Sequence[dict]]] = (),
                 check_commit: Callable[[Session, int], None] | None = None,
                 said_tokens: int = 0):
        """A new session, or with `history` ((version, messages) pairs, oldest first, the
        last being current) one restored from a journal. `check_commit(session, n)` may
        refuse, by raising, a committed state of n tokens (the engine's cell budget). `said_tokens`:
        how many tokens of its latest answers it keeps as draft material (`said`)."""
        self.check_commit = check_commit
        # the write-ahead log's commit (`persist(session, snap, origin)`): SessionStore.add
        self.persist: Callable[[Session, Snapshot, object], None] | None = None
        self.id, self.spec, self.fmt, self.max_context = sid, spec, fmt, max_context
        self.max_versions, self.shift_keep, self.reserve = max_versions, shift_keep, reserve
        self.lock = threading.Lock()  # guards snap, ready, history, said (held briefly)
        self.mutex = threading.RLock()  # serializes mutations (held while rendering)
        self.closed = False
        self._turn: object = None  # the turn's claim: True once claimed, then its turn's stream
        # committed versions for rollback, as messages (rendered when rolled back to or read)
        self.history = History(max_versions)
        self._entries: tuple[int, Entries] | None = None
        self.said_tokens = said_tokens
        self._said: deque[int] = deque(maxlen=max(said_tokens, 0))
        if not history:
            history = [(0, [{"role": "system", "content": spec.system}] if spec.system else [])]
        for version, messages in history:
            self.history.add(version, messages)
        version, messages = history[-1]
        self.snap = self._snapshot(version, tuple(messages))
        self._check_fits(len(self.snap.tokens))
        self.ready = ReadySet(version)  # a restored session pre-positions its current version

    # -- reads and ready-set writes, each under the lock ----------------------------------
    def current(self) -> tuple[Snapshot, ReadySet]:
        """The committed snapshot and its ready set, read together."""
        with self.lock:
            return self.snap, self.ready

    def ready_record(self, key: tuple) -> ReadyRecord | None:
        """The current ready record of entry `key` (None once invalidated)."""
        with self.lock:
            return self.ready.records.get(key) if self.ready.valid else None

    def ready_now(self) -> tuple[Snapshot, dict]:
        """The committed snapshot and the ready records computed from it, read together."""
        with self.lock:
            return self.snap, dict(self.ready.records) if self.ready.valid else {}

    def said(self) -> tuple[int, ...]:
        """Its latest answers' tokens, oldest first, at most `said_tokens`: what its next greedy
        answer drafts from besides its context (`prepos.decode.lookup`); never journalled or
        versioned: drafts are verified, so it cannot make an answer stale."""
        with self.lock:
            return tuple(self._said)

    def remember_answer(self, tokens: Sequence[int]) -> None:
        if self.said_tokens > 0 and tokens:
            with self.lock:
                self._said.extend(tokens)

    def at(self, version: int | None) -> Snapshot:
        """A committed version still kept, rendered (the current one otherwise)."""
        with self.lock:
            snap = self.snap
            if version is None or version == snap.version or version not in self.history:
                return snap
            messages = self.history.messages(version)
        return self._snapshot(version, messages)

    def versions(self) -> dict[int, tuple[dict, ...]]:
        with self.lock:
            return self.history.all()

    def info(self) -> dict:
        """What the session is and what is ready in it, read together."""
        snap, ready = self.current()
        return {
            "id": self.id, "kind": self.kind, "version": snap.version,
            "tokens": len(snap.tokens), "messages": len(snap.messages),
            "awaiting_tool_result": awaits_tool(snap.messages),
            "fast_path": self.spec.fast_path, "standing_queries": list(self.spec.standing),
            "ready": {
                "version": ready.version, "valid": ready.valid, "consumed": ready.consumed,
                "done": ready.done,
                "records": {":".join(map(str, k)): {"p": r.p, "gap": r.gap, "token": r.top_text,
                                                    "entry_tokens": len(r.entry)}
                            for k, r in ready.records.items()},
            },
        }

    def invalidate(self) -> None:
        """The session is closing: nothing of it may be served any more."""
        with self.lock:
            self.ready.invalidate()

    def _snapshot(self, version: int, messages: tuple[dict, ...]) -> Snapshot:
        text = self.fmt.render(messages, self.spec.tools) if messages else ""
        return Snapshot(version, messages, text, tuple(self.fmt.encode(text)) if text else ())

    # -- reads ---------------------------------------------------------------------------
    @property
    def kind(self) -> str:
        return self.spec.kind

    @property
    def version(self) -> int:
        return self.snap.version

    @property
    def awaiting_tool(self) -> bool:
        return awaits_tool(self.snap.messages)

    def require(self, kind: str) -> None:
        if self.spec.kind != kind:
            raise WrongSessionKind(f"session {self.id} is {self.spec.kind}, not {kind}")

    def entries(self, snap: Snapshot | None = None) -> Entries:
        snap = snap or self.snap
        cached = self._entries
        if cached and cached[0] == snap.version:
            return cached[1]
        fmt, msgs, tools = self.fmt, snap.messages, self.spec.tools
        ent = Entries(tuple(fmt.encode(fmt.header(msgs, tools, snap.text))),
                      fmt.split(msgs, tools, "user", snap.text),
                      fmt.split(msgs, tools, "tool", snap.text) if awaits_tool(msgs) else None)
        self._entries = (snap.version, ent)
        return ent

    def budget(self, engine_default: int) -> int:
        return self.spec.budget_cells or engine_default

    def _admit(self, turn: bool = False) -> None:
        held = self._turn  # `turn`: a commit of the turn in flight (it holds the claim)
        if not turn and (held is True or held is not None and not held.done):
            raise SessionBusy(f"session {self.id} has a turn in flight; retry after its answer")

    def quick_append(self, text: str) -> bool:
        """Whether appending `text` is quick whatever the template: it renders at most
        QUICK_RENDER characters of conversation, once (the window cannot shift: a token is
        at least a byte of text, and FRAME_TOKENS bound the message's framing)."""
        snap = self.snap
        rendered = len(text) + (0 if self.fmt.appends_locally else len(snap.text))
        return (rendered <= QUICK_RENDER and len(snap.tokens) + len(text.encode())
                + FRAME_TOKENS + self.reserve <= self.max_context)

    # -- mutations -----------------------------------------------------------------------
    def append(self, text: str, origin: object = None) -> tuple[Snapshot, ReadySet | None]:
        """Streaming: commit a data message; shift the window first if the context is full."""
        self.require(STREAMING)
        _check_text(text, "data")
        with self.mutex:
            msgs = [*self.snap.messages, {"role": "user", "content": text}]
            snap = self._render(msgs, check=False, text=self.fmt.render_appended(
                msgs, self.snap.text, self.spec.tools, self.spec.owner))
            if len(snap[1]) + self.reserve > self.max_context:
                msgs = self._shifted(msgs)
                snap = self._render(msgs, incremental=False)
            else:
                self._check_fits(len(snap[1]))
            return self._commit(msgs, *snap, origin)

    def shift(self, drop: int | None = None, origin: object = None
              ) -> tuple[Snapshot, ReadySet | None]:
        """Streaming: drop the `drop` oldest data messages (default: down to the shift target),
        keeping the system region; positions are recomputed from the new sequence."""
        self.require(STREAMING)
        with self.mutex:
            first = self._first_data()
            data = len(self.snap.messages) - first
            if data < 1:
                raise InvalidInput(f"session {self.id} holds no data to shift")
            if drop is None:
                msgs = self._shifted(list(self.snap.messages))
            else:
                if not isinstance(drop, int) or not 1 <= drop <= data:
                    raise InvalidInput(f"drop must be an integer in [1, {data}], got {drop!r}")
                msgs = [*self.snap.messages[:first], *self.snap.messages[first + drop:]]
            return self._commit(msgs, *self._render(msgs, incremental=False), origin)

    def rollback(self, version: int, origin: object = None) -> tuple[Snapshot, ReadySet | None]:
        with self.mutex:
            self._admit()
            if not isinstance(version, int) or version not in self.history:
                kept = f"{min(self.history)}..{max(self.history)}"
                raise VersionNotFound(f"session {self.id} has no version {version!r} "
                                      f"(versions kept: {kept})")
            if version == self.snap.version:  # already there: nothing to commit
                return self.snap, None
            with self.lock:
                messages = self.history.messages(version)
            old = self._snapshot(version, messages)
            return self._commit(list(old.messages), old.text, old.tokens, origin)

    def add_message(self, message: dict, expected_version: int | None = None,
                    check: Callable[[int], None] | None = None, turn: bool = False,
                    origin: object = None) -> tuple[Snapshot, ReadySet | None]:
        """Agentic: commit a user, assistant or tool message. `check` sees the new length
        before anything changes and may refuse by raising. `turn`: a commit of the turn in
        flight (its message: a tool result is refused while other calls await theirs).
        `origin`: the request it comes from, handed to the write-ahead log."""
        self.require(AGENTIC)
        role = message.get("role")
        if role not in ("system", "user", "assistant", "tool"):  # system: where the template
            raise InvalidInput(f"message role must be system, user, assistant or tool, got "
                               f"{role!r}")  # allows it (it refuses when rendering)
        _check_text(message.get("content", ""), role, allow_empty=role == "assistant")
        with self.expecting(expected_version):
            self._admit(turn)
            if role == "tool" and not self.awaiting_tool:
                raise NoToolResultAwaited(f"session {self.id} is not awaiting a tool result")
            if role in ("user", "assistant", "system") and self.awaiting_tool:
                raise ToolResultAwaited(f"session {self.id} awaits a tool result first")
            pending = len(pending_calls(self.snap.messages))
            if role == "tool" and turn and pending > 1:
                raise ToolResultAwaited(f"session {self.id} awaits {pending} tool results: add "
                                        "all but the last as messages, then the last starts "
                                        "the turn")
            msgs = [*self.snap.messages, dict(message)]
            text, tokens = self._render(msgs)
            if check is not None:
                check(len(tokens))
            return self._commit(msgs, text, tokens, origin)

    @contextlib.contextmanager
    def expecting(self, version: int | None):
        """The mutations inside commit only at `version` (None: any): Conflict otherwise."""
        with self.mutex:
            if version is not None and self.snap.version != version:
                raise Conflict(f"session {self.id} is at version {self.snap.version}, not "
                               f"{version} (expected_version)")
            yield

    # -- internals -----------------------------------------------------------------------
    def _first_data(self) -> int:
        msgs = self.snap.messages
        return 1 if msgs and msgs[0]["role"] == "system" else 0

    def _shifted(self, msgs: list[dict]) -> list[dict]:
        """`msgs` less the fewest oldest data messages that bring its tokens to the shift
        target (the system region and the newest message always kept), found by bisection:
        a conversation's tokens fall as its oldest messages go (a linear search rendered
        and tokenized the conversation once for each message dropped: seconds of CPU at a
        few hundred lines)."""
        first = 1 if msgs and msgs[0]["role"] == "system" else 0
        target = int(self.max_context * self.shift_keep)

        def fits(drop: int) -> bool:
            trial = [*msgs[:first], *msgs[first + drop:]]
            return len(self.fmt.encode(self.fmt.render(trial, self.spec.tools))) <= target

        lo, hi = min(1, len(msgs) - 1 - first), len(msgs) - 1 - first  # hi: the newest alone
        while lo < hi:
            mid = (lo + hi) // 2
            if fits(mid):
                hi = mid
            else:
                lo = mid + 1
        return [*msgs[:first], *msgs[first + lo:]]

    def _render(self, msgs: list[dict], incremental: bool = True, check: bool = True,
                text: str | None = None) -> tuple[str, tuple[int, ...]]:
        """`msgs`' text (`text`, where the caller rendered it) and tokens."""
        if text is None:
            text = self.fmt.render(msgs, self.spec.tools)
        old = self.snap
        if incremental and text.startswith(old.text):
            tokens = old.tokens + tuple(self.fmt.encode(text[len(old.text):]))
        else:  # the template re-rendered history (or a shift): tokenize the whole of it
            tokens = tuple(self.fmt.encode(text))
        if check:
            self._check_fits(len(tokens))
        return text, tokens

    def _check_fits(self, n: int) -> None:
        what = f"session {self.id} with this commit"
        check_context(n, self.reserve, self.max_context, what=what,
                      more_is="the tokens reserved for a request")
        check_context(n, 0, self.max_context, self.spec.budget_cells, what)
        if self.check_commit is not None:
            self.check_commit(self, n)

    def _commit(self, msgs: Sequence[dict], text: str, tokens: tuple[int, ...],
                origin: object = None):
        """Write the next version ahead (with `origin`, the request it comes from), then swap
        the snapshot, bump the version, clear the ready records: one critical section. The new
        snapshot and the ready set it dropped."""
        snap = Snapshot(self.snap.version + 1, tuple(msgs), text, tokens)
        if self.persist is not None:
            self.persist(self, snap, origin)
        with self.lock:
            dropped = self.ready
            if dropped is not None:
                dropped.invalidate()
            self.ready = ReadySet(snap.version)
            self.snap = snap
            self.history.add(snap.version, snap.messages)
        return snap, dropped


def _check_text(text: object, what: str, allow_empty: bool = False) -> None:
    if not isinstance(text, str):
        raise InvalidInput(f"{what} content must be a string, got {type(text).__name__}")
    if not allow_empty and not text.strip():
        raise InvalidInput(f"{what} content must not be empty")


class SessionStore:
    """Owns the sessions: lookup by id, creation, closing, each written ahead to `durable`
    (a journal: `created`, `committed`, `closing`; one that raises changed nothing)."""

    DEFAULT_MAX = 4096

    def __init__(self, max_sessions: int = DEFAULT_MAX):
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        self._counter = itertools.count()
        self.max_sessions = max_sessions
        self.durable = None

    def new_id(self) -> str:
        return f"s-{next(self._counter)}-{uuid.uuid4().hex[:8]}"

    def add(self, session: Session, origin: object = None) -> None:
        with self._lock:
            if len(self._sessions) >= self.max_sessions:
                raise TooManySessions(f"this engine holds its limit of {self.max_sessions} "
                                      "sessions; close one first")
            self._sessions[session.id] = session
        if self.durable is not None:
            session.persist = self.durable.committed
            try:
                self.durable.created(session, session.snap, origin)
            except BaseException:
                self._sessions.pop(session.id, None)
                raise

    def find(self, sid: str) -> Session | None:
        """The session, open or not yet removed, without the access checks of `get`."""
        return self._sessions.get(sid)

    def get(self, sid: str) -> Session:
        s = self._sessions.get(sid)
        if s is None or s.closed:
            raise SessionNotFound(f"no session {sid!r}")
        return s

    def remove(self, sid: str, origin: object = None) -> Session:
        if self.durable is not None:
            self.durable.closing(self.get(sid), origin)
        with self._lock:
            s = self.get(sid)
            s.closed = True
            del self._sessions[sid]
            return s

    def all(self) -> list[Session]:
        return list(self._sessions.values())

    def __len__(self) -> int:
        return len(self._sessions)
