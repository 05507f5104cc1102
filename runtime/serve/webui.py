"""The chat page at `qwen3vl serve`'s root (docs/serve.md, "The chat page").

`GET /` answers runtime/serve/web/index.html and `GET /web/<name>` the page's other files,
all shipped in the package (no build step, nothing fetched from elsewhere). The files are
read once, when the app is made; only the names in the folder are answered. The page talks
to the server's own `/v1/chat/completions`; the guard (runtime/serve/guard.py) checks the
Host header of every request as for the API, and the API key on `/v1/*` only, so the page's
own files are public while every API call needs the key. Every answer here carries a
Content-Security-Policy that allows scripts, styles and connections from this origin only
(no inline script, no third-party origin) and images and videos from `data:` and `blob:`
URLs too (the user's attachments).
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import Response
from starlette.exceptions import HTTPException

WEB = Path(__file__).with_name("web")
TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
         ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
       "img-src 'self' data: blob:; media-src 'self' data: blob:; base-uri 'none'; form-action 'none'; "
       "frame-ancestors 'none'")
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
           "X-Frame-Options": "DENY", "Cache-Control": "no-cache"}


def page_files(folder: Path = WEB) -> dict[str, tuple[bytes, str]]:
    """{name: (bytes, media type)} of the page's files (index.html among them)."""
    files = {p.name: (p.read_bytes(), TYPES[p.suffix]) for p in sorted(folder.iterdir()) if p.suffix in TYPES}
    if "index.html" not in files:
        raise FileNotFoundError(f"{folder}/index.html: the chat page is missing from the package "
                                "(or serve with --no-web-ui)")
    return files


def add_web_ui(app: FastAPI, folder: Path = WEB) -> None:
    """Mount `GET /` and `GET /web/<name>` on `app`; any other name under /web/ is a 404."""
    files = page_files(folder)

    def answer(name: str) -> Response:
        body, kind = files[name]
        return Response(body, media_type=kind, headers=HEADERS)

    @app.get("/", include_in_schema=False)
    async def index():
        return answer("index.html")

    @app.get("/web/{name}", include_in_schema=False)
    async def web_file(name: str):
        if name not in files:
            raise HTTPException(404, "Not Found")
        return answer(name)
