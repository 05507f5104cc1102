"""`qwen3vl serve --ray local`: two replicas of the tiny checkpoint, one thread each, on a
local Ray cluster the server starts, driven by the official `openai` client and raw HTTP:
the single server's answers, requests spread over the replicas, a chat's turns on one
replica and its caches, a replica killed mid-request."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import socket
import subprocess

import pytest

from runtime.serve.affinity import PREFIX_CHARS, routing_key
from runtime.serve.scaling import Scaling
from serve_helpers import KEY, QWEN3VL, Server, chat, free_port, long_stream, module_server, user, wait_for

import httpx2 as httpx

REPLICA = "x-qwen3vl-replica"
CHAT = "/v1/chat/completions"
READY = re.compile(r"Replica pid=(\d+)\)\S*\s+replica (\w+) ready")


class RayServer(Server):
    def replicas(self) -> dict[str, int]:
        """Every replica that said it was ready: its id -> its process id."""
        return {name: int(pid) for pid, name in READY.findall(self.output())}

    def get(self, path: str, replica: str | None = None):
        return httpx.get(self.url + path, headers={REPLICA: replica} if replica else {}, timeout=60)

    def replica_metric(self, replica: str, name: str) -> float:
        response = self.get("/metrics", replica)
        assert response.headers[REPLICA] == replica
        match = re.search(rf"^{re.escape(name)} (\S+)$", response.text, re.M)
        return float(match.group(1)) if match else 0.0

    def stop(self) -> None:
        """SIGTERM: the driver deletes the application and shuts its cluster down."""
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=120)
        except Exception:
            self.process.kill()
            self.process.wait()
            raise


@pytest.fixture(scope="module")
def single(tmp_path_factory, serve_cache):
    yield from module_server(tmp_path_factory.mktemp("single"), serve_cache)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, serve_cache, single):
    server = RayServer(tmp_path_factory.mktemp("ray"), model=single.model, cache=serve_cache,
                       extra=["--ray", "local", "--replicas", "2", "--threads", "1"])
    assert wait_for(lambda: len(server.replicas()) == 2, 60), server.output()  # their lines pass through Ray's logs
    yield server
    server.stop()
    assert server.process.returncode == 0, server.output()


def post(server, body: dict, replica: str | None = None):
    headers = {"Authorization": f"Bearer {KEY}", **({REPLICA: replica} if replica else {})}
    return httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers, timeout=120)


def test_the_replicas_open_what_was_built(cluster, single):
    """The single server built the artifacts into the shared cache: the driver found them
    (as a restarted driver does) and the replicas compiled nothing."""
    assert "compiling" not in cluster.output()


def test_answers_equal_the_single_server(cluster, single):
    for messages in ([user("Tell me a story.")], [user("What is here?", [single.images[0]])]):
        for stream in (False, True):
            assert chat(cluster, messages, stream, max_tokens=8) == chat(single, messages, stream, max_tokens=8)
    missing = cluster.post({"messages": []})
    assert missing.status_code == single.post({"messages": []}).status_code == 400
    assert missing.json() == single.post({"messages": []}).json()


def test_concurrent_requests_spread_over_both_replicas(cluster):
    bodies = [{"messages": [user(f"Request {i} wants its own words.")], "max_tokens": 24, "ignore_eos": True}
              for i in range(6)]
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        responses = list(pool.map(lambda body: post(cluster, body), bodies))
    assert [r.status_code for r in responses] == [200] * len(bodies), [r.text for r in responses]
    assert {r.headers[REPLICA] for r in responses} == set(cluster.replicas())


def test_a_chats_second_turn_runs_where_its_first_did_and_hits_its_caches(cluster):
    chats = [[user(f"Chat {i}: look at this picture and describe it.", [cluster.images[i % 2]])] for i in range(4)]
    homes = []
    for messages in chats:
        first = post(cluster, {"messages": messages, "max_tokens": 6, "temperature": 0})
        assert first.status_code == 200, first.text
        homes.append(first.headers[REPLICA])
        messages += [first.json()["choices"][0]["message"], user("And what else?")]
    for messages, home in zip(chats, homes):
        prefix = cluster.replica_metric(home, "qwen3vl_prefix_cache_hit_tokens_total")
        encoder = cluster.replica_metric(home, "qwen3vl_encoder_cache_hits_total")
        second = post(cluster, {"messages": messages, "max_tokens": 6, "temperature": 0})
        assert second.status_code == 200, second.text
        assert second.headers[REPLICA] == home
        assert cluster.replica_metric(home, "qwen3vl_prefix_cache_hit_tokens_total") >= prefix + 16
        assert cluster.replica_metric(home, "qwen3vl_encoder_cache_hits_total") == encoder + 1


def pinned_stream(server, replica: str):
    """A streaming request held on `replica` until closed: (response, its client)."""
    client = httpx.Client(timeout=60)
    body = {"messages": [user("Go on.")], "max_tokens": 100000, "stream": True, "ignore_eos": True}
    request = client.build_request("POST", server.url + CHAT, json=body,
                                   headers={"Authorization": f"Bearer {KEY}", REPLICA: replica})
    return client.send(request, stream=True), client


def test_a_busy_home_spills_to_the_least_loaded_and_stays_the_home(cluster):
    messages = [user("A chat whose home will be busy for a while.")]
    first = post(cluster, {"messages": messages, "max_tokens": 4})
    home = first.headers[REPLICA]
    messages += [first.json()["choices"][0]["message"], user("Next?")]
    streams = [pinned_stream(cluster, home) for _ in range(4)]  # every decode lane of the home
    try:
        assert wait_for(lambda: running(cluster, home) == 4, 60)
        spilled = post(cluster, {"messages": messages, "max_tokens": 4})
        assert spilled.status_code == 200 and spilled.headers[REPLICA] != home
    finally:
        for response, client in streams:
            response.close()
            client.close()
    assert wait_for(lambda: running(cluster, home) == 0, 60)
    # once the router counts the home's lanes free again (the cancelled streams' ends reach
    # its queue lengths a little later), the chat is back home: the spill did not move it
    assert wait_for(lambda: post(cluster, {"messages": messages, "max_tokens": 4}).headers[REPLICA] == home, 60)


def test_each_replica_reports_its_load_under_the_metric_names(cluster):
    for replica in cluster.replicas():
        text = cluster.get("/metrics", replica).text
        for name in ("qwen3vl_requests_waiting", "qwen3vl_requests_running", "qwen3vl_kv_cache_usage_perc"):
            assert re.search(rf"^{name} \S+$", text, re.M), name


def running(cluster, replica: str) -> float:
    return cluster.replica_metric(replica, "qwen3vl_requests_running")


def test_a_client_that_leaves_cancels_its_request_on_the_replica(cluster):
    response, client = long_stream(cluster)
    replica = response.headers[REPLICA]
    assert next(response.iter_lines()).startswith("data: ")
    response.close()
    client.close()
    assert wait_for(lambda: running(cluster, replica) == 0, 60)
    data = json.dumps({"messages": [user("Go on.")], "max_tokens": 100000, "ignore_eos": True}).encode()
    sock = socket.create_connection(("127.0.0.1", cluster.port))
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{cluster.port}\r\nAuthorization: Bearer "
                 f"{KEY}\r\n{REPLICA}: {replica}\r\nContent-Type: application/json\r\nContent-Length: {len(data)}"
                 "\r\n\r\n".encode() + data)
    assert wait_for(lambda: running(cluster, replica) == 1, 60)
    sock.close()  # a plain request's client gone before its answer
    assert wait_for(lambda: running(cluster, replica) == 0, 60)


def test_a_killed_replica_ends_its_requests_cleanly_and_is_replaced(cluster):
    response, client = long_stream(cluster)
    victim = response.headers[REPLICA]
    lines = response.iter_lines()
    assert next(lines).startswith("data: ")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        plain = pool.submit(post, cluster, {"messages": [user("Go on.")], "max_tokens": 100000, "ignore_eos": True},
                            victim)
        assert wait_for(lambda: running(cluster, victim) == 2, 60)
        os.kill(cluster.replicas()[victim], signal.SIGKILL)
        events = [line[len("data: "):] for line in lines if line.startswith("data: ")]
        answer = plain.result()
    client.close()
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "replica_lost"
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "replica_lost"
    for i in range(3):  # the survivor takes new requests
        survivor = post(cluster, {"messages": [user(f"After {i}.")], "max_tokens": 4})
        assert survivor.status_code == 200, survivor.text
        assert survivor.headers[REPLICA] != victim
    assert wait_for(lambda: len(cluster.replicas()) == 3, 180), cluster.output()  # Ray starts a new one
    (new,) = set(cluster.replicas()) - {victim, survivor.headers[REPLICA]}
    assert wait_for(lambda: cluster.get("/health", new).headers[REPLICA] == new, 60)
    assert post(cluster, {"messages": [user("Hello again.")], "max_tokens": 4}, new).headers[REPLICA] == new


@pytest.mark.parametrize("options, message", [
    (["--replicas", "2"], "--replicas 2: replicas need --ray (local, or a cluster's HOST:PORT)"),
    (["--max-replicas", "3"], "--max-replicas 3: replicas need --ray (local, or a cluster's HOST:PORT)"),
    (["--ray", "local", "--replicas", "0"], "--replicas 0: expected 1 or more"),
    (["--ray", "local", "--min-replicas", "3", "--max-replicas", "2"], "--min-replicas 3 > --max-replicas 2"),
])
def test_bad_replica_options_are_one_line_before_anything_else(tmp_path, options, message):
    run = subprocess.run([QWEN3VL, "serve", "--model", tmp_path / "absent", *options], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2 and run.stderr.strip().splitlines() == [f"error: {message}"], run.stderr


def test_an_address_where_no_cluster_answers_is_one_line(tmp_path):
    port = free_port()
    run = subprocess.run([QWEN3VL, "serve", "--model", tmp_path / "absent", "--ray", f"127.0.0.1:{port}"],
                         capture_output=True, text=True, timeout=120)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1, run.stderr
    assert lines[0].startswith(f"error: --ray 127.0.0.1:{port}: no Ray cluster answers there")


def test_autoscaling_targets_the_decode_lanes():
    assert Scaling(2).deployment_options(4) == {"num_replicas": 2}
    assert Scaling(1, 1, 3).deployment_options(4) == {"num_replicas": "auto", "autoscaling_config": {
        "min_replicas": 1, "max_replicas": 3, "initial_replicas": 1, "target_ongoing_requests": 4}}
    assert Scaling(2, None, 4).peak == 4 and Scaling(2).peak == 2


def body(*messages, **fields) -> bytes:
    return json.dumps({"messages": list(messages), **fields}).encode()


def test_the_routing_key_follows_the_prompts_first_block_and_images(tmp_path):
    image = tmp_path / "a.png"
    image.write_bytes(b"\x89PNG one")
    other = tmp_path / "b.png"
    other.write_bytes(b"\x89PNG two")
    first = user("Describe the picture, please, in a few words.", [image])
    key = routing_key(CHAT, body(first))
    turn_two = body(first, {"role": "assistant", "content": "A cat."}, user("And the other one?", [other]))
    assert key is not None and routing_key(CHAT, turn_two) == key  # a later turn keeps its chat's key
    short = user("Hi")
    assert routing_key(CHAT, body(short, {"role": "assistant", "content": "Hello."}, user("Tell me more."))) == \
        routing_key(CHAT, body(short)) != routing_key(CHAT, body(user("Hi there")))
    system = {"role": "system", "content": "Be brief."}
    assert routing_key(CHAT, body(system, short)) not in (routing_key(CHAT, body(short)),
                                                          routing_key(CHAT, body(system, user("Ho"))))
    assert routing_key(CHAT, body(user("Describe the picture, please, in a few words.", [other]))) != key
    assert routing_key(CHAT, body(first, max_tokens=3)) == key  # sampling fields are not the prompt
    long = "x" * PREFIX_CHARS
    assert routing_key(CHAT, body(user(long + "one"))) == routing_key(CHAT, body(user(long + "two")))
    assert routing_key(CHAT, body(user("one" + long))) != routing_key(CHAT, body(user("two" + long)))
    assert routing_key("/v1/completions", b'{"prompt": "Once upon"}') != routing_key(
        "/v1/completions", b'{"prompt": "Twice upon"}')
    for path, data in ((CHAT, b"not json"), (CHAT, b"[1]"), (CHAT, b'{"messages": []}'), ("/tokenize", body(first))):
        assert routing_key(path, data) is None
