"""`qwen3vl serve`'s refusals and its shutdown, end to end on the real server process (as
tests/test_serve.py): every refusal OpenAI's error object naming its input (bad bodies,
bad media, Host, API key, Content-Type), counted in /metrics; a crash answered with the
error object too; an empty key refused at startup; SIGTERM past --grace answering every
request. See docs/serve.md, "Limits and security defaults"."""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import struct
import subprocess
import threading
import zlib

import pytest

pytest.importorskip("openai")
pytest.importorskip("httpx2")

from serve_helpers import (KEY, QWEN3VL, Server, chat, corrupt_png, httpx, long_stream,  # noqa: E402
                           module_server, user, wait_for)


@pytest.fixture(scope="module")
def server(tmp_path_factory, serve_cache):
    yield from module_server(tmp_path_factory.mktemp("serve"), serve_cache)


def png_header(width: int, height: int) -> bytes:
    """A PNG that declares its size and holds no pixels."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)) + \
        chunk(b"IEND", b"")


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def bad_cases(server):
    outside = server.root / "outside.png"
    outside.write_bytes(server.images[0].read_bytes())
    link = server.allowed / "link.png"
    if not link.exists():
        link.symlink_to(outside)
    image_part = lambda url: {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},  # noqa
                                                          {"type": "text", "text": "x"}]}
    ok = [user("Hi")]
    return {  # name: (body, status, param, message pattern)
        "malformed JSON": (b"{not json", 400, None, "not valid JSON"),
        "not an object": ([1, 2], 400, None, "must be a JSON object"),
        "empty messages": ({"messages": []}, 400, "messages", "non-empty list"),
        "unknown role": ({"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role", "expected one of"),
        "content type": ({"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", "string or"),
        "part type": ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, 400,
                      "messages[0].content[0].type", "'audio'"),
        "temperature type": ({"messages": ok, "temperature": "hot"}, 400, "temperature", "expected a number"),
        "n > 1": ({"messages": ok, "n": 2}, 400, "n", "one choice"),
        "tools": ({"messages": ok, "tools": [{"type": "function", "function": {"name": "f", "parameters": 5}}]}, 400,
                  "tools[0].function.parameters", "not a JSON schema"),
        "unknown field": ({"messages": ok, "best_of": 2}, 400, "best_of", "not supported"),
        "stop type": ({"messages": ok, "stop": 3}, 400, "stop", "string or a list"),
        "top_logprobs alone": ({"messages": ok, "top_logprobs": 2}, 400, "top_logprobs", "only with logprobs"),
        "wrong model": ({"messages": ok, "model": "gpt-4"}, 404, "model", "serves 'model'"),
        "http URL": ({"messages": [image_part("https://example.com/a.png")]}, 400,
                     "messages[0].content[0].image_url.url", "not fetched.*data:image"),
        "not an image": ({"messages": [image_part("data:image/png;base64," + base64.b64encode(b"hello").decode())]},
                         400, "messages[0].content[0].image_url.url", "not an image"),
        "bad base64": ({"messages": [image_part("data:image/png;base64,@@@")]}, 400,
                       "messages[0].content[0].image_url.url", "base64"),
        "file outside via ..": ({"messages": [image_part(f"file://{server.allowed}/../outside.png")]}, 400,
                                "messages[0].content[0].image_url.url", "outside the allowed folder"),
        "file via symlink out": ({"messages": [image_part(link.as_uri())]}, 400,
                                 "messages[0].content[0].image_url.url", "outside the allowed folder"),
        "too many images": ({"messages": [user("x", [server.images[0]] * 4)]}, 400, "messages", "more than the 3"),
        "body too large": ({"messages": [user("x" * (1 << 20))]}, 413, None, "more than the 1048576"),
        "prompt over the context": ({"messages": [user("a b " * 3000)]}, 400, "messages", "prompt of \\d+ tokens"),
        "prompt over the context, image undecodable": (  # refused from the header: decoding would fail
            {"messages": [image_part(corrupt_png(server.images[0])), user("a b " * 3000)]}, 400, "messages",
            "prompt of \\d+ tokens: longer than the context of 4096"),
        "nested 1000 deep": (b"[" * 1000 + b"]" * 1000, 400, None, "nested more than 64 levels deep"),
        "nested 65 deep": (b"[" * 65 + b"]" * 65, 400, None, "nested more than 64 levels deep"),
        "nested 64 deep": (b"[" * 64 + b"]" * 64, 400, None, "must be a JSON object"),  # the limit itself passes
        "file URL with %00": ({"messages": [image_part(f"file://{server.allowed}/a%00b.png")]}, 400,
                              "messages[0].content[0].image_url.url", "path is not a file name: .*NUL byte"),
        "file URL, bad escapes": ({"messages": [image_part(f"file://{server.allowed}/%ED%A0%80.png")]}, 400,
                                  "messages[0].content[0].image_url.url", "%-escapes are not UTF-8"),
        "lone surrogate in a path": ({"messages": [image_part(f"file://{server.allowed}/\ud800.png")]}, 400,
                                     "messages[0].content[0].image_url.url", "lone surrogate \\(U\\+D800\\)"),
        "image of 50000x50000": ({"messages": [image_part("data:image/png;base64," + b64(png_header(50000, 50000)))]},
                                 400, "messages[0].content[0].image_url.url",
                                 "image of 2500000000 pixels: more than the 67108864 pixels"),
        "undecodable video": ({"messages": [{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + b64(b"not a video")}},
            {"type": "text", "text": "x"}]}]}, 400, "messages[0].content[0].video_url.url", "not a video container"),
        "stream_options without stream": ({"messages": ok, "stream_options": {"include_usage": True}}, 400,
                                          "stream_options", "only with stream: true"),
        "include_usage not a boolean": ({"messages": ok, "stream": True, "stream_options": {"include_usage": "no"}},
                                        400, "stream_options.include_usage", "'no': expected true or false"),
        "a 500 kB model name": ({"messages": ok, "model": "m" * 500_000}, 404, "model",
                                "^model: 'm{64}'\\.\\.\\.: this server serves 'model'$"),
        "max_tokens -1": ({"messages": ok, "max_tokens": -1}, 400, "max_tokens", "expected an integer >= 1"),
    }


# The code of some cases (OpenAI's or vLLM's where they have one); every other case's is
# "invalid_value" when it names a field, "invalid_request" when it names none.
CODES = {"malformed JSON": "invalid_json", "unknown field": "unsupported_field", "wrong model": "model_not_found",
         "a 500 kB model name": "model_not_found", "http URL": "url_not_allowed", "not an image": "invalid_image",
         "file outside via ..": "url_not_allowed", "file via symlink out": "url_not_allowed",
         "too many images": "too_many_media", "body too large": "body_too_large",
         "prompt over the context": "context_length_exceeded",
         "prompt over the context, image undecodable": "context_length_exceeded",
         "nested 1000 deep": "invalid_json", "nested 65 deep": "invalid_json",
         "image of 50000x50000": "image_too_large", "lone surrogate in a path": "invalid_json"}


def test_bad_inputs_are_openai_errors_and_the_server_keeps_serving(server):
    refused = server.metric("qwen3vl_requests_total", '{outcome="refused"}')
    cases = bad_cases(server)
    for name, (body, status, param, pattern) in cases.items():
        r = server.post(body)
        assert r.status_code == status, (name, r.text)
        assert r.headers["content-type"] == "application/json", name
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, name
        assert error["code"] == CODES.get(name, "invalid_value" if param else "invalid_request"), (name, error)
        assert error["param"] == param and re.search(pattern, error["message"]), (name, error)
        assert "\n" not in error["message"] and len(error["message"]) < 400, name
        assert "qwen3vl-serve-" not in error["message"], (name, error)  # no server temp path
    assert server.metric("qwen3vl_requests_total", '{outcome="refused"}') == refused + len(cases)
    missing = httpx.get(server.url + "/v1/nope", headers={"Authorization": f"Bearer {KEY}"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found", missing.text
    assert chat(server, [user("Hi")], max_tokens=2)[2]["completion_tokens"] >= 1


def test_api_key_required(server):
    refused = server.metric("qwen3vl_requests_total", '{outcome="refused"}')
    for headers in ({"Authorization": ""}, {"Authorization": "Bearer wrong"}):
        r = server.post({"messages": [user("Hi")]}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.get(server.url + "/health").status_code == 200
    assert server.metric("qwen3vl_requests_total", '{outcome="refused"}') == refused + 2


@pytest.mark.parametrize("how", ["--api-key ''", "QWEN3VL_API_KEY=''"])
def test_an_empty_api_key_is_refused_at_startup(tmp_path, how):
    """An empty key would turn authentication off unseen: one error line, before anything
    else (the model folder is not even looked at)."""
    env = {k: v for k, v in os.environ.items() if k != "QWEN3VL_API_KEY"}
    args = [QWEN3VL, "serve", "--model", tmp_path / "absent"]
    if how.startswith("--"):
        args += ["--api-key", ""]
    else:
        env["QWEN3VL_API_KEY"] = ""
    run = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 2 and run.stderr.strip().splitlines() == [
        "error: --api-key (or $QWEN3VL_API_KEY): empty; give a key, or leave both unset to serve without one"]


def test_a_reachable_server_without_a_key_is_warned_about(tmp_path):
    run = subprocess.run([QWEN3VL, "serve", "--model", tmp_path / "absent", "--host", "0.0.0.0"],
                         capture_output=True, text=True, env={k: v for k, v in os.environ.items()
                                                              if k != "QWEN3VL_API_KEY"}, timeout=120)
    lines = run.stderr.strip().splitlines()
    assert run.returncode != 0 and lines[0] == ("warning: --host 0.0.0.0 without --api-key: anyone who can reach "
                                                "this address may use the server"), run.stderr


def test_the_host_header_must_name_the_server(server):
    """DNS rebinding: a page whose name resolves to 127.0.0.1 makes the browser send its own
    name as Host; only the bound address and the loopback names are answered."""
    for host in (f"127.0.0.1:{server.port}", "LOCALHOST", f"localhost:{server.port}", f"[::1]:{server.port}"):
        assert httpx.get(server.url + "/health", headers={"Host": host}).status_code == 200, host
    refused = server.metric("qwen3vl_requests_total", '{outcome="refused"}')
    for host in ("evil.example", f"evil.example:{server.port}", "127.0.0.1.evil.example", f"127.0.0.1:{server.port}1"):
        r = server.post({"messages": [user("Hi")]}, headers={"Host": host})
        assert r.status_code == 421 and r.json()["error"]["code"] == "misdirected_request", (host, r.text)
        assert repr(host.lower()) in r.json()["error"]["message"]
    assert httpx.get(server.url + "/metrics", headers={"Host": "evil.example"}).status_code == 421
    assert server.metric("qwen3vl_requests_total", '{outcome="refused"}') == refused + 4


def test_a_post_that_is_not_json_is_415(server):
    """A browser sends a cross-site form or text/plain POST without asking: never parsed."""
    body = json.dumps({"messages": [user("Hi")], "max_tokens": 1})
    refused = server.metric("qwen3vl_requests_total", '{outcome="refused"}')
    kinds = ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None]
    for kind in kinds:
        headers = {"Authorization": f"Bearer {KEY}", **({"Content-Type": kind} if kind else {})}
        r = httpx.post(server.url + "/v1/chat/completions", content=body, headers=headers)
        assert r.status_code == 415 and r.headers["content-type"] == "application/json", (kind, r.text)
        assert r.json()["error"]["code"] == "unsupported_media_type"
        assert "expected 'application/json'" in r.json()["error"]["message"]
    assert server.metric("qwen3vl_requests_total", '{outcome="refused"}') == refused + len(kinds)
    ok = server.post(body, headers={"Content-Type": "application/json; charset=utf-8"})
    assert ok.status_code == 200, ok.text


def test_no_cors(server):
    """No CORS headers: a browser's preflight for a cross-site JSON POST is refused (401
    without the key a preflight never carries, 405 with it; the error object), so a page
    elsewhere can neither send one nor read an answer."""
    preflight = {"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}
    for headers, status in ((preflight, 401), (dict(preflight, Authorization=f"Bearer {KEY}"), 405)):
        r = httpx.request("OPTIONS", server.url + "/v1/chat/completions", headers=headers)
        assert r.status_code == status and set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
        assert r.json()["error"]["code"] == ("invalid_api_key" if status == 401 else "method_not_allowed"), r.text
        assert not any(k.lower().startswith("access-control-") for k in r.headers)


def test_the_guard_answers_a_crash_with_an_error_object():
    """Whatever a handler raises is OpenAI's error object (500, JSON), never text/plain;
    inside a stream, an error event then [DONE]. (The real routes have no crash left to
    show it: a bare Starlette app behind the same guard, on a real uvicorn.)"""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    from runtime.serve.guard import Guard, allowed_hosts
    from serve_helpers import free_port

    async def crash(request):
        raise RecursionError("deep")

    async def crash_mid_stream(request):
        async def events():
            yield "data: {}\n\n"
            raise KeyError("gone")
        return StreamingResponse(events(), media_type="text/event-stream")

    port = free_port()
    app = Starlette(routes=[Route("/crash", crash), Route("/stream", crash_mid_stream)],
                    middleware=[Middleware(Guard, api_key=None, hosts=allowed_hosts("127.0.0.1", port))])
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        assert wait_for(lambda: server.started, 30)
        r = httpx.get(f"http://127.0.0.1:{port}/crash")
        assert r.status_code == 500 and r.headers["content-type"] == "application/json", r.text
        assert r.json()["error"] == {"message": "internal error: RecursionError", "type": "server_error",
                                     "param": None, "code": "internal_error"}
        lines = [line for line in httpx.get(f"http://127.0.0.1:{port}/stream").text.split("\n") if line]
        assert lines[0] == "data: {}" and lines[-1] == "data: [DONE]", lines
        assert json.loads(lines[-2][6:])["error"]["code"] == "internal_error"
    finally:
        server.should_exit = True
        thread.join(30)


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def test_a_huge_message_is_refused_from_its_length_while_a_stream_runs(server, tmp_path):
    """A 16 MiB message (under a 40 MB body limit) is refused (400, context_length_exceeded)
    from its length, before anything renders or tokenizes it; a stream beside it keeps
    flowing (no gap of 0.5 s), and the server's memory comes back within 100 MB. (It used
    to be tokenized first, holding the GIL: 60 s, 4.4 GB.)"""
    import time

    big = Server(tmp_path, model=server.model, cache=server.cache, extra=("--max-body-mb", "40"))
    try:
        response, client = long_stream(big)
        arrivals, done = [], threading.Event()

        def read():
            for _ in response.iter_lines():
                arrivals.append(time.monotonic())
                if done.is_set():
                    break

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        assert wait_for(lambda: len(arrivals) > 8, 60)
        before = rss_mb(big.process.pid)
        start = time.monotonic()
        r = big.post({"messages": [user("a" * (16 << 20))], "max_tokens": 8})
        end = time.monotonic()
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        assert "longer than the context" in r.json()["error"]["message"]
        assert wait_for(lambda: arrivals[-1] > end + 0.5, 30)
        during = [t for t in arrivals if start - 0.5 <= t <= end + 0.5]
        gap = max(b - a for a, b in zip(during, during[1:]))
        assert gap < 0.5, f"the stream stalled {gap:.2f} s while the message was refused"
        assert wait_for(lambda: rss_mb(big.process.pid) < before + 100, 30), (before, rss_mb(big.process.pid))
        done.set()
        reader.join()  # it leaves at the stream's next line
        response.close()
        client.close()
    finally:
        big.process.kill()
        big.process.wait()


def test_sigterm_past_the_grace_answers_every_request(server, tmp_path):
    """SIGTERM with --grace 1, four lanes busy with answers that would run for seconds more
    and a fifth request queued: each stream gets an error event then [DONE], each plain
    request (running or queued) a 503 error object; the process exits 0. (This server also
    answers --allowed-host's name, and only it besides its own.)"""
    other = Server(tmp_path, server.model, server.cache, ["--grace", "1", "--allowed-host", "Example.test"])
    try:
        assert httpx.get(other.url + "/health", headers={"Host": "example.test"}).status_code == 200
        assert httpx.get(other.url + "/health", headers={"Host": f"example.test:{other.port}"}).status_code == 200
        assert httpx.get(other.url + "/health", headers={"Host": "other.test"}).status_code == 421
        streams = [long_stream(other) for _ in range(3)]
        plain = []
        long = {"messages": [user("Go on.")], "max_tokens": 100000, "ignore_eos": True}
        threads = [threading.Thread(target=lambda: plain.append(other.post(long))) for _ in range(2)]
        events = []
        try:
            lines = [response.iter_lines() for response, _ in streams]
            assert all(next(each).startswith("data: ") for each in lines)
            threads[0].start()
            assert wait_for(lambda: other.metric("qwen3vl_requests_running") == 4)  # --max-batch 4
            threads[1].start()
            assert wait_for(lambda: other.metric("qwen3vl_requests_waiting") == 1)
            other.process.send_signal(signal.SIGTERM)
            events = [[line for line in each if line] for each in lines]
        finally:
            for response, client in streams:
                response.close()
                client.close()
        for thread in threads:
            thread.join(60)
        for each in events:
            assert each[-1] == "data: [DONE]"
            assert json.loads(each[-2][6:])["error"]["code"] == "shutting_down", each[-2]
        assert len(plain) == 2
        for r in plain:
            assert r.status_code == 503 and r.headers["content-type"] == "application/json", r.text
            assert r.json()["error"]["code"] == "shutting_down"
        assert other.process.wait(60) == 0, other.output()
        assert "Traceback" not in other.output()
    finally:
        other.process.kill()
