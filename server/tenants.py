"""Tenants: API keys, which tenant a request is, and the keys file.

Every conversation record and paused generation belongs to the tenant whose key created it
(`Conversation.owner`); the conversation store finds a record only for its owner, so another key gets
404 on it, never a 403 that would confirm it exists (server/conversations.py). Without API keys there
is one anonymous tenant (owner None).

A key is compared in constant time, against every configured key (no early exit), so neither the
time nor the order of the keys tells how much of a guessed key was right.
"""
from __future__ import annotations

import hmac
from pathlib import Path

from starlette.requests import Request

from .settings import Tenant

STATE_KEY = "tenant"  # in the ASGI scope's state: the authenticated tenant's name


class Authenticator:
    def __init__(self, tenants: tuple[Tenant, ...]):
        self.tenants = tenants
        self._keys = [(t, t.key.encode()) for t in tenants]

    @property
    def enabled(self) -> bool:
        return bool(self.tenants)

    def tenant_for(self, authorization: str, api_key: str | None = None) -> Tenant | None:
        """The tenant of an `Authorization: Bearer KEY` header, or else of an `x-api-key: KEY` header (how
        Anthropic's clients send their key); None if no key matches."""
        scheme, _, token = authorization.partition(" ")
        presented = token.strip().encode() if scheme.lower() == "bearer" else (api_key or "").strip().encode()
        found = None
        for tenant, key in self._keys:
            if hmac.compare_digest(presented, key) and found is None:
                found = tenant
        return found


def owner_of(request: Request) -> str | None:
    """The tenant a request was authenticated as (None: the server has no API keys)."""
    return request.scope.get("state", {}).get(STATE_KEY)


def load_keys_file(path: str | Path) -> tuple[Tenant, ...]:
    """Tenants from a keys file: one per line, `KEY [NAME] [max_paused=N] [max_paused_tokens=N]`; blank
    lines and lines starting with `#` are skipped. A tenant without a name is named after its line."""
    tenants = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        key, name, quotas = words[0], f"line-{number}", {}
        for word in words[1:]:
            field, eq, value = word.partition("=")
            if not eq:
                name = word
            elif field in ("max_paused", "max_paused_tokens") and value.isdigit():
                quotas[field] = int(value)
            else:
                raise ValueError(f"{path}:{number}: {word!r} is not max_paused=N or max_paused_tokens=N")
        try:
            tenants.append(Tenant(name, key, **quotas))
        except ValueError as e:
            raise ValueError(f"{path}:{number}: {e}") from None
    return tuple(tenants)
