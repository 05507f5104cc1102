"""`/v1/embeddings` of a real `qwen3vl serve` process over a tiny embedding checkpoint (found one
by its sentence-transformers files), through the official openai client and raw HTTP: the
vectors against transformers' Qwen3VLModel (tests/test_embeddings.py's reference; relL2 1e-5)
for strings (one long enough to be prefilled in chunks), and vLLM's `messages` form with an
image and a video; dimensions, base64, usage, token-id input, concurrent requests; the bad
input refused with an error object naming the field; a generative checkpoint refused, then
served as an embedding model with --pooling last --no-normalize."""

from __future__ import annotations

import base64
import os
import shutil
import time

import numpy as np
import pytest

from conftest import rel_l2
from helpers import gradient_frames, write_video
from serve_helpers import KEY, Server, concurrently, data_url, httpx, long_stream
from runtime.embedding import item_messages
from test_embeddings import TOL, embedding_checkpoint, long_text, reference_embedding, reference_item

pytestmark = pytest.mark.parity
TEXTS = ["A cat on a red house.", "Two birds in the sky over a river."]
LEAN = ["--max-batch", "2"]  # two decode entries and pool_64x2 to compile


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_embed")
    s = Server(root, model=embedding_checkpoint(root), extra=LEAN + ["--max-waiting", "16"])  # 8 requests' 2 items
    s.video = write_video(s.allowed / "clip.mp4", gradient_frames(8, 256, 256, seed=9), rate=4)
    yield s
    s.process.kill()
    s.process.wait()


def post(server, body, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.url + "/v1/embeddings", json=body, headers=headers, timeout=120)


def test_client_matches_transformers(server):
    """The openai client (base64 on the wire, its default) on a list of strings, one of them
    prefilled in chunks of 256: each vector the reference's, usage the prompts' tokens."""
    texts = [*TEXTS, long_text(400, 2)]
    r = server.client.embeddings.create(model="model", input=texts)
    expected = [reference_item(server.model, text=t) for t in texts]
    assert [d.index for d in r.data] == [0, 1, 2] and r.model == "model" and r.object == "list"
    assert expected[2][0].size > 256  # chunked
    for got, (_, vector) in zip(r.data, expected):
        assert rel_l2(got.embedding, vector) <= TOL, rel_l2(got.embedding, vector)
    tokens = sum(ids.size for ids, _ in expected)
    assert r.usage.prompt_tokens == r.usage.total_tokens == tokens


def test_messages_with_image_and_video(server):
    """vLLM's chat form: an image item and a video item, the instruction added as the system
    message; against the reference of the same chat."""
    image = {"type": "image_url", "image_url": {"url": data_url(server.images[0])}}
    video = {"type": "video_url", "video_url": {"url": f"file://{server.video}"}}
    for part, ref in ((image, {"type": "image", "image": str(server.images[0])}),
                      (video, {"type": "video", "video": str(server.video)})):
        body = {"messages": [{"role": "user", "content": [part, {"type": "text", "text": "What is it?"}]}],
                "encoding_format": "float"}
        r = post(server, body)
        assert r.status_code == 200, r.text
        ids, expected = reference_embedding(server.model, item_messages([ref, {"type": "text", "text": "What is it?"}]))
        got = r.json()["data"][0]["embedding"]
        assert rel_l2(got, expected) <= TOL and r.json()["usage"]["prompt_tokens"] == ids.size


def test_dimensions_encoding_and_token_ids(server):
    full = np.array(post(server, {"input": TEXTS[0]}).json()["data"][0]["embedding"], np.float32)
    short = post(server, {"input": TEXTS[0], "dimensions": 16}).json()["data"][0]["embedding"]
    assert np.allclose(short, full[:16] / np.linalg.norm(full[:16]), rtol=1e-6, atol=1e-7)
    raw = post(server, {"input": TEXTS[0], "encoding_format": "base64"}).json()["data"][0]["embedding"]
    assert np.array_equal(np.frombuffer(base64.b64decode(raw), "<f4"), full)
    ids = httpx.post(server.url + "/tokenize", json={"messages": item_messages([{"type": "text", "text": TEXTS[0]}])},
                     headers={"Authorization": f"Bearer {KEY}"}).json()["tokens"]
    r = post(server, {"input": [ids, ids[:-3]]}).json()
    assert np.array_equal(r["data"][0]["embedding"], full) and r["usage"]["prompt_tokens"] == 2 * len(ids) - 3
    assert not np.array_equal(r["data"][1]["embedding"], full)


def test_concurrent_requests(server):
    """Eight requests at once answer what each gives alone; /health answers meanwhile."""
    solo = [post(server, {"input": t}).json()["data"][0]["embedding"] for t in TEXTS]
    started = time.monotonic()
    health = []

    def probe():
        while time.monotonic() - started < 1.5:
            t = time.monotonic()
            assert httpx.get(server.url + "/health", timeout=10).status_code == 200
            health.append(time.monotonic() - t)

    results = concurrently(probe, *[lambda i=i: post(server, {"input": [TEXTS[i % 2]] * 3}) for i in range(8)])
    for i, r in enumerate(results[1:]):
        assert r.status_code == 200 and all(d["embedding"] == solo[i % 2] for d in r.json()["data"])
    assert health and max(health) < 1.0, health


def test_embedding_beside_streams_holding_every_lane(server):
    """Both lanes of the server decode long streams: an embedding request still answers while
    they run (it holds no lane); a lane frees only when a stream ends, so an answer after an
    end would mean it waited."""
    import threading

    expected = post(server, {"input": TEXTS[0]}).json()["data"][0]["embedding"]
    streams = [long_stream(server) for _ in range(2)]
    running, ended = [threading.Event() for _ in streams], threading.Event()

    def read(response, started):
        try:
            for line in response.iter_lines():
                started.set()
                if line == "data: [DONE]" or ('"finish_reason": ' in line and '"finish_reason": null' not in line):
                    ended.set()
        except httpx.HTTPError:
            pass  # closed by the test

    readers = [threading.Thread(target=read, args=(response, started))
               for (response, _), started in zip(streams, running)]
    for reader in readers:
        reader.start()
    try:
        assert all(started.wait(60) for started in running)
        r = post(server, {"input": TEXTS[0]})
        assert not ended.is_set(), "the embedding waited for a stream's lane"
        assert r.status_code == 200 and r.json()["data"][0]["embedding"] == expected
    finally:
        for response, client in streams:
            response.close()
            client.close()
        for reader in readers:
            reader.join(10)


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "dimensions": 49}, "dimensions"), ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": ""}, "input"), ({"input": []}, "input"), ({"input": ["a", ""]}, "input[1]"),
    ({"input": [1, 10 ** 6]}, "input"), ({"input": "x", "encoding_format": "hex"}, "encoding_format"),
    ({"input": "x", "messages": []}, "input"), ({}, "input"), ({"input": "x", "user_id": 3}, "user_id"),
    ({"input": "x", "model": "other"}, "model"), ({"input": "x", "instruction": 3}, "instruction"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}]},
     "messages[0].content[0].image_url.url"),
    ({"input": long_text(5000, 3)}, "input"),
])
def test_bad_input(server, body, param):
    r = post(server, body)
    error = r.json()["error"]
    assert r.status_code in (400, 404) and error["param"] == param and error["code"], r.text


def test_generative_checkpoint(server, tmp_path):
    """The same weights without modules.json: a generative model, /v1/embeddings refused naming
    `model`; with --pooling last --no-normalize, the same vectors before their normalization."""
    plain = tmp_path / "plain"
    plain.mkdir()
    for f in server.model.iterdir():
        if f.name not in ("modules.json", "1_Pooling"):
            os.symlink(f, plain / f.name)
    chat = Server(tmp_path, model=plain, cache=server.cache, extra=LEAN)
    try:
        r = post(chat, {"input": "x"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
        assert r.json()["error"]["code"] == "model_not_embedding"
    finally:
        chat.process.kill()
        chat.process.wait()
    shutil.rmtree(tmp_path / "allowed")
    flagged = Server(tmp_path, model=plain, cache=server.cache, extra=LEAN + ["--pooling", "last", "--no-normalize"])
    try:
        got = np.array(post(flagged, {"input": TEXTS[0]}).json()["data"][0]["embedding"])
        normalized = np.array(post(server, {"input": TEXTS[0]}).json()["data"][0]["embedding"])
        assert abs(np.linalg.norm(got) - 1) > 1e-3
        assert rel_l2(got / np.linalg.norm(got), normalized) <= 1e-6
    finally:
        flagged.process.kill()
        flagged.process.wait()


def test_lane_groups_have_no_spare_lane():
    """Items batched in calls of exactly an entry's lane count, the largest first; one left over
    goes alone (three items: 2 + 1, never a call of 4 with a lane repeated)."""
    from runtime.embedding import lane_groups

    sizes = {n: [len(g) for g in lane_groups(list(range(n)), [2, 4])] for n in range(1, 8)}
    assert sizes == {1: [], 2: [2], 3: [2], 4: [4], 5: [4], 6: [4, 2], 7: [4, 2]}
    assert lane_groups(list(range(5)), []) == [] and lane_groups(list(range(3)), [2])[0] == [0, 1]
