"""Requests that name a conversation another replica holds, forwarded to that replica (replicas behind a
router, server/replicas.py).

The router sends a request where its policy says, which for some clients is not the replica holding the
conversation the request continues: a Responses chain (`previous_response_id`), a Responses
conversation (`conversation`, and /v1/conversations/{id} with its items), or a chat session named
only in the X-Session-Id header under cache_aware, a chat session named without that header under
kv_aware, any of them under round_robin; and a Responses input that refers to stored items by
`item_reference` alone (the AI SDK with `store`), which no router policy follows. So each replica knows
the fleet (a file the launcher writes and rewrites as the fleet grows and shrinks: the replicas' URLs
and a token only the fleet knows; without the launcher, on Kubernetes, a DNS name that resolves to every
replica's address and a token every replica is given: DnsFleet), and a request naming a conversation
(or an item) this replica does not hold:

- asks the other replicas whether they hold it (`GET /internal/fleet/holds?kind=...&id=...` with the
  fleet's token, answered by this layer for any tenant's record: the holder's server checks the key and
  the owner as it always does);
- goes, as it came, to the one that does, whose answer is relayed (status, headers, and the body as it
  streams, server-sent events included; a client that disconnects closes the forwarded request too, so
  the holder stops its turn as it would for its own client); the holder sees the fleet's token and
  serves the request itself;
- is served here when none holds it (a new chat session starts here; an unknown response is a 404, as
  on one server), or when the holder cannot be reached (it died, and its conversations with it).

Which replica holds what is remembered (up to REMEMBERED_HOLDERS), so a conversation's later requests
go straight there.

A request that names no conversation held anywhere but carries OpenAI's `prompt_cache_key` (chat
completions, Responses) is served by the key's home: the replica that rendezvous hashing of the key over
the fleet picks, the same on every replica without asking, so the requests of one key (an agent's
conversation: Codex sends its session's id, and the whole input each turn) reach the replica that has
their prefix cached and their generation paused, whatever the router's policy. A fleet that grows or
shrinks moves only the keys the new or gone replica wins; a home that cannot be reached leaves the
request here.
"""
from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import json
import logging
import os
import re
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from urllib.parse import parse_qs

import httpx

from .conversations import Kind
from .protocol_responses import input_item_type

logger = logging.getLogger("infercept.server")

HOLDS_PATH = "/internal/fleet/holds"
FLEET_HEADER = b"x-infercept-fleet"  # the fleet's token: a request from a replica, or a question from one
NAMED_KINDS = {Kind.CHAT.value, Kind.SESSION.value, Kind.RESPONSE.value, Kind.CONVERSATION.value, Kind.ITEM.value}
REMEMBERED_HOLDERS = 100_000
ASK_TIMEOUT_S = 2.0
RESOLVE_EVERY_S = 5.0  # how often a DnsFleet looks its name up again (pods come and go)
# Hop-by-hop headers (RFC 9110 §7.6.1) and those the forwarding client sets itself
NOT_FORWARDED = {b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer", b"transfer-encoding",
                 b"upgrade", b"host", b"content-length", FLEET_HEADER}
NOT_RELAYED = {b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer", b"transfer-encoding", b"upgrade"}

NAMING_POSTS = ("/v1/responses", "/v1/chat/completions")  # POSTs whose body may name a conversation or a key
CACHE_KEY = "prompt_cache_key"  # (also the forwarded-requests metric's kind for requests sent to their key's home)
_RESPONSE = re.compile(r"/v1/responses/([^/]+)(?:/cancel|/input_items)?")
_SESSION = re.compile(r"/v1/sessions/([^/]+)(?:/messages)?")
_CONVERSATION = re.compile(r"/v1/conversations/([^/]+)(?:/items(?:/[^/]+)?)?")


def named_conversation(method: str, path: str, headers: dict[bytes, bytes], body: bytes,
                       fields: Callable[[], dict]) -> tuple[Kind, str] | None:
    """The conversation a request continues or reads, by kind and id; None for one that names none.
    `fields()`: the body's JSON object (`body_fields`), parsed only where needed."""
    if (m := _RESPONSE.fullmatch(path)) is not None:
        return Kind.RESPONSE, m.group(1)
    if (m := _SESSION.fullmatch(path)) is not None:
        return Kind.SESSION, m.group(1)
    if (m := _CONVERSATION.fullmatch(path)) is not None:
        return Kind.CONVERSATION, m.group(1)
    if method != "POST" or path not in NAMING_POSTS:
        return None
    if path == "/v1/responses":
        if b"previous_response_id" in body or b"conversation" in body:  # (most: no JSON to parse)
            named, conversation = fields().get("previous_response_id"), fields().get("conversation")
            if isinstance(conversation, dict):  # ({"id": ...})
                conversation = conversation.get("id")
            if isinstance(conversation, str) and conversation:
                return Kind.CONVERSATION, conversation
            if isinstance(named, str) and named:
                return Kind.RESPONSE, named
        if b"item_reference" in body or b'"id"' in body:  # (a reference may leave its type out)
            return first_reference(fields().get("input"))
        return None
    if b"session_id" not in body and b"x-session-id" not in headers:
        return None
    named = fields().get("session_id") or headers.get(b"x-session-id", b"").decode("latin-1")
    return (Kind.CHAT, named) if isinstance(named, str) and named else None


def first_reference(input) -> tuple[Kind, str] | None:
    """The item the first `item_reference` of a Responses input names: the oldest item a client that
    sends references (the AI SDK with `store`) refers to, so the replica that holds it is the one its
    conversation's responses were stored on, which holds the later items too."""
    for item in input if isinstance(input, list) else ():
        if input_item_type(item) == "item_reference":
            return (Kind.ITEM, item["id"]) if isinstance(item.get("id"), str) and item["id"] else None
    return None


def prompt_cache_key(method: str, path: str, body: bytes, fields: Callable[[], dict]) -> str | None:
    """The request's `prompt_cache_key`, if it carries one (`fields` as for `named_conversation`)."""
    if method != "POST" or path not in NAMING_POSTS or CACHE_KEY.encode() not in body:
        return None
    key = fields().get(CACHE_KEY)
    return key if isinstance(key, str) and key else None


def body_fields(body: bytes) -> Callable[[], dict]:
    """The body's JSON object ({} for anything else), parsed on the first call and kept for the next: a
    body that names both a conversation and a key is parsed once."""
    @functools.cache
    def fields() -> dict:
        try:
            parsed = json.loads(body)
        except ValueError:
            return {}
        return parsed if isinstance(parsed, dict) else {}
    return fields


def _may_name(method: str, path: str) -> bool:
    return ((method == "POST" and path in NAMING_POSTS)
            or path.startswith(("/v1/responses/", "/v1/sessions/", "/v1/conversations/")))


class Fleet:
    """The replicas (their URLs), this one's own URL among them, and the token they share; where they
    come from is a subclass's (`_read`, called before each look, brings them up to date)."""

    def __init__(self, own_url: str, token: str = ""):
        self.own_url = own_url
        self._token, self._urls = token, []

    def _read(self) -> None:
        pass

    @property
    def token(self) -> bytes:
        self._read()
        return self._token.encode()

    def peers(self) -> list[str]:
        self._read()
        return [u for u in self._urls if u != self.own_url]

    def home(self, key: str) -> str | None:
        """The replica whose URL hashes highest with `key` (rendezvous hashing); None for an empty fleet."""
        self._read()
        return max(self._urls, default=None,
                   key=lambda url: hashlib.blake2b(f"{url} {key}".encode(), digest_size=8).digest())


class FleetFile(Fleet):
    """The fleet as the launcher last wrote it: {"token": ..., "replicas": [URL, ...]} (read again when
    the file changes)."""

    def __init__(self, path: str | Path, own_url: str):
        super().__init__(own_url)
        self.path = Path(path)
        self._stamp: tuple[int, int] | None = None

    def _read(self) -> None:
        try:
            st = os.stat(self.path)
        except OSError:
            return  # (not written yet, or the launcher is gone: the last fleet stands)
        if (st.st_mtime_ns, st.st_size) == self._stamp:
            return
        try:
            fleet = json.loads(self.path.read_text())
            self._token, self._urls = str(fleet["token"]), [str(u) for u in fleet["replicas"]]
        except (OSError, ValueError, KeyError, TypeError):
            return  # (mid-write: the next request reads it)
        self._stamp = (st.st_mtime_ns, st.st_size)


class DnsFleet(Fleet):
    """The fleet as DNS names it, where no launcher writes a file: on Kubernetes a headless Service's name
    resolves to the address of every ready pod. The replicas are those addresses at `port` (resolved
    again every RESOLVE_EVERY_S, in a thread of its own, so no request waits on DNS), this one
    `own_address` among them, and the token one the deployment gives every pod (a Secret)."""

    def __init__(self, name: str, port: int, token: str, own_address: str):
        super().__init__(_url(own_address, port), token)
        self.name, self.port = name, port
        self._resolving, self._resolved_at = False, 0.0
        self._resolve()  # (the first requests know the fleet)

    def _read(self) -> None:
        if not self._resolving and time.monotonic() - self._resolved_at >= RESOLVE_EVERY_S:
            self._resolving = True
            threading.Thread(target=self._resolve, name="fleet-dns", daemon=True).start()

    def _resolve(self) -> None:
        try:
            found = socket.getaddrinfo(self.name, self.port, type=socket.SOCK_STREAM)
            self._urls = sorted({_url(address[4][0], self.port) for address in found})
        except OSError as e:  # (the last fleet stands)
            logger.warning("the fleet's name %s does not resolve (%s); the last fleet stands", self.name, e)
        finally:
            self._resolved_at, self._resolving = time.monotonic(), False


def _url(address: str, port: int) -> str:
    return f"http://[{address}]:{port}" if ":" in address else f"http://{address}:{port}"


def write_fleet(path: str | Path, token: str, replicas: list[str]) -> None:
    """The launcher's side: the fleet file, replaced whole (a replica never reads half of it)."""
    path = Path(path)
    partial = path.with_suffix(".tmp")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # (the token is the fleet's secret)
    with os.fdopen(fd, "w") as f:
        json.dump({"token": token, "replicas": replicas}, f)
    os.replace(partial, path)


class ForwardToHolder:
    """ASGI middleware (outermost, before the server's own gate): see the module docstring."""

    def __init__(self, app, fleet: Fleet):
        self.app, self.fleet = app, fleet
        self.holders: OrderedDict[tuple[Kind, str], str] = OrderedDict()
        self._client: httpx.AsyncClient | None = None

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:  # (made in the server's event loop, on first use)
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(5.0, read=None, write=60.0))
        return self._client

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        method, path = scope["method"], scope["path"]
        if path != HOLDS_PATH and not _may_name(method, path):  # (most requests: not even the fleet file read)
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        token = self.fleet.token
        from_fleet = bool(token) and hmac.compare_digest(headers.get(FLEET_HEADER, b""), token)
        if path == HOLDS_PATH:
            return await self._answer_holds(scope, send, from_fleet)
        if from_fleet:
            return await self.app(scope, receive, send)
        body, replay = await buffered(receive)
        if body is None:  # the client went away before sending its body
            return await self.app(scope, replay, send)
        fields = body_fields(body)
        named = named_conversation(method, path, headers, body, fields)
        if named is not None:
            if scope["app"].state.holds(*named):
                return await self.app(scope, replay, send)
            if (holder := await self._holder(named)) is not None:
                if not await self._forward(holder, named[0].value, f"{named[0].value} {named[1]}", scope, body,
                                           receive, send):
                    self.holders.pop(named, None)
                    return await self.app(scope, replay, send)
                return
        key = prompt_cache_key(method, path, body, fields)
        home = self.fleet.home(key) if key is not None else None
        if home in (None, self.fleet.own_url) or not await self._forward(
                home, CACHE_KEY, f"{CACHE_KEY} {key!r}", scope, body, receive, send):
            return await self.app(scope, replay, send)

    # -- which replica holds it --------------------------------------------------------------------
    async def _answer_holds(self, scope, send, from_fleet: bool) -> None:
        if not from_fleet:
            return await _send_json(send, 404, {"error": {"message": "Not Found"}})
        query = parse_qs(scope["query_string"].decode("latin-1"))
        kind, named = query.get("kind", [""])[0], query.get("id", [""])[0]
        if kind not in NAMED_KINDS or not named:
            return await _send_json(send, 400, {"error": {"message": "give kind (chat, session, response, conversation, item) and id"}})
        await _send_json(send, 200, {"holds": scope["app"].state.holds(Kind(kind), named)})

    async def _holder(self, named: tuple[Kind, str]) -> str | None:
        peers = self.fleet.peers()
        known = self.holders.get(named)
        if known in peers:
            self.holders.move_to_end(named)
            return known
        answers = await asyncio.gather(*(self._holds(peer, named) for peer in peers))
        holder = next((peer for peer, holds in zip(peers, answers) if holds), None)
        if holder is not None:
            self.holders[named] = holder
            while len(self.holders) > REMEMBERED_HOLDERS:
                self.holders.popitem(last=False)
        return holder

    async def _holds(self, peer: str, named: tuple[Kind, str]) -> bool:
        try:
            r = await self.client.get(peer + HOLDS_PATH, params={"kind": named[0].value, "id": named[1]},
                                      headers={FLEET_HEADER.decode(): self.fleet.token.decode()},
                                      timeout=ASK_TIMEOUT_S)
            return r.status_code == 200 and r.json().get("holds") is True
        except (httpx.HTTPError, ValueError):
            return False

    # -- forwarding --------------------------------------------------------------------------------
    async def _forward(self, holder: str, kind: str, what: str, scope, body: bytes, receive, send) -> bool:
        """The request sent to `holder` (which holds `what`, counted under `kind`) and its answer relayed;
        False if the holder could not be reached (nothing was sent to the client then)."""
        query = scope["query_string"].decode("latin-1")
        url = holder + scope["path"] + (f"?{query}" if query else "")
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in NOT_FORWARDED]
        headers.append((FLEET_HEADER, self.fleet.token))
        request = self.client.build_request(scope["method"], url, headers=headers, content=body)
        try:
            response = await self.client.send(request, stream=True)
        except httpx.HTTPError as e:
            logger.warning("%s is at replica %s, which cannot be reached (%s); serving the request here", what, holder, e)
            return False
        logger.info("%s %s: %s is at %s; forwarded there", scope["method"], scope["path"], what, holder)
        metrics = scope["app"].state.metrics
        metrics.forwarded.labels(metrics.model, kind).inc()
        relay = asyncio.ensure_future(_relay(response, send))
        gone = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait({relay, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not relay.done():  # the client left: closing the forwarded request stops the holder's turn
                relay.cancel()
            await asyncio.gather(relay, gone, return_exceptions=True)
            await response.aclose()
        return True


async def _relay(response: httpx.Response, send) -> None:
    await send({"type": "http.response.start", "status": response.status_code,
                "headers": [(k, v) for k, v in response.headers.raw if k.lower() not in NOT_RELAYED]})
    async for chunk in response.aiter_raw():
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def buffered(receive):
    """The request's whole body and a `receive` that gives it again; (None, ...) if the client left."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None, _replay([message], receive)
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    body = b"".join(chunks)
    return body, buffered_replay(body, receive)


def buffered_replay(body: bytes, receive):
    """A `receive` that gives `body` (whole) first, then what the client sends (its disconnect)."""
    return _replay([{"type": "http.request", "body": body, "more_body": False}], receive)


def _replay(messages: list, receive):
    async def replay():
        return messages.pop(0) if messages else await receive()
    return replay


async def _send_json(send, status: int, payload: dict) -> None:
    body = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
