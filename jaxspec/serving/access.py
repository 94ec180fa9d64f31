"""Who may call the server and how much they may send, as one ASGI middleware in front of the app (`Guard`).

- API keys: with `AccessConfig.api_keys`, every /v1/* route and /tokenize and /detokenize need `Authorization: Bearer
  KEY` (what OpenAI's clients send), compared in constant time (`hmac.compare_digest`, over every key); a missing or
  wrong key is a 401 with OpenAI's error body. /health, /version and /metrics stay open (docs/serving.md, Security).
- Tenants: with `salt_by_key`, the key a request came with partitions the prefix cache (`cache_partition`): tenants
  with different keys never share cached blocks, so `cached_tokens` and time to first token tell a tenant nothing
  about another's prompts.
- Bodies: a body larger than `max_body_bytes` is a 413 (a declared Content-Length is refused before any of it is
  read); a body that has not fully arrived `body_timeout` seconds after the request began is a 408 and the
  connection is closed, so half-sent bodies cannot hold connections open.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import ipaddress
import json
import logging
import math

log = logging.getLogger("jaxspec.serving")
KEY_ENV = "JAXSPEC_API_KEY"  # comma-separated keys: they stay out of `ps`
PROTECTED = ("/v1/", "/tokenize", "/detokenize")
TENANT = "jaxspec.tenant"  # scope["state"] key: the partition of the request's key (with salt_by_key)


@dataclasses.dataclass(frozen=True)
class AccessConfig:
    api_keys: tuple[str, ...] = ()  # none: no authentication
    salt_by_key: bool = False  # each key's requests share prefix-cache blocks only with requests of the same key
    max_body_bytes: int = 8 * 2**20
    body_timeout: float = 30.0  # seconds from the request's start to the end of its body

    def __post_init__(self):
        if any(not isinstance(k, str) or not k.strip() for k in self.api_keys):
            raise ValueError("api_keys: expected non-empty strings")
        if self.salt_by_key and not self.api_keys:
            raise ValueError("salt_by_key: partitions the prefix cache by API key, so it needs api_keys")
        if isinstance(self.max_body_bytes, bool) or not isinstance(self.max_body_bytes, int) or self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes: expected an integer >= 1, got {self.max_body_bytes!r}")
        if not 0 < self.body_timeout < math.inf:
            raise ValueError(f"body_timeout: expected a positive number of seconds, got {self.body_timeout!r}")


def keys_from(flags: list[str] | None, environ: dict[str, str]) -> tuple[str, ...]:
    """The API keys of the --api-key flags, else of $JAXSPEC_API_KEY (comma-separated)."""
    keys = flags or environ.get(KEY_ENV, "").split(",")
    return tuple(k.strip() for k in keys if k.strip())


def cache_partition(key: str | None, cache_salt: str | None) -> str | None:
    """The prefix cache's salt of a request with `cache_salt` sent with API `key` (None: no partition by key); the
    key itself is hashed, never kept in a plan or a log."""
    if key is None:
        return cache_salt
    material = key.encode() + b"\0" + (cache_salt or "").encode()
    return "key:" + hashlib.blake2b(material, digest_size=16).hexdigest()


def warn_if_exposed(host: str, config: AccessConfig) -> None:
    """A warning when `host` is not a loopback address and no API key is set: anyone who can reach it may generate."""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback and not config.api_keys:
        log.warning(
            "serving on %s without an API key: anyone who can reach this address can generate and read /metrics; "
            "set --api-key or $%s (docs/serving.md, Security)",
            host,
            KEY_ENV,
        )


class Guard:
    """The ASGI middleware of `AccessConfig` (see the module's docstring)."""

    def __init__(self, app, config: AccessConfig):
        self.app, self.config = app, config
        self._keys = [k.encode() for k in config.api_keys]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self._keys and scope["path"].startswith(PROTECTED):
            key = self._match(scope)
            if key is None:
                return await _refuse(send, 401, "missing or invalid API key (expected Authorization: Bearer KEY)")
            if self.config.salt_by_key:
                scope.setdefault("state", {})[TENANT] = key
        body = await self._read(scope, receive, send)
        if body is None:
            return None
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # the disconnect a stream waits for

        return await self.app(scope, replay, send)

    def _match(self, scope) -> str | None:
        """The key of the request's bearer token, else None; every key is compared, each in constant time."""
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        token = token.strip() if scheme.lower() == b"bearer" else b""
        found = None
        for key in self._keys:
            if hmac.compare_digest(token, key):
                found = key.decode()
        return found

    async def _read(self, scope, receive, send) -> bytes | None:
        """The whole body within the limits; None when refused (the refusal sent) or the client went away."""
        limit = self.config.max_body_bytes
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        if not declared.isdigit() or int(declared) > limit:
            await _refuse(send, 413, f"request body: expected at most {limit} bytes, got {declared.decode()!r}")
            return None
        body = bytearray()
        try:
            async with asyncio.timeout(self.config.body_timeout):
                more = True
                while more:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return None
                    body += message.get("body", b"")
                    more = message.get("more_body", False)
                    if len(body) > limit:
                        await _refuse(send, 413, f"request body: expected at most {limit} bytes")
                        return None
        except TimeoutError:
            timeout = self.config.body_timeout
            await _refuse(send, 408, f"request body: not received within {timeout:g} s", close=True)
            return None
        return bytes(body)


async def _refuse(send, status: int, message: str, close: bool = False) -> None:
    """An OpenAI error body (401: invalid_api_key) sent straight from the middleware."""
    code = {401: "invalid_api_key", 408: "request_timeout", 413: "request_too_large"}[status]
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}})
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body.encode()})
