"""The real `qwen3vl serve` process for tests/test_serve.py, and the calls the tests make
to it (the official `openai` client, raw HTTP through httpx2, `qwen3vl generate` for the
solo answers)."""

from __future__ import annotations

import base64
import json
import re
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from emitter.config import PRESETS
from emitter.text_config import TEXT_PRESETS
from runtime.checkpoints.synthetic import DEFAULT_PROCESSOR
from runtime.checkpoints.synthetic_text import write_generation_checkpoint

import httpx2 as httpx  # the HTTP client the openai package uses
import openai

QWEN3VL = str(Path(sys.executable).parent / "qwen3vl")
SMALL_POLICY = dict(DEFAULT_PROCESSOR, size={"shortest_edge": 4096, "longest_edge": 32768})
KEY = "test-key"
SHAPE = ["--context", "4096", "--prompt-bucket", "64", "--prompt-bucket", "256"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, root: Path, model: Path | None = None, cache: Path | None = None, extra=()):
        """A server over the tiny checkpoint (written under `root`), or over `model`; `extra`
        options appended."""
        self.root, self.model, self.cache = root, model or root / "model", cache or root / "cache"
        if model is None:
            write_generation_checkpoint(self.model, PRESETS["tiny"], TEXT_PRESETS["tiny"], seed=3,
                                        processor_policy_dict=SMALL_POLICY)
        self.allowed = root / "allowed"
        self.allowed.mkdir()
        from PIL import Image
        rng = np.random.default_rng(5)
        self.images = []
        for i, (h, w) in enumerate([(64, 96), (96, 64)]):
            path = self.allowed / f"img{i}.png"
            Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path)
            self.images.append(path)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(root / "server.log", "w+")
        self.process = subprocess.Popen(
            [QWEN3VL, "serve", "--model", self.model, "--port", str(self.port), "--cache-dir", self.cache, *SHAPE,
             "--api-key", KEY, "--allowed-local-media-path", self.allowed, "--max-batch", "4", "--max-waiting", "3", "--max-media", "3",
             "--max-body-mb", "1", "--threads", "2", *extra], stdout=self.log, stderr=subprocess.STDOUT)
        self.wait_ready()
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0)

    def wait_ready(self, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.output()
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.5)
        raise AssertionError("server not ready: " + self.output())

    def output(self) -> str:
        """The log so far, read through a file of its own (a seek on `self.log` would move
        the server's own write offset, which it shares)."""
        return Path(self.log.name).read_text()

    def post(self, body, headers=None, **kw):
        data = body if isinstance(body, (bytes, str)) else json.dumps(body)
        return httpx.post(self.url + "/v1/chat/completions", content=data, timeout=60,
                          headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json",
                                   **(headers or {})}, **kw)

    def metric(self, name: str, labels: str = "") -> float:
        text = httpx.get(self.url + "/metrics").text
        match = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
        return float(match.group(1)) if match else 0.0


def module_server(root: Path, cache: Path | None = None, extra=()):
    """A test module's server (its `server` fixture yields from this): killed after its tests."""
    s = Server(root, cache=cache, extra=extra)
    yield s
    if s.process.poll() is None:
        s.process.kill()
        s.process.wait()


def data_url(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def user(text: str, images=()) -> dict:
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(p)}} for p in images] +
            [{"type": "text", "text": text}]}


def generate(server, prompt: str, images=(), steps: int = 8, *extra) -> dict:
    out = server.root / "gen.json"
    args = [QWEN3VL, "generate", "--model", server.model, "--prompt", prompt, "--max-new-tokens", str(steps),
            "--cache-dir", server.cache, "--json", out, *SHAPE, *extra]
    for image in images:
        args += ["--image", image]
    run = subprocess.run(args, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    return json.loads(out.read_text())


USAGE = ("prompt_tokens", "completion_tokens", "total_tokens")


def chat(server, messages, stream=False, **kw):
    """(text, finish_reason, usage) of one completion, streamed or not."""
    if not stream:
        r = server.client.chat.completions.create(model="model", messages=messages, **kw)
        usage = r.usage.model_dump()
        return r.choices[0].message.content, r.choices[0].finish_reason, {k: usage[k] for k in USAGE}
    pieces, finish, usage = [], None, None
    for chunk in server.client.chat.completions.create(model="model", messages=messages, stream=True,
                                                       stream_options={"include_usage": True}, **kw):
        if chunk.usage:
            usage = chunk.usage.model_dump()
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    return "".join(pieces), finish, {k: usage[k] for k in USAGE}


def long_stream(server, messages=None, max_tokens=100000):
    """A streaming request that runs until its client goes (or to the context's end, some
    seconds): (response, its open client)."""
    client = httpx.Client(timeout=60)
    body = {"messages": messages or [user("Go on.")], "max_tokens": max_tokens, "stream": True, "temperature": 0,
            "ignore_eos": True}
    request = client.build_request("POST", server.url + "/v1/chat/completions", json=body,
                                   headers={"Authorization": f"Bearer {KEY}"})
    return client.send(request, stream=True), client


def raw_request(server, body: dict) -> socket.socket:
    """A chat request sent on a raw socket, its answer not read (close the socket to leave)."""
    data = json.dumps(body).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nAuthorization: Bearer {KEY}"
            f"\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n")
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(head.encode() + data)
    return sock


def concurrently(*calls) -> list:
    """The results of `calls` (callables of no argument), run at once in threads of their own.
    Waits for every one (each request is bounded by its HTTP client's own timeout, not by a
    clock here) and re-raises the first failure."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(call) for call in calls]]


def wait_for(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def corrupt_png(path: Path) -> str:
    """A data URL of a PNG whose header reads but whose pixels do not decode."""
    data = path.read_bytes()
    return "data:image/png;base64," + base64.b64encode(data[:len(data) // 2]).decode()


def resident_bytes(pid: int) -> int:
    return next(int(line.split()[1]) for line in open(f"/proc/{pid}/status") if line.startswith("VmRSS:")) * 1024
