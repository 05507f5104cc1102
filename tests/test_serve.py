"""`qwen3vl serve` end to end: the real server process on a free localhost port, over a
tiny random checkpoint, driven by the official `openai` client and by raw HTTP. One
server for the module (started once, stopped with SIGTERM by the last test)."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time

import numpy as np
import pytest

pytest.importorskip("openai")
pytest.importorskip("httpx2")

from serve_helpers import (KEY, QWEN3VL, Server, chat, concurrently, corrupt_png, generate, httpx,  # noqa: E402
                           long_stream, module_server, raw_request, resident_bytes, user, wait_for)


@pytest.fixture(scope="module")
def server(tmp_path_factory, serve_cache):
    yield from module_server(tmp_path_factory.mktemp("serve"), serve_cache)


SHAPES = {"text": ("Say something.", 0), "one image": ("Describe the image.", 1), "two images": ("Compare them.", 2)}


@pytest.fixture(scope="module")
def solo(server):
    """generate's greedy answer for each shape, 8 new tokens."""
    return {name: generate(server, prompt, server.images[:n]) for name, (prompt, n) in SHAPES.items()}


def same_as_generate(result, expected) -> None:
    text, finish, usage = result
    assert text == expected["text"]
    assert usage["prompt_tokens"] == expected["prompt_tokens"]
    assert usage["completion_tokens"] == len(expected["tokens"])
    assert finish == ("length" if len(expected["tokens"]) == 8 else "stop")


def test_health_models_and_metrics(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    models = server.client.models.list()
    assert [m.id for m in models.data] == ["model"]
    assert "qwen3vl_time_to_first_token_seconds" in httpx.get(server.url + "/metrics").text
    assert server.metric("qwen3vl_kv_cache_usage_perc") == 0.0  # nothing running
    assert "warning" not in server.output()  # a loopback server with a key


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_greedy_equals_generate(server, solo, shape, stream):
    prompt, n = SHAPES[shape]
    same_as_generate(chat(server, [user(prompt, server.images[:n])], stream, max_tokens=8, temperature=0), solo[shape])


def test_four_concurrent_requests_each_equal_their_solo_run(server, solo):
    jobs = [("text", True), ("one image", False), ("two images", True), ("one image", True)]

    def request(shape, stream):
        prompt, n = SHAPES[shape]
        return lambda: chat(server, [user(prompt, server.images[:n])], stream, max_tokens=8)

    results = concurrently(*(request(*job) for job in jobs))
    for (shape, _), result in zip(jobs, results):
        same_as_generate(result, solo[shape])


def test_long_prompt_runs_in_chunks_as_generate(server):
    """A prompt of several prefill chunks (buckets 64, 256) with an image: the server's
    answer, streamed, and a second request of the same prompt (the prompt cache) equal
    generate's."""
    prompt = "Read this and say what the picture shows. " + " ".join(f"line {i}: nothing new." for i in range(150))
    expected = generate(server, prompt, server.images[:1])
    assert expected["prompt_tokens"] > 3 * 256
    messages = [user(prompt, server.images[:1])]
    same_as_generate(chat(server, messages, True, max_tokens=8, temperature=0), expected)
    same_as_generate(chat(server, messages, False, max_tokens=8, temperature=0), expected)


def test_same_seed_same_tokens_and_as_generate(server):
    kw = dict(max_tokens=12, temperature=0.9, top_p=0.95, seed=11, extra_body={"top_k": 40})
    messages = [user("Tell a story.")]
    first, again = chat(server, messages, **kw), chat(server, messages, stream=True, **kw)
    assert first[0] == again[0]
    assert chat(server, messages, **dict(kw, seed=12))[0] != first[0]
    ours = generate(server, "Tell a story.", (), 12, "--temperature", "0.9", "--top-p", "0.95", "--top-k", "40",
                    "--seed", "11")
    assert ours["text"] == first[0] and len(ours["tokens"]) == first[2]["completion_tokens"]
    greedy = generate(server, "Tell a story.", (), 12)
    assert greedy["tokens"] != ours["tokens"]


def test_stop_string_cut_and_not_returned(server, solo):
    text = solo["text"]["text"]
    stop = text[3:5]
    got, finish, _ = chat(server, [user(SHAPES["text"][0])], max_tokens=8, stop=[stop, "\x00never"])
    assert got == text[:text.find(stop)] and finish == "stop"
    streamed, finish, _ = chat(server, [user(SHAPES["text"][0])], stream=True, max_tokens=8, stop=stop)
    assert streamed == got and finish == "stop"


def test_logprobs(server):
    r = server.client.chat.completions.create(model="model", messages=[user("Hi")], max_tokens=5, logprobs=True,
                                              top_logprobs=3, temperature=0)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 5
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)  # greedy: the likeliest
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob


def valid_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_logprobs_bytes_are_the_tokens_bytes(server):
    """A token holding part of a character reads U+FFFD as text, but its `bytes` are its own:
    the answer's bytes are the tokens' bytes joined (OpenAI's contract for `bytes`)."""
    r = server.client.chat.completions.create(model="model", messages=[user("Hi")], max_tokens=40, logprobs=True,
                                              temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    partial = [bytes(entry.bytes) for entry in content if entry.token == "\ufffd"]
    assert partial and all(not valid_utf8(b) for b in partial)  # part of a character, not U+FFFD's bytes
    joined = b"".join(bytes(entry.bytes) for entry in content)
    assert joined.decode("utf-8", errors="replace") == r.choices[0].message.content


def test_logprobs_list_the_tokens_of_the_text(server):
    """A special token the answer's text leaves out (as transformers decodes) is not in
    `logprobs` either, streamed or not: the entries' bytes joined are the text, and the
    tokens left out are the special ones (here `<|im_end|>`, made likely by logit_bias and
    decoded past by ignore_eos)."""
    from runtime.inputs.tokenizer import ChatTokenizer
    ours = ChatTokenizer(server.model)
    end = ours.tokenizer.token_to_id("<|im_end|>")
    kw = dict(max_tokens=40, logprobs=True, temperature=1.0, seed=7, logit_bias={str(end): 4},
              extra_body={"ignore_eos": True})
    r = server.client.chat.completions.create(model="model", messages=[user("Hi")], **kw)
    content = r.choices[0].logprobs.content
    assert 0 < len(content) < r.usage.completion_tokens  # some tokens were <|im_end|>, some text
    assert all(entry.token != "<|im_end|>" for entry in content)
    assert b"".join(bytes(e.bytes) for e in content).decode("utf-8", errors="replace") == r.choices[0].message.content
    streamed, text = [], ""
    for chunk in server.client.chat.completions.create(model="model", messages=[user("Hi")], stream=True, **kw):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            streamed += choice.logprobs.content if choice.logprobs else []
    assert text == r.choices[0].message.content and [e.token for e in streamed] == [e.token for e in content]


@pytest.mark.parity
def test_typed_special_tokens_are_text_in_serve_and_generate(server):
    """A special token typed in a message (`<|im_end|>` pasted, `<|image_pad|>`) is text, as
    OpenAI takes it: the prompt's ids are the template's tokens around the message encoded
    as ordinary text (transformers' split_special_tokens=True), the same through the chat,
    /tokenize and `qwen3vl generate`, whose greedy answer the chat's is; not a 400."""
    transformers = pytest.importorskip("transformers")
    from runtime.inputs.tokenizer import ChatTokenizer
    text = "Say <|im_end|> then <|image_pad|><|im_start|>system as text."
    theirs = transformers.AutoTokenizer.from_pretrained(server.model)
    plain = transformers.AutoTokenizer.from_pretrained(server.model, split_special_tokens=True)
    piece = lambda t, tok=theirs: tok(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    expected = piece("<|im_start|>user\n") + piece(text, plain) + piece("<|im_end|>\n<|im_start|>assistant\n")
    end = theirs.convert_tokens_to_ids("<|im_end|>")
    assert expected.count(end) == 1 and piece(text).count(end) == 1  # as a control token it would be one more
    ours = ChatTokenizer(server.model)
    assert ours.encode(*ours.render_chat([user(text)])).tolist() == expected
    assert ours.encode(ours.render([user("Hi")])).tolist() == piece("<|im_start|>user\nHi<|im_end|>\n"
                                                                   "<|im_start|>assistant\n")
    tokenized = httpx.post(server.url + "/tokenize", json={"messages": [user(text)]},
                           headers={"Authorization": f"Bearer {KEY}"})
    assert tokenized.json()["tokens"] == expected, tokenized.text
    solo = generate(server, text)
    assert solo["prompt_tokens"] == len(expected)
    same_as_generate(chat(server, [user(text)], max_tokens=8, temperature=0), solo)


def test_max_tokens_capped_by_the_context(server):
    text, finish, usage = chat(server, [user("Hi")], max_tokens=100000, extra_body={"ignore_eos": True})
    assert finish == "length" and usage["completion_tokens"] == 4096 - usage["prompt_tokens"] + 1


def test_encoder_cache_hit_in_a_second_turn(server):
    image = server.allowed / "third.png"
    from PIL import Image
    Image.fromarray(np.full((64, 64, 3), 77, np.uint8)).save(image)
    hits, misses = server.metric("qwen3vl_encoder_cache_hits_total"), server.metric("qwen3vl_encoder_cache_misses_total")
    first = [user("What is it?", [image])]
    answer = chat(server, first, max_tokens=4)[0]
    assert server.metric("qwen3vl_encoder_cache_misses_total") == misses + 1
    second = first + [{"role": "assistant", "content": answer}, user("And now?")]
    file_url = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image.as_uri()}},
                                            {"type": "text", "text": "Same?"}]}
    chat(server, second, max_tokens=4)
    chat(server, second + [{"role": "assistant", "content": "x"}, file_url], max_tokens=4)
    assert server.metric("qwen3vl_encoder_cache_hits_total") == hits + 3
    assert server.metric("qwen3vl_encoder_cache_misses_total") == misses + 1


def test_prefix_cache_is_exact(server, solo, tmp_path):
    """A prompt whose blocks the KV cache holds shares them and prefills only the rest, alone
    or beside a running copy of itself, and the answers stay generate's; an image of the same
    size with other pixels shares none of the blocks that hold it."""
    prompt, n = SHAPES["one image"]
    hits = lambda: server.metric("qwen3vl_prefix_cache_hit_tokens_total")  # noqa: E731
    same_as_generate(chat(server, [user(prompt, server.images[:n])], max_tokens=8, temperature=0), solo["one image"])
    before = hits()
    same_as_generate(chat(server, [user(prompt, server.images[:n])], max_tokens=8, temperature=0), solo["one image"])
    hit = hits() - before
    assert hit >= (solo["one image"]["prompt_tokens"] - 1) // 16 * 16 > 0
    before = hits()
    results = concurrently(*(lambda stream=stream: chat(server, [user(prompt, server.images[:n])], stream,
                                                        max_tokens=8, temperature=0) for stream in (False, True)))
    for result in results:
        same_as_generate(result, solo["one image"])
    assert hits() == before + 2 * hit
    from PIL import Image
    other = tmp_path / "other.png"
    pixels = np.asarray(Image.open(server.images[0]))
    Image.fromarray(255 - pixels).save(other)
    before = hits()
    same_as_generate(chat(server, [user(prompt, [other])], max_tokens=8, temperature=0),
                     generate(server, prompt, [other]))
    assert hits() - before < hit


def test_disconnect_cancels_and_frees_the_engine(server):
    cancelled = server.metric("qwen3vl_requests_total", '{outcome="cancelled"}')
    response, client = long_stream(server)
    lines = response.iter_lines()
    assert next(lines).startswith("data: ")
    assert wait_for(lambda: server.metric("qwen3vl_requests_running") == 1)
    assert wait_for(lambda: 0 < server.metric("qwen3vl_kv_cache_usage_perc") <= 1 / 4)  # a quarter of the pool at most
    response.close()
    client.close()
    assert wait_for(lambda: server.metric("qwen3vl_requests_running") == 0, 5)
    assert server.metric("qwen3vl_kv_cache_usage_perc") == 0.0  # its blocks given back with it
    assert server.metric("qwen3vl_requests_total", '{outcome="cancelled"}') == cancelled + 1
    start = time.monotonic()
    chat(server, [user("Hi")], max_tokens=2)
    assert time.monotonic() - start < 10


def test_a_non_streaming_client_leaving_is_cancelled(server):
    """A plain (non-streaming) request whose client closes its socket mid-answer, and one
    whose client leaves while it waits in the queue, are cancelled: neither runs on to
    max_tokens, and the lane is free again."""
    cancelled = lambda: server.metric("qwen3vl_requests_total", '{outcome="cancelled"}')  # noqa: E731
    before = cancelled()
    long = {"messages": [user("Go on.")], "max_tokens": 100000, "ignore_eos": True}
    sock = raw_request(server, long)
    assert wait_for(lambda: server.metric("qwen3vl_requests_running") == 1)
    sock.close()
    assert wait_for(lambda: server.metric("qwen3vl_requests_running") == 0, 5)
    assert cancelled() == before + 1  # not "finished": it did not run to the context's end
    running = [long_stream(server) for _ in range(4)]  # --max-batch 4: every lane busy
    assert wait_for(lambda: server.metric("qwen3vl_requests_running") == 4)
    queued = raw_request(server, long)
    assert wait_for(lambda: server.metric("qwen3vl_requests_waiting") == 1)
    queued.close()
    for response, client in running:
        response.close()
        client.close()
    assert wait_for(lambda: cancelled() == before + 6, 10)  # the four streams and the queued one
    assert wait_for(lambda: server.metric("qwen3vl_requests_running") == 0, 5)


def test_queue_full_is_429_with_retry_after(server):
    running = [long_stream(server) for _ in range(4)]  # --max-batch 4: every row busy
    assert wait_for(lambda: server.metric("qwen3vl_requests_running") == 4)
    waiting = []
    for _ in range(3):  # --max-waiting 3
        threading.Thread(target=lambda: waiting.append(long_stream(server)), daemon=True).start()
    assert wait_for(lambda: server.metric("qwen3vl_requests_waiting") == 3)
    r = server.post({"messages": [user("Hi")], "max_tokens": 2})
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "queue_full"
    for response, client in running:
        response.close()
        client.close()
    closed = 0
    while closed < 3:  # each admitted in turn, closed once it streams
        assert wait_for(lambda: len(waiting) > closed, 10)
        response, client = waiting[closed]
        response.close()
        client.close()
        closed += 1
    assert wait_for(lambda: server.metric("qwen3vl_requests_running") == 0 and
                    server.metric("qwen3vl_requests_waiting") == 0, 10)


def test_batched_sequences_equal_their_solo_runs_and_a_failure_disturbs_none(server):
    long = dict(max_tokens=300, temperature=0, extra_body={"ignore_eos": True})
    sampled = dict(max_tokens=40, temperature=1.0, seed=5, extra_body={"ignore_eos": True})
    alone_long = chat(server, [user("Go on.")], **long)
    alone_sampled = chat(server, [user("Tell a story.", server.images[:1])], **sampled)
    steps = server.metric("qwen3vl_decode_batch_size_count")
    single = server.metric("qwen3vl_decode_batch_size_bucket", '{le="1.0"}')
    results = {}

    def run(name, *args, **kw):
        results[name] = chat(server, *args, **kw)

    threads = [threading.Thread(target=run, args=("long", [user("Go on.")], True), kwargs=long),
               threading.Thread(target=run, args=("sampled", [user("Tell a story.", server.images[:1])]),
                                kwargs=sampled)]
    for t in threads:
        t.start()
    bad = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": corrupt_png(server.images[1])}}, {"type": "text", "text": "x"}]}]}
    r = server.post(bad)
    for t in threads:
        t.join()  # each request bounded by its client's own timeout
    assert r.status_code == 400 and "cannot decode image" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "messages[0].content[0].image_url.url"  # the URL's own
    assert results["long"] == alone_long and results["sampled"] == alone_sampled
    together = (server.metric("qwen3vl_decode_batch_size_count") - steps) - \
        (server.metric("qwen3vl_decode_batch_size_bucket", '{le="1.0"}') - single)
    assert together > 0  # some decode steps ran more than one sequence


def test_a_sequence_overflowing_mid_decode_fails_alone(server, tmp_path):
    """A lane whose logits turn NaN in a batched decode step ends with OpenAI's error object
    (500, model_overflow); the sequence decoding beside it goes on, equal to its run alone.
    (This server also runs with --no-prompt-cache.)"""
    import shutil
    from types import SimpleNamespace

    from safetensors.numpy import load_file, save_file

    model = tmp_path / "model"
    shutil.copytree(server.model, model)
    weights = model / "model.safetensors"
    tensors = load_file(weights)  # finite weights that overflow on one token only
    embed = next(k for k in tensors if k.endswith("embed_tokens.weight"))
    norm = next(k for k in tensors if k.endswith("layers.0.input_layernorm.weight"))
    tensors[embed][:, 0] = 0.0  # channel 0 zero in every token's embedding,
    save_file(tensors, weights)
    solo = SimpleNamespace(model=model, root=tmp_path, cache=server.cache)
    first = generate(solo, "Say something.", steps=3)["tokens"]
    tensors[embed][first[2]] = np.eye(1, tensors[embed].shape[1])  # but the 3rd answer token's, which
    tensors[norm][0] = 3e38  # the first norm scales past f32 (text prompts only: image rows would too)
    save_file(tensors, weights)
    poisoned = Server(tmp_path, model, server.cache, ["--no-prompt-cache"])
    try:
        # Long enough to be running when the failing one starts (a tiny decode step is ~1 ms),
        # and never choosing the poisoned token.
        other = dict(max_tokens=3000, temperature=0, extra_body={"ignore_eos": True},
                     logit_bias={str(first[2]): -100})
        alone = chat(poisoned, [user("Go on.")], **other)
        results = {}
        beside = threading.Thread(target=lambda: results.update(b=chat(poisoned, [user("Go on.")], **other)))
        beside.start()
        assert wait_for(lambda: poisoned.metric("qwen3vl_requests_running") == 1, 30)
        response, client = long_stream(poisoned, [user("Say something.")], max_tokens=8)
        try:
            events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
        finally:
            response.close(), client.close()
        beside.join()
        pieces = [e["choices"][0]["delta"].get("content") for e in events if e.get("choices")]
        error = events[-1]["error"]
        assert len([p for p in pieces if p]) >= 2, events  # it decoded, then failed
        assert error["code"] == "model_overflow" and "NaN or inf" in error["message"], error
        assert results["b"] == alone
        assert poisoned.metric("qwen3vl_prefix_cache_hit_tokens_total") == 0  # --no-prompt-cache: prefilled twice
        assert wait_for(lambda: poisoned.metric("qwen3vl_requests_running") == 0, 10)
        assert poisoned.metric("qwen3vl_requests_total", '{outcome="failed"}') == 1
    finally:
        poisoned.process.kill()


def test_a_full_pool_makes_requests_wait_and_preempts(server, tmp_path):
    """A KV pool of 40 blocks (one 512-token context and a few more): two answers of 400
    tokens cannot both hold their blocks, so the later one is preempted, then resumed by
    prefilling its prompt and its tokens; both answers equal their runs alone, a third
    request waits for blocks instead of failing, and every block comes back."""
    small = Server(tmp_path, server.model, server.cache, ["--context", "512", "--prompt-bucket", "64",
                                                          "--kv-cache-memory", "0.0005"])
    try:
        assert "KV cache: 40 blocks of 16 tokens" in small.output()
        kw = dict(max_tokens=400, temperature=0, extra_body={"ignore_eos": True})
        prompts = [[user("Go on.")], [user("Tell a story.")], [user("Say something.")]]
        alone = [chat(small, p, **kw) for p in prompts]
        assert small.metric("qwen3vl_preemptions_total") == 0
        results = concurrently(*(lambda i=i: chat(small, prompts[i], i == 1, **kw) for i in range(3)))
        assert small.metric("qwen3vl_preemptions_total") >= 1
        assert [r[0] for r in results] == [r[0] for r in alone]
        assert all(r[2]["completion_tokens"] == 400 for r in results)
        assert wait_for(lambda: small.metric("qwen3vl_kv_cache_blocks_used") == 0, 10)
    finally:
        small.process.kill()


def test_soak_60_requests_from_8_clients(server, solo):
    """Every answer right, every row free after, resident memory back near its warm level."""
    client = server.client.with_options(max_retries=20)  # 429s past --max-waiting are retried

    def one(i):
        shape = ["text", "one image", "two images"][i % 3]
        prompt, n = SHAPES[shape]
        r = client.chat.completions.create(model="model", messages=[user(prompt, server.images[:n])], max_tokens=8,
                                           temperature=0)
        return r.choices[0].message.content == solo[shape]["text"]

    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(one, range(16)))  # warm-up
        warm = resident_bytes(server.process.pid)
        assert all(pool.map(one, range(60)))
    assert wait_for(lambda: server.metric("qwen3vl_requests_running") == 0 and
                    server.metric("qwen3vl_requests_waiting") == 0, 10)
    after = resident_bytes(server.process.pid)
    assert after < warm * 1.05 + (16 << 20), (warm, after)


def test_generate_refuses_sampling_options_while_greedy(server):
    run = subprocess.run([QWEN3VL, "generate", "--model", server.model, "--prompt", "x", "--top-k", "5"],
                         capture_output=True, text=True)
    assert run.returncode == 2 and run.stderr.strip() == (
        "error: --top-k: only applies when sampling; give --temperature above 0 (decoding is greedy: "
        "generation_config.json does not set do_sample true)")


def test_sigterm_finishes_in_flight_and_exits_0(server):
    """Last: a streamed request in flight when SIGTERM arrives still completes; exit 0."""
    response, client = long_stream(server, [user("Bye.")], max_tokens=300)
    try:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        server.process.send_signal(signal.SIGTERM)
        rest = list(lines)
    finally:
        response.close()
        client.close()
    events = [line for line in rest if line]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"  # ran to its end
    assert server.process.wait(60) == 0, server.output()
