"""The operator's MCP servers (`--mcp-config FILE`), read from the `mcpServers` JSON shape that MCP
clients share:

    {"mcpServers": {
        "calc": {"command": "python", "args": ["calc_server.py"], "env": {"KEY": "value"}, "cwd": "/srv"},
        "web":  {"url": "https://tools.example.com/mcp", "headers": {"Authorization": "Bearer ..."}}}}

An entry with `command` is started as a subprocess and spoken to over stdio; an entry with `url` over
streamable HTTP. An optional `type` (`stdio`, `http`, `streamable-http`) must agree; `sse` (the old
HTTP transport) is refused. `"disabled": true` leaves an entry out. Keys other clients add
(`autoApprove`, ...) are ignored with a warning. This module only reads the file (no SDK import): server/mcp_tools.py connects.

Server names become the prefix of the function names the model sees (`calc__multiply`), so they are
letters, digits and `-`, with single `_` inside: never `__`, which separates server and tool.
"""
from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

logger = logging.getLogger("infercept.server")

SERVER_NAME = re.compile(r"^[A-Za-z0-9-]+(?:_[A-Za-z0-9-]+)*$")
_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_\-.]{1,64}$")
_OUTSIDE_NAME = re.compile(r"[^A-Za-z0-9_\-.]")
_KNOWN_KEYS = {"command", "args", "env", "cwd", "url", "headers", "type", "disabled"}
_HTTP_TYPES = {"http", "streamable-http", "streamable_http", "streamableHttp"}


@dataclass(frozen=True)
class McpServerConfig:
    """One MCP server: a command (stdio) or a URL (streamable HTTP)."""

    name: str
    command: str | None = None
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))  # over a minimal safe environment
    cwd: str | None = None
    url: str | None = None
    headers: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def transport(self) -> str:
        return "stdio" if self.command is not None else "http"


def load_mcp_config(path: str | Path) -> tuple[McpServerConfig, ...]:
    """The servers of an `mcpServers` file; ValueError naming the entry and key when it is malformed."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--mcp-config {path}: {e}") from None
    servers = data.get("mcpServers") if isinstance(data, dict) else None
    if not isinstance(servers, dict):
        raise ValueError(f"--mcp-config {path}: expected a JSON object with an \"mcpServers\" object")
    return tuple(_server(name, entry, f"--mcp-config {path}: mcpServers.{name}") for name, entry in servers.items()
                 if not (isinstance(entry, dict) and entry.get("disabled") is True))


def _server(name: str, entry: Any, where: str) -> McpServerConfig:
    if not SERVER_NAME.match(name) or len(name) > 32:
        raise ValueError(f"{where}: a server name is up to 32 letters, digits and '-', with single '_' inside")
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: expected an object")
    ignored = sorted(set(entry) - _KNOWN_KEYS)
    if ignored:
        logger.warning("%s: ignoring %s", where, ", ".join(ignored))
    command, url, kind = entry.get("command"), entry.get("url"), entry.get("type")
    if (command is None) == (url is None):
        raise ValueError(f"{where}: give either \"command\" (stdio) or \"url\" (streamable HTTP)")
    if kind is not None and not (kind == "stdio" if command is not None else kind in _HTTP_TYPES):
        raise ValueError(f"{where}: type {kind!r} does not fit its {'command' if command else 'url'} "
                         "(the SSE transport is not supported)")
    if command is not None:
        args = entry.get("args", [])
        if not isinstance(command, str) or not command:
            raise ValueError(f"{where}.command: expected a non-empty string")
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise ValueError(f"{where}.args: expected a list of strings")
        cwd = entry.get("cwd")
        if cwd is not None and not isinstance(cwd, str):
            raise ValueError(f"{where}.cwd: expected a string")
        return McpServerConfig(name, command=command, args=tuple(args), env=_strings(entry, "env", where), cwd=cwd)
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError(f"{where}.url: expected an http:// or https:// URL")
    return McpServerConfig(name, url=url, headers=_strings(entry, "headers", where))


def _strings(entry: dict, key: str, where: str) -> Mapping[str, str]:
    value = entry.get(key, {})
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise ValueError(f"{where}.{key}: expected an object of strings")
    return MappingProxyType(dict(value))


def function_name(server: str, tool: str) -> str:
    """The function name the model calls for `tool` of `server`: `<server>__<tool>` when that is a valid
    function name; otherwise its characters outside [A-Za-z0-9_.-] become `_`, it is cut to 55
    characters and `_` plus the first 8 hex digits of sha256("<server>/<tool>") are appended, so tools
    whose names differ only in what was replaced or cut keep different names."""
    name = f"{server}__{tool}"
    if _FUNCTION_NAME.match(name):
        return name
    digest = hashlib.sha256(f"{server}/{tool}".encode()).hexdigest()[:8]
    return f"{_OUTSIDE_NAME.sub('_', name)[:55]}_{digest}"
