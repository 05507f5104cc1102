"""Reranker serving (runtime/serve/rerank.py) against a real `qwen3vl serve` process, over raw
HTTP: /v1/rerank and /score give the model card's yes/no score of transformers'
Qwen3VLForConditionalGeneration (f32) on a tiny random checkpoint whose vocabulary holds
"yes" and "no", for text documents and an image document; vLLM's shapes (sorted results,
top_n, index, document, usage; text_1/text_2 one to one and one to many); bad input as
OpenAI error objects naming the field; a chat model's server refuses both endpoints."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from emitter.config import PRESETS
from emitter.text_config import TEXT_PRESETS
from runtime.checkpoints.synthetic_text import write_generation_checkpoint
from runtime.serve.rerank import DEFAULT_INSTRUCTION, SYSTEM, classifier_tokens, reranker_checkpoint
from serve_helpers import KEY, SMALL_POLICY, Server, concurrently, data_url, httpx, user

TOL = 1e-5
QUERY = "what is shown in the picture?"
TEXTS = ["a red cat near the house.", "two small birds in the sky."]
README = "---\nlicense: apache-2.0\ntags:\n- transformers\n- multimodal rerank\n---\n# tiny reranker\n"


def write_reranker(folder: Path, readme: bool) -> None:
    """The tiny checkpoint, its two added non-special tokens renamed "yes" and "no" (a
    reranker's vocabulary holds both), with Qwen3-VL-Reranker's README front matter or none."""
    write_generation_checkpoint(folder, PRESETS["tiny"], TEXT_PRESETS["tiny"], seed=3, processor_policy_dict=SMALL_POLICY)
    path = folder / "tokenizer.json"
    tokenizer = json.loads(path.read_text())
    names = {"<tool_call>": "yes", "</tool_call>": "no"}
    for token in tokenizer["added_tokens"]:
        token["content"] = names.get(token["content"], token["content"])
    path.write_text(json.dumps(tokenizer))
    if readme:
        (folder / "README.md").write_text(README)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("rerank")
    write_reranker(root / "reranker", readme=True)  # found a reranker by its README, no flag
    s = Server(root, model=root / "reranker")
    yield s
    s.process.kill()
    s.process.wait()


def post(server, path: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.url + path, json=body, headers=headers, timeout=120)


def image_document(server) -> dict:
    return {"content": [{"type": "image_url", "image_url": {"url": data_url(server.images[0])}},
                        {"type": "text", "text": "a photo."}]}


def reference(model_dir: Path, pairs: list, instruction: str = DEFAULT_INSTRUCTION):
    """The model card's scoring (Qwen3VLReranker: format_mm_instruction, the processor's chat
    template, the language model's last hidden state times lm_head's yes row minus its no
    row) in transformers, f32, of `pairs` ((query images, query text), (document images,
    document text)): per pair (logit difference, prompt tokens)."""
    import torch
    from PIL import Image
    from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration, Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    processor = Qwen3VLProcessor(Qwen2VLImageProcessorPil(**SMALL_POLICY), tokenizer, Qwen3VLVideoProcessor(),
                                 chat_template=(model_dir / "chat_template.jinja").read_text())
    model = Qwen3VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32,
                                                            attn_implementation="eager").eval()
    vocab = tokenizer.get_vocab()
    with torch.inference_mode():
        row = model.lm_head.weight[vocab["yes"]] - model.lm_head.weight[vocab["no"]]

    def parts(prefix: str, images, text: str) -> list:  # format_mm_content: the prefix, images, then text
        return ([{"type": "text", "text": prefix}] + [{"type": "image", "image": str(p)} for p in images] +
                [{"type": "text", "text": text}])

    out = []
    for (q_images, q_text), (d_images, d_text) in pairs:
        content = ([{"type": "text", "text": "<Instruct>: " + instruction}] + parts("<Query>:", q_images, q_text) +
                   parts("\n<Document>:", d_images, d_text))
        messages = [{"role": "system", "content": [{"type": "text", "text": SYSTEM}]},
                    {"role": "user", "content": content}]
        prompt = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        images = [Image.open(p).convert("RGB") for p in [*q_images, *d_images]]
        inputs = processor(text=[prompt], images=images or None, return_tensors="pt")
        with torch.inference_mode():
            score = float(model.model(**inputs).last_hidden_state[0, -1] @ row)
        out.append((score, int(inputs["input_ids"].shape[1])))
    return out


def sigmoid(d: float) -> float:
    return float(1 / (1 + np.exp(-d)))


@pytest.mark.parity
def test_scores_match_transformers(server):
    pytest.importorskip("transformers")
    docs = [TEXTS[0], image_document(server), TEXTS[1]]
    query = ((), QUERY)
    expected = reference(server.model, [(query, ((), TEXTS[0])), (query, ((server.images[0],), "a photo.")),
                                        (query, ((), TEXTS[1]))])
    raw = post(server, "/score", {"text_1": QUERY, "text_2": docs, "use_activation": False})
    assert raw.status_code == 200, raw.text
    body = raw.json()
    assert [d["index"] for d in body["data"]] == [0, 1, 2] and body["object"] == "list"
    for got, (want, _) in zip(body["data"], expected):
        assert abs(got["score"] - want) <= TOL * abs(want), (got["score"], want)  # relative: 2.6e-7 seen
    assert body["usage"]["prompt_tokens"] == sum(n for _, n in expected) == body["usage"]["total_tokens"]
    assert len({round(d["score"], 6) for d in body["data"]}) == 3  # the documents score apart: the check can fail

    r = post(server, "/v1/rerank", {"query": QUERY, "documents": docs, "model": "reranker"})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    scores = [x["relevance_score"] for x in results]
    assert scores == sorted(scores, reverse=True) and sorted(x["index"] for x in results) == [0, 1, 2]
    for x in results:
        assert abs(x["relevance_score"] - sigmoid(expected[x["index"]][0])) <= TOL
        assert x["document"] == ({"text": docs[x["index"]]} if isinstance(docs[x["index"]], str)
                                 else {"multi_modal": docs[x["index"]]["content"]})
    assert r.json()["usage"] == {"prompt_tokens": body["usage"]["prompt_tokens"],
                                 "total_tokens": body["usage"]["prompt_tokens"]}


@pytest.mark.parity
def test_image_query_and_instruction_match_transformers(server):
    """A query of an image and text (search by picture; in a list: one {content} object alone is one item per
    part, as vLLM reads it), and an instruction of the request's own."""
    pytest.importorskip("transformers")
    query = {"content": [{"type": "image_url", "image_url": {"url": data_url(server.images[1])}},
                         {"type": "text", "text": QUERY}]}
    expected = reference(server.model, [(((server.images[1],), QUERY), ((), TEXTS[0])),
                                        (((), QUERY), ((), TEXTS[1]))], instruction="Find birds.")
    got = [post(server, "/score", {"text_1": [q], "text_2": TEXTS[i], "instruction": "Find birds.",
                                   "use_activation": False}).json()["data"][0]["score"]
           for i, q in enumerate([query, QUERY])]
    for g, (want, _) in zip(got, expected):
        assert abs(g - want) <= TOL * abs(want), (g, want)


def test_shapes(server):
    """top_n, return_documents, the aliases, one to one against one to many, an instruction."""
    base = post(server, "/rerank", {"query": QUERY, "documents": TEXTS + ["the sky."], "top_n": 2,
                                    "return_documents": False}).json()
    assert len(base["results"]) == 2 and all(set(x) == {"index", "relevance_score"} for x in base["results"])
    many = post(server, "/v1/score", {"text_1": [QUERY], "text_2": TEXTS + ["the sky."]}).json()["data"]
    top = sorted(many, key=lambda d: -d["score"])[:2]
    assert [(x["index"], x["relevance_score"]) for x in base["results"]] == [(d["index"], d["score"]) for d in top]
    pairs = post(server, "/score", {"text_1": [QUERY, "the sky."], "text_2": TEXTS}).json()["data"]
    assert pairs[0]["score"] == many[0]["score"] and pairs[1]["score"] != many[1]["score"]
    other = post(server, "/score", {"text_1": QUERY, "text_2": TEXTS[0], "instruction": "Find birds."}).json()
    assert other["data"][0]["score"] != many[0]["score"]


def test_beside_chat(server):
    """Six documents scored while a chat runs: both answered, the scores those of the pairs
    scored alone, the query's prefix found in the prefix cache by the later pairs."""
    docs = [f"{w} birds in the sky." for w in ("one", "two", "three", "four", "five", "six")]
    hits = server.metric("qwen3vl_prefix_cache_hit_tokens_total")
    ranked, chat = concurrently(
        lambda: post(server, "/v1/rerank", {"query": QUERY, "documents": docs}),
        lambda: server.client.chat.completions.create(model="reranker", messages=[user("Go on.")], max_tokens=8))
    assert ranked.status_code == 200 and len(ranked.json()["results"]) == 6, ranked.text
    assert chat.choices[0].finish_reason in ("stop", "length")
    assert server.metric("qwen3vl_prefix_cache_hit_tokens_total") >= hits + 5 * 16
    alone = [post(server, "/score", {"text_1": QUERY, "text_2": d}).json()["data"][0]["score"] for d in docs[:2]]
    scores = {x["index"]: x["relevance_score"] for x in ranked.json()["results"]}
    assert [scores[0], scores[1]] == alone


@pytest.mark.parametrize("path, body, param", [
    ("/v1/rerank", {"query": QUERY, "documents": [3]}, "documents[0]"),
    ("/v1/rerank", {"query": QUERY, "documents": [{"content": [{"type": "audio_url"}]}]}, "documents[0].content[0].type"),
    ("/v1/rerank", {"query": QUERY, "documents": [{"content": []}]}, "documents[0].content"),
    ("/v1/rerank", {"query": QUERY, "documents": []}, "documents"),
    ("/v1/rerank", {"query": QUERY}, "documents"),
    ("/v1/rerank", {"query": [QUERY], "documents": TEXTS}, "query"),
    ("/v1/rerank", {"query": QUERY, "documents": TEXTS, "top_n": -1}, "top_n"),
    ("/v1/rerank", {"query": QUERY, "documents": TEXTS, "return_documents": "yes"}, "return_documents"),
    ("/v1/rerank", {"query": QUERY, "documents": [{"content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]},
     "documents[0].content[0].image_url.url"),
    ("/v1/rerank", {"query": QUERY, "documents": TEXTS, "truncate_prompt_tokens": 5}, "truncate_prompt_tokens"),
    ("/score", {"text_1": [QUERY, QUERY], "text_2": TEXTS + ["x"]}, "text_1"),
    ("/score", {"text_1": QUERY, "text_2": TEXTS, "use_activation": 1}, "use_activation"),
    ("/score", {"text_1": QUERY, "text_2": ["word " * 5000]}, "text_2[0]"),
])
def test_bad_input(server, path, body, param):
    r = post(server, path, body)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param and error["code"], r.text
    assert "\n" not in error["message"]


def test_key_required(server):
    for path in ("/rerank", "/score", "/v1/rerank", "/v1/score"):
        r = post(server, path, {"query": QUERY, "documents": TEXTS}, key=None)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_not_a_reranker(server, tmp_path):
    """The same weights without the README and the flag: a chat model, both endpoints refused;
    with vLLM's --hf-overrides it is a reranker again, scoring as the detected one does."""
    plain = tmp_path / "plain"
    plain.mkdir()
    for f in server.model.iterdir():
        if f.name != "README.md":
            os.symlink(f, plain / f.name)
    chat = Server(tmp_path, model=plain, cache=server.cache)
    try:
        for path in ("/v1/rerank", "/score"):
            r = post(chat, path, {"query": QUERY, "documents": TEXTS, "text_1": QUERY, "text_2": TEXTS})
            assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
            assert r.json()["error"]["code"] == "model_not_reranker"
    finally:
        chat.process.kill()
        chat.process.wait()
    shutil.rmtree(tmp_path / "allowed")
    flagged = Server(tmp_path, model=plain, cache=server.cache, extra=[
        "--hf-overrides", '{"architectures": ["Qwen3VLForSequenceClassification"], '
        '"classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true}'])
    try:
        body = {"text_1": QUERY, "text_2": TEXTS}
        assert post(flagged, "/score", body).json()["data"] == post(server, "/score", body).json()["data"]
    finally:
        flagged.process.kill()
        flagged.process.wait()


def test_flags(tmp_path):
    assert classifier_tokens(None) is None
    assert classifier_tokens('{"classifier_from_token": ["no", "yes"]}') == ("no", "yes")
    for bad, named in (("{", "not JSON"), ('{"num_labels": 2}', "num_labels"),
                       ('{"classifier_from_token": ["yes"]}', "classifier_from_token"),
                       ('{"architectures": ["Qwen3VLForCausalLM"], "classifier_from_token": ["no", "yes"]}',
                        "architectures")):
        with pytest.raises(ValueError, match=named):
            classifier_tokens(bad)
    assert not reranker_checkpoint(tmp_path)
    (tmp_path / "README.md").write_text(README)
    assert reranker_checkpoint(tmp_path)
    (tmp_path / "README.md").write_text("---\ntags:\n- image-text-to-text\n---\nrerank me\n")
    assert not reranker_checkpoint(tmp_path)
