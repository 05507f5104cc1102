"""The routing key of a request for cache-affine routing over replicas (Ray Serve's
router in runtime/serve/ray_router.py): a hash of the start of its prompt, about one
KV-cache block of it, in which each image or video stands as the hash of its URL.

Two requests with the same key share their first block (the same system prompt or the
same first user text, the same first image), so the replica that ran one holds the other's
leading prefix-cache blocks and, for an image there, its encoder-cache rows. The key reads
no further than the first turn (the system messages and the first other message), which a
chat's later turns repeat, so they keep its key. No tokenizer is needed: the key
is taken from the request's JSON, before any replica sees it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from emitter.kv_pages import BLOCK

PREFIX_CHARS = 4 * BLOCK  # about one block of tokens, at about 4 characters a token
MEDIA_PARTS = ("image_url", "video_url")
SYSTEM_ROLES = ("system", "developer")


@dataclass(frozen=True)
class Route:
    """What the router reads of a request: its key (None: any replica, the least loaded),
    or the replica asked for by name (`X-Qwen3VL-Replica`), which wins while it lives."""
    key: str | None = None
    replica: str | None = None


def routing_key(path: str, body: bytes) -> str | None:
    """The key of a POST body to `path` (None when it has no prompt to key on: not JSON,
    another endpoint, an empty prompt)."""
    if path not in ("/v1/chat/completions", "/v1/completions", "/v1/responses"):
        return None
    try:
        request = json.loads(body)
    except ValueError:
        return None
    if not isinstance(request, dict):
        return None
    if path == "/v1/responses":  # keyed as the chat body it becomes, so its turns share a chat's replica
        from runtime.serve.errors import ApiError
        from runtime.serve.responses import to_chat
        try:
            request = to_chat(request, [])
        except ApiError:
            return None
    start = prompt_start(request)[:PREFIX_CHARS]
    return hashlib.sha256(start.encode()).hexdigest()[:32] if start else None


def prompt_start(request: dict) -> str:
    """The prompt as the template lays it out, roughly, up to the end of its first turn: the
    tools, the system messages, the first other message (roles and contents in order, media
    as `<image_url:HASH>`); a legacy completion's prompt as is. (The first turn only, so
    that a chat's later turns keep its key however short its first message.)"""
    prompt = request.get("prompt")
    if prompt is not None:
        return prompt if isinstance(prompt, str) else json.dumps(prompt)
    pieces = [f"<tools:{digest(json.dumps(request['tools'], sort_keys=True))}>"] if request.get("tools") else []
    messages = request.get("messages")
    for message in messages if isinstance(messages, list) else ():
        if not isinstance(message, dict):
            continue
        pieces.append(f"<{message.get('role')}>")
        pieces.extend(content_pieces(message.get("content")))
        if message.get("role") not in SYSTEM_ROLES or sum(map(len, pieces)) >= PREFIX_CHARS:
            break
    return "".join(pieces)


def content_pieces(content) -> list[str]:
    if isinstance(content, str):
        return [content]
    pieces = []
    for part in content if isinstance(content, list) else ():
        if not isinstance(part, dict):
            continue
        kind = part.get("type")
        if kind == "text" and isinstance(part.get("text"), str):
            pieces.append(part["text"])
        elif kind in MEDIA_PARTS and isinstance(part.get(kind), dict):
            pieces.append(f"<{kind}:{digest(str(part[kind].get('url')))}>")
    return pieces


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]
