"""The server's front door, a pure ASGI middleware (so a handler still sees its client
leave: `receive()` passes through untouched).

In order, for every HTTP request:
- Host: the `Host` header must name the address the server is bound to (`--host`), a
  loopback name, or an `--allowed-host`; else 421 (a DNS-rebinding page cannot reach it).
- API key: `/v1/*` (and vLLM's `/rerank`, `/score`) need `Authorization: Bearer KEY` when the
  server has one; else 401.
- Content-Type: a POST's body must be `application/json`; else 415 (a cross-site form or
  text/plain POST, which a browser sends without asking, is never parsed).
- Anything the app raises becomes OpenAI's error object (500): before the response began,
  as the response; inside a Server-Sent Events stream, as an error event then `[DONE]`.
Refusals of chat requests are counted in `qwen3vl_requests_total{outcome="refused"}`.
"""

from __future__ import annotations

import hmac
import sys

from starlette.requests import ClientDisconnect

from runtime.serve.errors import ApiError, shown

LOOPBACK = ("127.0.0.1", "localhost", "::1")
CHAT_PATH = "/v1/chat/completions"
KEYED = ("/rerank", "/score")  # outside /v1/, but running the model like it


def allowed_hosts(host: str, port: int, extra=()) -> frozenset | None:
    """The Host header values a server bound to `host`:`port` answers: the loopback names,
    `host` and `extra`, each with and without the port; None when any is (`*` in `extra`).
    (A DNS-rebinding page makes the browser send its own name, which is none of these.)"""
    if "*" in extra:
        return None
    names = {host, *extra, *LOOPBACK}
    names = {f"[{n}]" if ":" in n and not n.startswith("[") else n for n in names}
    return frozenset(n.lower() for name in names for n in (name, f"{name}:{port}"))


def is_loopback(host: str) -> bool:
    return host in LOOPBACK or host.startswith("127.")


class Guard:
    def __init__(self, app, api_key: str | None, hosts: frozenset | None, metrics=None):
        self.app, self.api_key, self.hosts, self.metrics = app, api_key, hosts, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refusal = self.refusal(scope)
        if refusal is not None:
            self.count(scope, "refused")
            return await send_error(send, refusal)
        sent = Sent(send)
        try:
            await self.app(scope, receive, sent)
        except ClientDisconnect:  # a stream's client left (ASGI 2.4 servers): nothing to answer
            return
        except Exception as e:  # noqa: BLE001 - every failure answers with OpenAI's error object
            self.count(scope, "failed")
            error = ApiError(f"internal error: {type(e).__name__}", status=500, code="internal_error")
            print(f"qwen3vl serve: {scope['method']} {scope['path']}: {type(e).__name__}: {e}"[:400],
                  file=sys.stderr, flush=True)
            await sent.fail(error)

    def refusal(self, scope) -> ApiError | None:
        """Why the request is refused before the app sees it (None: it is not)."""
        headers = dict(scope["headers"])
        host = headers.get(b"host", b"").decode("latin-1").lower()
        if self.hosts is not None and host not in self.hosts:
            return ApiError(f"Host header {shown(host)}: this server answers only {', '.join(sorted(self.hosts))} "
                            "(--allowed-host adds a name)", status=421, code="misdirected_request")
        if self.api_key and (scope["path"].startswith("/v1/") or scope["path"] in KEYED):
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, f"Bearer {self.api_key}".encode()):
                return ApiError("missing or wrong API key: expected the header 'Authorization: Bearer <key>' with "
                                "the server's --api-key", status=401, code="invalid_api_key",
                                headers={"WWW-Authenticate": "Bearer"})
        if scope["method"] == "POST":
            kind = headers.get(b"content-type", b"").decode("latin-1").split(";")[0].strip().lower()
            if kind != "application/json":
                return ApiError(f"Content-Type {kind or 'missing'!r}: expected 'application/json'", status=415,
                                code="unsupported_media_type")
        return None

    def count(self, scope, outcome: str) -> None:
        if self.metrics is not None and scope["path"] == CHAT_PATH:
            self.metrics.requests.labels(outcome).inc()


class Sent:
    """`send`, remembering how far the response got (to fail it the right way)."""

    def __init__(self, send):
        self.send, self.started, self.finished, self.events = send, False, False, False

    async def __call__(self, message):
        if message["type"] == "http.response.start":
            self.started = True
            self.events = dict(message.get("headers", [])).get(b"content-type", b"").startswith(b"text/event-stream")
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.finished = True
        await self.send(message)

    async def fail(self, error: ApiError) -> None:
        if not self.started:
            await send_error(self.send, error)
        elif self.events and not self.finished:
            body = b"data: " + error.json() + b"\n\ndata: [DONE]\n\n"
            await self.send({"type": "http.response.body", "body": body, "more_body": False})


async def send_error(send, error: ApiError) -> None:
    """`error` as the whole response: OpenAI's error object, JSON."""
    body = error.json()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
