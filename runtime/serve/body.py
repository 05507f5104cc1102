"""A request's body read as JSON, within bounds: its size (413 past `--max-body-mb`, from
Content-Length before reading, or as soon as more arrives), its nesting (400 past
MAX_DEPTH levels) and its strings (400 for a lone surrogate, which no text can hold)."""

from __future__ import annotations

import asyncio
import json

from runtime.serve.errors import ApiError

MAX_DEPTH = 64  # objects and arrays nested in one another; OpenAI's bodies need under 10


async def read_json(request, limit: int):
    """The body as checked JSON (ApiError 413 or 400 saying why not)."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise ApiError(f"request body of {declared} bytes: more than the {limit} this server accepts "
                       "(--max-body-mb)", status=413, code="body_too_large")
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > limit:
            raise ApiError(f"request body: more than the {limit} bytes this server accepts (--max-body-mb)",
                           status=413, code="body_too_large")
    return await asyncio.to_thread(parse, bytes(data))  # 32 MB of JSON is seconds: not on the event loop


def parse(data: bytes):
    try:
        value = json.loads(data)
    except RecursionError:
        raise too_deep() from None
    except ValueError as e:
        raise ApiError(f"request body: not valid JSON ({e})", code="invalid_json") from None
    check_json(value)
    return value


def too_deep() -> ApiError:
    return ApiError(f"request body: JSON nested more than {MAX_DEPTH} levels deep (this server's limit)",
                    code="invalid_json")


def check_json(value) -> None:
    """ApiError if `value` nests past MAX_DEPTH or holds a string that is not valid Unicode
    (named by its place: `messages[0].content`). A quick pass first; the places are only
    worked out for a body found wrong."""
    if not fine(value):
        find_fault(value, 1, ())


def fine(value) -> bool:
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if type(node) is str:
            if not (node.isascii() or valid_text(node)):
                return False
            continue
        if type(node) not in (dict, list):
            continue
        if depth > MAX_DEPTH:
            return False
        if type(node) is dict:
            if not all(key.isascii() or valid_text(key) for key in node):
                return False
            node = node.values()
        stack.extend((item, depth + 1) for item in node if type(item) in (str, dict, list))
    return True


def find_fault(node, depth: int, where: tuple) -> None:
    """Raise the ApiError for the first fault under `node` (it has one)."""
    if isinstance(node, str):
        if not valid_text(node):
            name = place(where)
            bad = next(c for c in node if 0xD800 <= ord(c) <= 0xDFFF)
            raise ApiError(f"{name or 'request body'}: holds a lone surrogate (U+{ord(bad):04X}): expected "
                           "valid Unicode text", name or None, code="invalid_json")
        return
    if not isinstance(node, (dict, list)):
        return
    if depth > MAX_DEPTH:
        raise too_deep()
    for key, item in node.items() if isinstance(node, dict) else enumerate(node):
        if isinstance(key, str):
            find_fault(key, depth, where)
        find_fault(item, depth + 1, (*where, key))


def valid_text(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def place(where: tuple) -> str:
    """A JSON path as OpenAI's `param` writes it: messages[0].content[1].image_url.url."""
    return "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in where).lstrip(".")
