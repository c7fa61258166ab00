"""Registry of paused generations, for implicit and explicit resume.

When a chat completion ends in tool calls, its generation stays paused in the engine. The registry
remembers what a later request must repeat to continue it:

* the conversation that produced it and the assistant turn the server returned (with server-issued
  ``call_<random>`` ids), so that a request "conversation + that turn + one tool result per call" is
  recognized by the call ids (implicit resume) or by an explicit ``session_id``;
* the full paused token sequence, so that a token-level prompt that extends it is recognized too
  (`/v1/completions`), and so that a chat request resumes only if its fresh rendering starts with
  exactly those tokens.

Recognizing is an optimization: whatever does not match exactly is served as a fresh request.

Paused generations hold KV blocks (or host blocks, or nothing once discarded), so they are bounded by
memory: beyond `max_paused_tokens` context tokens (by default what the engine's device and host pools
hold) or, if the operator sets one, `max_paused` entries, the one whose release wastes least goes: the
one keeping the least KV (`kept_tokens`: its resume would recompute what it keeps; one already discarded
loses nothing), oldest first among equals. Older than the TTL they are aborted too. The registry is pure
bookkeeping: it returns the engine request ids to abort and the caller aborts them. All methods run on
the event loop (no locks), and none walks every paused generation except a release over the limits.

It also keeps a bounded LRU of assistant tool-call turns the server generated (`AssistantTurn`), kept
beyond their pause: a later turn of the same conversation renders them as the exact generated tokens.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .chat import AssistantTurn, Message


@dataclass
class PausedGeneration:
    request_id: str  # the engine request, paused
    token_ids: list[int]  # its whole context: every prompt, generated and appended token so far
    messages: tuple[Message, ...] = ()  # chat: the conversation before `turn` (empty: token-level only)
    turn: AssistantTurn | None = None  # chat: the assistant tool-call turn it paused at
    session_id: str | None = None
    paused_at: float = field(default_factory=time.monotonic)

    @property
    def call_ids(self) -> tuple[str, ...]:
        return tuple(c.id for c in self.turn.message.tool_calls) if self.turn else ()

    def continues(self, messages: Sequence[Message]) -> bool:
        """`messages` is this conversation + the same assistant turn + exactly one tool result per call
        (tool_call ids equal, arguments JSON-equal, earlier messages unchanged)."""
        n = len(self.messages)
        if self.turn is None or len(messages) < n + 2:
            return False
        if tuple(messages[:n]) != self.messages or messages[n] != self.turn.message:
            return False
        results = messages[n + 1:]
        return (all(m.role == "tool" for m in results)
                and sorted(m.tool_call_id for m in results) == sorted(self.call_ids))


@dataclass
class Session:
    """An explicitly named conversation (``session_id``)."""

    session_id: str
    messages: tuple[Message, ...] = ()  # the conversation so far, the last assistant turn included
    busy: bool = False  # a request of this session is generating
    paused_request_id: str | None = None
    last_used: float = field(default_factory=time.monotonic)


TOKEN_BLOCK = 16  # paused token sequences are found by the chained hashes of their full blocks
NAMED_SESSIONS_KEPT = 16_384  # named sessions remembered without a paused-generation count limit


def _block_keys(token_ids: Sequence[int], num_blocks: int) -> list[int | None]:
    """Key of each prefix of `num_blocks` full blocks: None for zero blocks, then chained hashes."""
    keys: list[int | None] = [None]
    for k in range(num_blocks):
        keys.append(hash((keys[-1], tuple(token_ids[k * TOKEN_BLOCK:(k + 1) * TOKEN_BLOCK]))))
    return keys


class SessionRegistry:
    def __init__(self, ttl: float, max_paused: int | None, max_paused_tokens: int | None, max_turns: int = 4096,
                 clock: Callable[[], float] = time.monotonic, kept_tokens: Callable[[str], int] = lambda rid: 0):
        self.ttl = ttl
        self.max_paused = max_paused  # None: no count limit
        self.max_paused_tokens = max_paused_tokens  # None: no token limit
        self.max_turns = max_turns
        self.clock = clock
        # KV tokens (device + host) a paused generation still keeps: what releasing it throws away.
        self.kept_tokens = kept_tokens
        self._paused: OrderedDict[str, PausedGeneration] = OrderedDict()  # oldest first
        self._by_call_id: dict[str, str] = {}  # first call id -> request id
        # Paused token sequences by the key of their full blocks (`_block_keys`), for `find_for_tokens`.
        self._by_blocks: dict[int | None, dict[str, None]] = {}
        self._block_key: dict[str, int | None] = {}  # request id -> its key there
        self._sessions: dict[str, Session] = {}
        self._turns: OrderedDict[tuple[str, ...], AssistantTurn] = OrderedDict()
        self.num_paused_tokens = 0

    # -- paused generations ------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._paused)

    def paused(self) -> list[PausedGeneration]:
        return list(self._paused.values())

    def add(self, entry: PausedGeneration) -> list[str]:
        """Register a paused generation; returns request ids to abort (over the limits, oldest first)."""
        entry.paused_at = self.clock()
        self._paused[entry.request_id] = entry
        self.num_paused_tokens += len(entry.token_ids)
        n = len(entry.token_ids) // TOKEN_BLOCK
        key = self._block_key[entry.request_id] = _block_keys(entry.token_ids, n)[n]
        self._by_blocks.setdefault(key, {})[entry.request_id] = None
        if entry.call_ids:
            self._by_call_id[entry.call_ids[0]] = entry.request_id
            self.remember_turn(entry.turn)
        if entry.session_id is not None:
            session = self.session(entry.session_id)
            session.paused_request_id = entry.request_id
        evicted = []
        while self._paused and self._over_limits():
            evicted.append(self._drop(self._cheapest_to_release()))
        return evicted

    def _over_limits(self) -> bool:
        return ((self.max_paused is not None and len(self._paused) > self.max_paused)
                or (self.max_paused_tokens is not None and self.num_paused_tokens > self.max_paused_tokens))

    def _cheapest_to_release(self) -> str:
        """The paused generation whose release wastes least: the least KV kept (oldest among equals)."""
        return min(self._paused, key=self.kept_tokens)  # min keeps the first (oldest) of equal keys

    def get(self, request_id: str) -> PausedGeneration | None:
        return self._paused.get(request_id)

    def take(self, request_id: str) -> PausedGeneration | None:
        """Claim a paused generation for resuming: it leaves the registry (a concurrent request for the
        same generation finds nothing and is served fresh)."""
        if request_id not in self._paused:
            return None
        entry = self._paused[request_id]
        self._drop(request_id)
        return entry

    def find_for_messages(self, messages: Sequence[Message], session_id: str | None = None) -> PausedGeneration | None:
        """The paused generation `messages` continues, found by the session or the last call ids."""
        if session_id is not None:
            session = self._sessions.get(session_id)
            entry = self._paused.get(session.paused_request_id) if session and session.paused_request_id else None
        else:
            k = len(messages) - 1
            while k >= 0 and messages[k].role == "tool":
                k -= 1
            if k < 0 or k == len(messages) - 1 or not messages[k].tool_calls:
                return None
            request_id = self._by_call_id.get(messages[k].tool_calls[0].id)
            entry = self._paused.get(request_id) if request_id else None
        return entry if entry is not None and entry.continues(messages) else None

    def find_for_tokens(self, token_ids: Sequence[int]) -> PausedGeneration | None:
        """The paused generation whose whole token sequence `token_ids` strictly extends (the longest).
        Candidates share `token_ids`' first full blocks, found by key, longest first: O(len(token_ids))."""
        keys = _block_keys(token_ids, max(len(token_ids) - 1, 0) // TOKEN_BLOCK)
        for key in reversed(keys):
            best = None
            for request_id in self._by_blocks.get(key, ()):
                entry = self._paused[request_id]
                n = len(entry.token_ids)
                if n < len(token_ids) and (best is None or n > len(best.token_ids)) \
                        and list(token_ids[:n]) == entry.token_ids:
                    best = entry
            if best is not None:
                return best
        return None

    def take_for_session(self, session_id: str) -> PausedGeneration | None:
        """Claim the paused generation of the named session `session_id`, if it has one (see `take`)."""
        session = self._sessions.get(session_id)
        if session is None or session.paused_request_id is None:
            return None
        return self.take(session.paused_request_id)

    def expire(self) -> list[str]:
        """Abort what has been paused longer than the TTL; forget idle sessions. Returns request ids."""
        now = self.clock()
        expired = [rid for rid, e in self._paused.items() if now - e.paused_at > self.ttl]
        for rid in expired:
            self._drop(rid)
        for sid in [s.session_id for s in self._sessions.values()
                    if not s.busy and s.paused_request_id is None and now - s.last_used > self.ttl]:
            del self._sessions[sid]
        return expired

    def clear(self) -> list[str]:
        ids = list(self._paused)
        for rid in ids:
            self._drop(rid)
        return ids

    def _drop(self, request_id: str) -> str:
        entry = self._paused.pop(request_id)
        self.num_paused_tokens -= len(entry.token_ids)
        key = self._block_key.pop(request_id)
        bucket = self._by_blocks[key]
        del bucket[request_id]
        if not bucket:
            del self._by_blocks[key]
        if entry.call_ids and self._by_call_id.get(entry.call_ids[0]) == request_id:
            del self._by_call_id[entry.call_ids[0]]
        if entry.session_id is not None:
            session = self._sessions.get(entry.session_id)
            if session is not None and session.paused_request_id == request_id:
                session.paused_request_id = None
        return request_id

    # -- explicit sessions -------------------------------------------------------------------------
    def session(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            self._forget_idle_sessions(keep=self.max_sessions_kept - 1)
            session = self._sessions[session_id] = Session(session_id)
        session.last_used = self.clock()
        return session

    @property
    def max_sessions_kept(self) -> int:
        """Named sessions remembered at most (their conversations are held in memory)."""
        return NAMED_SESSIONS_KEPT if self.max_paused is None else max(4 * self.max_paused, 1024)

    def _forget_idle_sessions(self, keep: int) -> None:
        idle = sorted((s for s in self._sessions.values() if not s.busy and s.paused_request_id is None),
                      key=lambda s: s.last_used)
        for s in idle[:max(len(self._sessions) - keep, 0)]:
            del self._sessions[s.session_id]

    def get_session(self, session_id: str) -> Session | None:
        return self._sessions.get(session_id)

    # -- generated assistant turns -----------------------------------------------------------------
    def remember_turn(self, turn: AssistantTurn) -> None:
        key = tuple(c.id for c in turn.message.tool_calls)
        self._turns[key] = turn
        self._turns.move_to_end(key)
        while len(self._turns) > self.max_turns:
            self._turns.popitem(last=False)

    def known_turn(self, message: Message) -> AssistantTurn | None:
        """The generated turn `message` repeats (same call ids, JSON-equal arguments, same content)."""
        turn = self._turns.get(tuple(c.id for c in message.tool_calls))
        if turn is None or turn.message != message:
            return None
        return turn
