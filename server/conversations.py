"""The conversation store: what the server keeps between requests, and the paused generations it holds.

Every conversation is one record (`Conversation`) of one of five kinds (`Kind`):

* implicit -- a generation paused at tool calls (or at a token-level interception) that nobody named,
  found by its call ids (a chat request repeating that conversation, that turn and one result per call)
  or by its tokens (a `/v1/completions` prompt strictly extending them); it closes once resumed;
* chat -- a chat completion's `session_id`: its messages, so a request may bring only tool results;
* session -- a native session (`/v1/sessions`): its spec, its messages or, token-level, its context;
* response -- a stored Responses-API response (`store: true`): its body and the conversation it closes;
* conversation -- a Responses-API conversation (`/v1/conversations`): its items, the chat messages they
  make, and the generation its last response paused at.

A record is in one state (`State`): idle, generating (a request of it is being served), paused (its
last turn ended in tool calls or an interception and waits for the results) or closed (gone). A paused
record may hold the engine generation it paused at, one handle (`Paused`: request id, whole token
sequence, the assistant turn), so the request bringing the results resumes it instead of recomputing;
a handle released by the limits or the TTL leaves the record paused, and that request is served fresh.
Each handle has exactly one holder: a turn (server/turns.py) gives its handle to the named record it
continues (a chat `session_id`, a native session) or to a new implicit one, from which a stored
response adopts the handle of the turn it just served. Resuming takes the handle out (a concurrent request for it finds nothing, served fresh).

Lookups are O(1) or O(prompt), never a walk over every record: first call id -> handles (ids need not
be unique: the one the conversation continues); the chained hashes
of a token sequence's 16-token blocks -> handles (`find_for_tokens`); (kind, id) -> record; item id ->
the stored responses and conversations keeping that item (`item`, what an `item_reference` names).

The policy (`settings.ConversationPolicy`) is one object with two clocks, because the documented
defaults differ: handles, chat sessions and native sessions go after `idle_ttl` unused (600 s),
stored responses `response_ttl` after their creation (3600 s), conversations `response_ttl` after their
last use (they are stored objects a client comes back to, like responses). Handles are bounded by memory: past
`max_paused_tokens` context tokens (or `max_paused` handles) the one keeping the least KV goes
(`kept_tokens`: its resume recomputes what it keeps; oldest among equals). Named records (chat and
native sessions) are bounded by `max_named_sessions` (least recently used first, never one generating),
stored responses by `max_stored_responses` (oldest first), conversations by `max_conversations` (least
recently used first, never one generating). Closing a record releases its handle.

Releasing goes through one function, `release(request_id, cause, reason)` (`engine_release`: abort in
the engine, counted by cause -- limits, ttl, shutdown, client -- with the KV it kept), and resuming
takes a handle out before the engine resumes it: the engine's paused set and the store do not drift.
All methods run on the event loop (no locks); `reap` is the TTL loop.

The store also keeps a bounded LRU of assistant tool-call turns the server generated (`AssistantTurn`),
kept beyond their pause: a later turn of the same conversation renders them as the generated tokens.
"""
from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from infercept.engine.backend import ToolSpec

from .chat import AssistantTurn, Call, Message
from .protocol import APIError, ToolParam
from .settings import ConversationPolicy, Tenant

logger = logging.getLogger("infercept.server")

TOKEN_BLOCK = 16  # paused token sequences are found by the chained hashes of their full blocks
Release = Callable[[str, str, str], None]  # (request id, cause, reason): abort a paused generation


class Kind(enum.Enum):
    IMPLICIT = "implicit"  # a paused turn nobody named (id: its request id)
    CHAT = "chat"  # a chat completion's session_id
    SESSION = "session"  # /v1/sessions
    RESPONSE = "response"  # a stored Responses-API response
    CONVERSATION = "conversation"  # a Responses-API conversation (/v1/conversations)
    # Never a record's kind: an item a stored response or conversation keeps, as an `item_reference`
    # names it (what a replica asks the others about: server/replica_forwarding.py).
    ITEM = "item"


class State(str, enum.Enum):  # (enum.StrEnum needs Python 3.11; we support 3.10)
    IDLE = "idle"
    GENERATING = "generating"
    PAUSED = "paused"
    CLOSED = "closed"


@dataclass(eq=False)
class Paused:
    """A generation kept paused in the engine for the record holding it."""

    request_id: str  # the engine request, paused
    token_ids: list[int]  # its whole context: every prompt, generated and appended token so far
    turn: AssistantTurn | None = None  # chat: the assistant tool-call turn it paused at
    history: tuple[Message, ...] = ()  # chat: the conversation before `turn`
    since: float = 0.0  # when it paused, on the store's clock
    tools: tuple[ToolSpec, ...] = ()  # chat: the tools its prompt rendered

    @property
    def call_ids(self) -> tuple[str, ...]:
        return tuple(c.id for c in self.turn.message.tool_calls) if self.turn else ()

    def continues(self, messages: Sequence[Message]) -> bool:
        """`messages` is `history` + the same assistant turn + exactly one tool result per call
        (tool_call ids equal, arguments JSON-equal, earlier messages unchanged). The turn is compared as
        a message, never as tokens: a thinking model's (--reasoning-parser) has the text after its
        thinking as content, as the client returns it, while `token_ids` keep the thinking."""
        n = len(self.history)
        if self.turn is None or len(messages) < n + 2:
            return False
        if tuple(messages[:n]) != self.history or messages[n] != self.turn.message:
            return False
        results = messages[n + 1:]
        return (all(m.role == "tool" for m in results)
                and sorted(m.tool_call_id for m in results) == sorted(self.call_ids))


@dataclass(frozen=True)
class SessionSpec:
    """What a native session is created with."""

    model: str
    system: str | None
    tools: tuple[ToolParam, ...]  # rendered into every prompt: the client's tools and the server's
    server_tools: dict[str, Any]  # name -> the tool object the server runs (infercept.tools interface)
    defaults: dict[str, Any]  # sampling defaults (protocol_sessions.SamplingDefaults)
    created_at: int

    def turn_sampling(self, overrides: dict[str, Any]) -> dict[str, Any]:
        """A turn's sampling fields: the session's defaults, overridden by the message's (None = unset)."""
        merged = {k: v for k, v in self.defaults.items() if v is not None}
        merged.update({k: v for k, v in overrides.items() if v is not None})
        return merged


@dataclass(eq=False)
class Conversation:
    """One conversation the server keeps between requests (its kinds and states: the module docstring)."""

    id: str
    kind: Kind
    state: State = State.IDLE
    paused: Paused | None = None  # the generation it holds paused (None: none, or released, or resumed)
    # chat: the conversation so far; session: after the system prompt; response: the chain's input
    # messages and this response's turn. Each ends with the last assistant turn.
    messages: tuple[Message, ...] = ()
    token_ids: list[int] = field(default_factory=list)  # a token-level session's whole context
    spec: SessionSpec | None = None  # native sessions
    body: dict | None = None  # stored responses: the response object as returned; conversations: theirs
    # conversations: their items as listed; responses: their input items (the chain's), oldest first
    items: list[dict] = field(default_factory=list)
    request_id: str | None = None  # native sessions: the engine request generating now
    task: asyncio.Task | None = None  # native sessions: the post in flight (deleting the session cancels it)
    last_used: float = 0.0  # named records: last use; responses: creation
    owner: str | None = None  # the tenant whose key created it (server/tenants.py); None: no API keys

    @property
    def pending_calls(self) -> tuple[Call, ...]:
        """The calls a paused conversation waits for."""
        return self.messages[-1].tool_calls if self.state is State.PAUSED and self.messages else ()


def _block_keys(token_ids: Sequence[int], num_blocks: int) -> list[int | None]:
    """Key of each prefix of `num_blocks` full blocks: None for zero blocks, then chained hashes."""
    keys: list[int | None] = [None]
    for k in range(num_blocks):
        keys.append(hash((keys[-1], tuple(token_ids[k * TOKEN_BLOCK:(k + 1) * TOKEN_BLOCK]))))
    return keys


def engine_release(backend, metrics) -> Release:
    """How the server lets a paused generation go: abort it in the engine (freeing its blocks), counted
    by cause with the KV tokens it still kept (what its agent's next turn recomputes)."""
    def release(request_id: str, cause: str, reason: str) -> None:
        kept = backend.paused_kv_tokens(request_id)
        logger.info("aborting paused generation %s (%d KV tokens kept): %s", request_id, kept, reason)
        metrics.evictions.labels(metrics.model, cause).inc()
        metrics.released_kv_tokens.labels(metrics.model, cause).inc(kept)
        backend.abort(request_id)
    return release


class ConversationStore:
    def __init__(self, policy: ConversationPolicy, release: Release,
                 kept_tokens: Callable[[str], int] = lambda rid: 0, clock: Callable[[], float] = time.monotonic,
                 tenants: Sequence[Tenant] = ()):
        self.policy = policy  # its max_paused_tokens None: no token limit
        self.quotas = {t.name: t for t in tenants if t.max_paused is not None or t.max_paused_tokens is not None}
        self._owned: dict[str | None, OrderedDict[str, None]] = {}  # owner -> its paused request ids, oldest first
        self._owned_tokens: dict[str | None, int] = {}  # owner -> context tokens of its paused generations
        self.release = release
        self.kept_tokens = kept_tokens  # KV tokens (device + host) a paused generation still keeps
        self.clock = clock
        self._paused: OrderedDict[str, Conversation] = OrderedDict()  # request id -> holder, oldest first
        # first call id -> request ids, oldest first. Ids need not be unique: a Kimi-K2 model writes its own,
        # `functions.NAME:INDEX` counted per conversation, so concurrent agents' first calls share them.
        self._by_call_id: dict[str, dict[str, None]] = {}
        self._by_blocks: dict[int | None, dict[str, None]] = {}  # block key (`_block_keys`) -> request ids
        self._block_key: dict[str, int | None] = {}  # request id -> its key there
        # (owner, kind, id) -> record, least recently used first: each tenant names its own chat sessions
        self._named: OrderedDict[tuple[str | None, Kind, str], Conversation] = OrderedDict()
        self._named_tenants: dict[tuple[Kind, str], int] = {}  # (kind, id) -> how many tenants name it
        self._responses: OrderedDict[str, Conversation] = OrderedDict()  # oldest first
        self._conversations: OrderedDict[str, Conversation] = OrderedDict()  # least recently used first
        # item id -> the responses and conversations keeping it (each with its item there), in the order
        # they came to keep it: a response chain repeats its items in every response of it
        self._item_holders: dict[str, dict[Conversation, dict]] = {}
        # (owner, call ids) -> turns: a tenant's conversations render only its own generated turns' tokens
        self._turns: OrderedDict[tuple[str | None, tuple[str, ...]], list[AssistantTurn]] = OrderedDict()
        self._num_turns = 0
        self.num_paused_tokens = 0

    # -- paused generations ------------------------------------------------------------------------
    def paused(self) -> list[Paused]:
        """Every handle, oldest first: the generations the engine holds paused for the server."""
        return [holder.paused for holder in self._paused.values()]

    def pause(self, handle: Paused, holder: Conversation | None = None, owner: str | None = None) -> None:
        """Keep `handle` for `holder` (None: a new implicit record of `owner`), then release what is over
        the limits: first the owner's quota (its own oldest), then the server's (the least KV kept)."""
        handle.since = self.clock()
        holder = holder or Conversation(handle.request_id, Kind.IMPLICIT, State.PAUSED, owner=owner)
        self._owned.setdefault(holder.owner, OrderedDict())[handle.request_id] = None
        self._owned_tokens[holder.owner] = self._owned_tokens.get(holder.owner, 0) + len(handle.token_ids)
        self.num_paused_tokens += len(handle.token_ids)
        n = len(handle.token_ids) // TOKEN_BLOCK
        key = self._block_key[handle.request_id] = _block_keys(handle.token_ids, n)[n]
        self._by_blocks.setdefault(key, {})[handle.request_id] = None
        if handle.call_ids:
            self._by_call_id.setdefault(handle.call_ids[0], {})[handle.request_id] = None
            self.remember_turn(handle.turn, holder.owner)
        self._give(holder, handle)
        quota = self.quotas.get(holder.owner)
        owned = self._owned.get(holder.owner)
        while quota is not None and owned and (
                (quota.max_paused is not None and len(owned) > quota.max_paused) or
                (quota.max_paused_tokens is not None and self._owned_tokens[holder.owner] > quota.max_paused_tokens)):
            self._unpause(self._paused[next(iter(owned))], "quota", f"over tenant {holder.owner}'s quota")
        policy = self.policy
        while self._paused and ((policy.max_paused is not None and len(self._paused) > policy.max_paused) or (
                policy.max_paused_tokens is not None and self.num_paused_tokens > policy.max_paused_tokens)):
            cheapest = min(self._paused, key=self.kept_tokens)  # min keeps the first (oldest) of equal keys
            self._unpause(self._paused[cheapest], "limits", "over the paused-generation limits")

    def adopt(self, holder: Conversation, request_id: str) -> None:
        """`holder` takes the handle of `request_id` if an implicit record holds it (the turn it served)."""
        current = self._paused.get(request_id)
        if current is not None and current.kind is Kind.IMPLICIT:
            handle, current.paused, current.state = current.paused, None, State.CLOSED
            self._give(holder, handle)

    def _give(self, holder: Conversation, handle: Paused) -> None:
        if holder.paused is not None and holder.paused is not handle:  # it moved on from its old one
            self._unpause(holder, "client", f"{holder.kind.value} {holder.id} continued differently")
        self._paused[handle.request_id] = holder
        holder.paused = handle
        if holder.state is State.CLOSED:  # closed while its turn ran: nothing will resume this
            self._unpause(holder, "client", f"{holder.kind.value} {holder.id} closed")

    def take(self, handle: Paused | None) -> Paused | None:
        """Claim `handle` for resuming: it leaves the store (a concurrent claim gets None)."""
        holder = self._paused.get(handle.request_id) if handle is not None else None
        if holder is None or holder.paused is not handle:
            return None
        self._drop(holder)
        return handle

    def release_paused(self, holder: Conversation, reason: str, cause: str = "client") -> None:
        """Abort the generation `holder` holds, if any."""
        if holder.paused is not None:
            self._unpause(holder, cause, reason)

    def release_all(self, cause: str, reason: str) -> None:
        for holder in list(self._paused.values()):
            self._unpause(holder, cause, reason)

    def _unpause(self, holder: Conversation, cause: str, reason: str) -> None:
        self.release(self._drop(holder).request_id, cause, reason)

    def _drop(self, holder: Conversation) -> Paused:
        handle, holder.paused = holder.paused, None
        del self._paused[handle.request_id]
        self.num_paused_tokens -= len(handle.token_ids)
        key = self._block_key.pop(handle.request_id)
        bucket = self._by_blocks[key]
        del bucket[handle.request_id]
        if not bucket:
            del self._by_blocks[key]
        if handle.call_ids:
            bucket = self._by_call_id[handle.call_ids[0]]
            del bucket[handle.request_id]
            if not bucket:
                del self._by_call_id[handle.call_ids[0]]
        owned = self._owned[holder.owner]
        del owned[handle.request_id]
        self._owned_tokens[holder.owner] -= len(handle.token_ids)
        if not owned:
            del self._owned[holder.owner], self._owned_tokens[holder.owner]
        if holder.kind is Kind.IMPLICIT:
            holder.state = State.CLOSED
        return handle

    def find_for_messages(self, messages: Sequence[Message], holder: Conversation | None = None,
                          owner: str | None = None) -> Paused | None:
        """The handle `messages` continues: `holder`'s, or one of `owner`'s found by the last assistant
        turn's call ids (the newest that it continues, where several share them)."""
        if holder is not None:
            handle = holder.paused
            return handle if handle is not None and handle.continues(messages) else None
        k = len(messages) - 1
        while k >= 0 and messages[k].role == "tool":
            k -= 1
        if k < 0 or k == len(messages) - 1 or not messages[k].tool_calls:
            return None
        for request_id in reversed(self._by_call_id.get(messages[k].tool_calls[0].id, {})):
            found = self._paused[request_id]
            if found.owner == owner and found.paused.continues(messages):
                return found.paused
        return None

    def tools_to_resume(self, messages: Sequence[Message], holder: Conversation | None = None,
                        owner: str | None = None) -> tuple[ToolSpec, ...]:
        """The tools a request without tools that continues `messages` is served with: those the prompt of
        the paused generation it continues rendered (`resume_without_tools`); none without that policy, or
        where `messages` continue no paused generation."""
        if not self.policy.resume_without_tools:
            return ()
        handle = self.find_for_messages(messages, holder, owner)
        return handle.tools if handle is not None else ()

    def find_for_tokens(self, token_ids: Sequence[int], owner: str | None = None) -> Paused | None:
        """The handle of `owner`'s whose whole token sequence `token_ids` strictly extends (the longest). Candidates
        share `token_ids`' first full blocks, found by key, longest first: O(len(token_ids))."""
        keys = _block_keys(token_ids, max(len(token_ids) - 1, 0) // TOKEN_BLOCK)
        for key in reversed(keys):
            best = None
            for request_id in self._by_blocks.get(key, ()):
                if self._paused[request_id].owner != owner:
                    continue
                handle = self._paused[request_id].paused
                n = len(handle.token_ids)
                if n < len(token_ids) and (best is None or n > len(best.token_ids)) \
                        and list(token_ids[:n]) == handle.token_ids:
                    best = handle
            if best is not None:
                return best
        return None

    # -- named records (chat `session_id`, native sessions) and stored responses -------------------
    def named(self, kind: Kind, id: str, owner: str | None = None) -> Conversation | None:
        """`owner`'s record (kind, id); None if there is none (another tenant's is none of its business)."""
        record = self._named.get((owner, kind, id))
        if record is not None:
            self.touch(record)
        return record

    def holds(self, kind: Kind, id: str) -> bool:
        """Whether any tenant's record (kind, id) is here (what another replica asks before it forwards a
        request naming it: server/replica_forwarding.py)."""
        if kind is Kind.RESPONSE:
            self._expire_responses()
            return id in self._responses
        if kind is Kind.CONVERSATION:
            self._expire_conversations()
            return id in self._conversations
        if kind is Kind.ITEM:
            self._expire_responses()
            self._expire_conversations()
            return id in self._item_holders
        return (kind, id) in self._named_tenants

    def touch(self, record: Conversation) -> None:
        """`record` was used now: its idle TTL starts again (also when its request ends, so a turn that
        generated longer than the TTL does not leave its record to expire at once)."""
        record.last_used = self.clock()
        if record.kind in (Kind.CHAT, Kind.SESSION) and record.state is not State.CLOSED:
            self._named.move_to_end((record.owner, record.kind, record.id))
        elif record.kind is Kind.CONVERSATION and record.state is not State.CLOSED:
            self._conversations.move_to_end(record.id)

    def settle(self, record: Conversation | None) -> None:
        """The request `record` was generating for ended (or never started): it is paused if it holds a
        generation, else idle, and its TTL starts again."""
        if record is not None and record.state is State.GENERATING:
            record.state = State.PAUSED if record.paused is not None else State.IDLE
            self.touch(record)

    def open_named(self, kind: Kind, id: str, owner: str | None = None, **fields) -> Conversation:
        """`owner`'s named record (kind, id), created if new: past `max_named_sessions` the least recently
        used one that is not generating is closed (429 when every one is generating)."""
        record = self.named(kind, id, owner)
        if record is None:
            self._make_room(self._named, self.policy.max_named_sessions, "session")
            record = self._named[(owner, kind, id)] = Conversation(id, kind, last_used=self.clock(), owner=owner,
                                                                   **fields)
            self._named_tenants[(kind, id)] = self._named_tenants.get((kind, id), 0) + 1
        return record

    def store_response(self, response_id: str, body: dict, conversation: tuple[Message, ...],
                       request_id: str, owner: str | None = None, items: list[dict] | None = None) -> None:
        """Store a finished response (`items`: its input items); it takes the generation `request_id`
        paused at its calls, if any."""
        if self.policy.max_stored_responses == 0:
            return
        self._expire_responses()
        while len(self._responses) >= self.policy.max_stored_responses:
            self.close(next(iter(self._responses.values())), "limits", "over the stored-response limit")
        state = State.PAUSED if conversation[-1].tool_calls else State.IDLE
        record = self._responses[response_id] = Conversation(response_id, Kind.RESPONSE, state, messages=conversation,
                                                             body=body, items=items or [], last_used=self.clock(),
                                                             owner=owner)
        self._index_items(record)
        self.adopt(record, request_id)

    def response(self, response_id: str, owner: str | None = None) -> Conversation | None:
        self._expire_responses()
        record = self._responses.get(response_id)
        return record if record is not None and record.owner == owner else None

    def _make_room(self, records: OrderedDict, limit: int, what: str) -> None:
        """Close the least recently used of `records` not generating until one more fits in `limit` (429
        when every one is generating)."""
        while len(records) >= limit:
            victim = next((r for r in records.values() if r.state is not State.GENERATING), None)
            if victim is None:
                raise APIError(429, f"too many {what}s generating (limit {limit})", code="rate_limit_exceeded",
                               headers={"Retry-After": "1"})
            self.close(victim, "limits", f"over the {what} limit")

    def open_conversation(self, conversation_id: str, body: dict, owner: str | None = None) -> Conversation:
        """A new conversation of `owner`'s: past `max_conversations` the least recently used one that is not
        generating is closed (429 when every one is generating)."""
        self._expire_conversations()
        self._make_room(self._conversations, self.policy.max_conversations, "conversation")
        record = self._conversations[conversation_id] = Conversation(conversation_id, Kind.CONVERSATION, body=body,
                                                                     last_used=self.clock(), owner=owner)
        return record

    def keep_items(self, record: Conversation, items: list[dict], messages: tuple[Message, ...]) -> None:
        """A conversation's items are `items` now, and `messages` (the chat messages they make) its history."""
        self._unindex_items(record)
        record.items, record.messages = items, messages
        self._index_items(record)

    def item(self, item_id: str, owner: str | None = None) -> dict | None:
        """The item `item_id` (what an `item_reference` names) as the newest of `owner`'s records keeping it
        has it: the stored response or conversation that stored or edited its items last. None if none of
        `owner`'s keeps it. O(the records keeping it)."""
        self._expire_responses()
        self._expire_conversations()
        for record, item in reversed(self._item_holders.get(item_id, {}).items()):
            if record.owner == owner:
                return item
        return None

    @staticmethod
    def _kept_items(record: Conversation) -> list[dict]:
        """The items a stored response (its output first: a client id in its input never shadows an item
        it generated, and its input items) or a conversation keeps."""
        return (record.body["output"] if record.kind is Kind.RESPONSE else []) + record.items

    def _index_items(self, record: Conversation) -> None:
        for item in self._kept_items(record):
            self._item_holders.setdefault(item["id"], {}).setdefault(record, item)

    def _unindex_items(self, record: Conversation) -> None:
        for item in self._kept_items(record):
            holders = self._item_holders.get(item["id"], {})
            holders.pop(record, None)
            if not holders:
                self._item_holders.pop(item["id"], None)

    def conversation(self, conversation_id: str, owner: str | None = None) -> Conversation | None:
        """`owner`'s conversation, its TTL started again; None if there is none."""
        self._expire_conversations()
        record = self._conversations.get(conversation_id)
        if record is None or record.owner != owner:
            return None
        self.touch(record)
        return record

    def close(self, record: Conversation, cause: str = "client", reason: str | None = None) -> None:
        """Forget `record`, releasing the generation it holds."""
        record.state = State.CLOSED
        if record.kind is Kind.RESPONSE:
            del self._responses[record.id]
            self._unindex_items(record)
        elif record.kind is Kind.CONVERSATION:
            del self._conversations[record.id]
            self._unindex_items(record)
        elif record.kind is not Kind.IMPLICIT:
            del self._named[(record.owner, record.kind, record.id)]
            if (left := self._named_tenants.pop((record.kind, record.id)) - 1) > 0:
                self._named_tenants[(record.kind, record.id)] = left
        self.release_paused(record, reason or f"{record.kind.value} {record.id} closed", cause)

    # -- time --------------------------------------------------------------------------------------
    def expire(self) -> None:
        """Release handles paused longer than `idle_ttl`, close named records unused that long (never
        one generating, nor a session whose post is still in flight: its turn may have ended, the session
        idle or paused, while the post's cleanup, which starts the TTL again, has yet to run) and
        responses past `response_ttl`. O(what expires): each order is age order."""
        now, ttl = self.clock(), self.policy.idle_ttl
        while self._paused:
            holder = next(iter(self._paused.values()))
            if now - holder.paused.since <= ttl:
                break
            self._unpause(holder, "ttl", "paused longer than the TTL")
        stale = []
        for record in self._named.values():
            if now - record.last_used <= ttl:
                break
            if record.state is not State.GENERATING and record.task is None:
                stale.append(record)
        for record in stale:
            self.close(record, "ttl", f"{record.kind.value} {record.id} unused longer than the TTL")
        self._expire_responses()
        self._expire_conversations()

    def _expire_responses(self) -> None:
        now = self.clock()
        while self._responses:
            oldest = next(iter(self._responses.values()))
            if now - oldest.last_used <= self.policy.response_ttl:
                break
            self.close(oldest, "ttl", f"response {oldest.id} past its TTL")

    def _expire_conversations(self) -> None:
        now = self.clock()
        stale = []
        for record in self._conversations.values():  # (least recently used first)
            if now - record.last_used <= self.policy.response_ttl:
                break
            if record.state is not State.GENERATING:
                stale.append(record)
        for record in stale:
            self.close(record, "ttl", f"conversation {record.id} unused longer than --response-ttl")

    async def reap(self) -> None:
        """The TTL loop, for the app's lifetime."""
        interval = min(max(min(self.policy.idle_ttl, self.policy.response_ttl) / 4, 0.05), 5.0)
        while True:
            await asyncio.sleep(interval)
            self.expire()

    # -- generated assistant turns -----------------------------------------------------------------
    def remember_turn(self, turn: AssistantTurn, owner: str | None = None) -> None:
        key = owner, tuple(c.id for c in turn.message.tool_calls)
        same = self._turns.setdefault(key, [])
        if turn not in same:
            same.append(turn)
            self._num_turns += 1
        self._turns.move_to_end(key)
        while self._num_turns > self.policy.max_remembered_turns:
            self._num_turns -= len(self._turns.popitem(last=False)[1])

    def known_turn(self, message: Message, owner: str | None = None) -> AssistantTurn | None:
        """The generated turn of `owner` that `message` repeats (same call ids, JSON-equal arguments, same
        content). None where turns that differ (their tokens: a thinking model's thinking) repeat it alike:
        which one the conversation holds is unknown, and its template renders it instead. Another tenant's
        turn is never found: its tokens may hold what that tenant was never shown (a model's thinking)."""
        key = owner, tuple(c.id for c in message.tool_calls)
        matches = [t for t in self._turns.get(key, ()) if t.message == message]
        if not matches or any((t.token_ids, t.template_kwargs) != (matches[0].token_ids, matches[0].template_kwargs)
                              for t in matches[1:]):
            return None
        return matches[0]
