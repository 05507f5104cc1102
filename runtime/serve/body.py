"""A request's body read as JSON, within bounds: its size (413 past `--max-body-mb`, from
Content-Length before reading, or as soon as more arrives), its nesting (400 past
MAX_DEPTH levels) and its strings (400 for a lone surrogate, which no text can hold)."""

from __future__ import annotations

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
    try:
        value = json.loads(bytes(data))
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
    (named by its place: `messages[0].content`)."""
    if isinstance(value, str):
        check_text(value, ())
    stack = [(value, 1, ())] if isinstance(value, (dict, list)) else []
    while stack:
        node, depth, where = stack.pop()
        if depth > MAX_DEPTH:
            raise too_deep()
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, item in items:
            if isinstance(key, str):
                check_text(key, where)
            if isinstance(item, str):
                check_text(item, (*where, key))
            elif isinstance(item, (dict, list)):
                stack.append((item, depth + 1, (*where, key)))


def check_text(text: str, where: tuple) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        name = place(where)
        raise ApiError(f"{name or 'request body'}: holds a lone surrogate (U+{ord(text[e.start]):04X}): expected "
                       "valid Unicode text", name or None, code="invalid_json") from None


def place(where: tuple) -> str:
    """A JSON path as OpenAI's `param` writes it: messages[0].content[1].image_url.url."""
    return "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in where).lstrip(".")
