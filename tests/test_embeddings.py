"""Embedding models (runtime/embedding.py, the text module's `pool_<S>` entries): a tiny random
checkpoint with sentence-transformers' files (last-token pooling, Normalize) against
transformers' Qwen3VLModel (f32): the last token's final hidden state, normalized, within relL2
1e-5, for text only, an image, a video and a prompt long enough to be prefilled in chunks,
in the model card's format (the instruction as the system message); Matryoshka dimensions;
a generative module's MLIR unchanged by the pooling entries. `/v1/embeddings` through the
official openai client is in tests/test_serve_embeddings.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import rel_l2
from helpers import gradient_frames, write_images, write_video
from emitter.config import PRESETS
from emitter.text_module import emit_text_module
from emitter.text_config import TEXT_PRESETS
from emitter.text_shape import TextShape
from runtime.embedding import (DEFAULT_INSTRUCTION, Pooling, PoolingError, checkpoint_pooling, embed, finish,
                               item_messages, resolve_pooling)
from runtime.generator import Generator
from runtime.inputs.chat import Media
from runtime.checkpoints.synthetic_text import write_generation_checkpoint

pytestmark = pytest.mark.parity
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_text_parity import SMALL_POLICY, TOL, reference_model  # noqa: E402

WORDS = "the a picture of red green blue cat dog house tree sky river road car window light".split()


def write_sentence_transformers(model_dir: Path, normalize: bool = True) -> None:
    """modules.json and 1_Pooling/config.json as Qwen3-VL-Embedding's repository has them."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (model_dir / "modules.json").write_text(json.dumps(modules))
    (model_dir / "1_Pooling").mkdir()
    (model_dir / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 48, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False,
         "pooling_mode_max_tokens": False, "pooling_mode_lasttoken": True, "include_prompt": True}))


def embedding_checkpoint(root: Path) -> Path:
    model_dir = root / "model"
    write_generation_checkpoint(model_dir, PRESETS["tiny"], TEXT_PRESETS["tiny"], seed=3,
                                processor_policy_dict=SMALL_POLICY)
    write_sentence_transformers(model_dir)
    return model_dir


def long_text(words: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    return " ".join(rng.choice(WORDS, words))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("embed")
    model_dir = embedding_checkpoint(root)
    gen = Generator(model_dir, buckets=(32, 64), context=512, cache_dir=root / "cache", lanes=2,
                    pooling=resolve_pooling(model_dir))  # 2 lanes: pool_32x2, two prompts in one call
    video = write_video(root / "clip.mp4", gradient_frames(8, 256, 256, seed=9), rate=4)
    return gen, model_dir, write_images(root, ((96, 64),)), video


def reference_embedding(model_dir, messages) -> tuple[np.ndarray, np.ndarray]:
    """(prompt ids, vector): Qwen3VLProcessor renders `messages` with the generation prompt
    (image parts {"type": "image", "image": path}, video parts {"type": "video", "video":
    path}, as tests/test_text_parity.py's `reference_chat`), then Qwen3VLModel's last hidden
    state (after the final norm) at the last token, L2-normalized (torch.nn.functional.normalize),
    as the model card's embedder computes it."""
    from PIL import Image
    from helpers import decode_all
    from transformers import AutoTokenizer, Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    processor = Qwen3VLProcessor(Qwen2VLImageProcessorPil(**SMALL_POLICY), AutoTokenizer.from_pretrained(model_dir),
                                 Qwen3VLVideoProcessor(),
                                 chat_template=(Path(model_dir) / "chat_template.jinja").read_text())
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    parts = [p for m in messages for p in m["content"] if isinstance(p, dict) and p["type"] != "text"]
    images = [Image.open(p["image"]).convert("RGB") for p in parts if p["type"] == "image"]
    videos = [decode_all(p["video"]) for p in parts if p["type"] == "video"]
    inputs = processor(text=[text], images=images or None, videos=[frames for frames, _ in videos] or None,
                       video_metadata=[VideoMetadata(total_num_frames=len(frames), fps=fps)
                                       for frames, fps in videos] or None, return_tensors="pt")
    model = reference_model(model_dir)
    with torch.inference_mode():
        hidden = model.model(**inputs).last_hidden_state[0, -1]
        vector = torch.nn.functional.normalize(hidden, p=2, dim=-1)
    return inputs["input_ids"][0].numpy(), vector.float().numpy()


def reference_item(model_dir, text=None, image=None, video=None, instruction=None):
    parts = ([{"type": "image", "image": image}] if image else []) + \
            ([{"type": "video", "video": video}] if video else []) + ([{"type": "text", "text": text}] if text else [])
    return reference_embedding(model_dir, item_messages(parts, instruction))


def ours(gen, text=None, image=None, video=None, instruction=None, dimensions=None):
    parts = ([{"type": "image"}] if image else []) + ([{"type": "video"}] if video else []) + \
            ([{"type": "text", "text": text}] if text else [])
    media = ([Media("image", image)] if image else []) + ([Media("video", video)] if video else [])
    return embed(gen, item_messages(parts, instruction), media, dimensions)


@pytest.mark.parametrize("kind", ["text", "image", "video", "chunked"])
def test_embedding_matches_transformers(setup, kind):
    gen, model_dir, images, video = setup
    item = {"text": dict(text="A cat on a red house."), "image": dict(image=images[0], text="What is it?"),
            "video": dict(video=video, text="What happens?"),
            "chunked": dict(text=long_text(150, 1), instruction="Find pictures of dogs")}[kind]
    ids, expected = reference_item(model_dir, **item)
    vector, tokens = ours(gen, **item)
    assert tokens == ids.size
    if kind == "chunked":
        assert ids.size > 2 * gen.text.buckets[-1], ids.size  # three chunks at least
    assert vector.shape == expected.shape == (48,)
    assert rel_l2(vector, expected) <= TOL, rel_l2(vector, expected)
    assert abs(np.linalg.norm(vector) - 1) < 1e-6


def test_a_tail_bucket_takes_the_rest(setup, tmp_path):
    """Over buckets 16 and 64 an item's rest runs as 64s and a 16-row tail (`prefill_chunks`
    pads the fewest rows), the last through `pool_16`: transformers' vector within 1e-5, and
    the (32, 64) module's. Items pooled together (`pooled_rows`), two such and one whose rest is
    one chunk of 64: the first chunks as pool_64x2 and pool_64, the tails as pool_16x2; each
    row the (32, 64) module's alone."""
    from emitter.text_shape import prefill_chunks
    from runtime.embedding import lane_plan, pooled_rows

    gen, model_dir, images, _ = setup
    tail = Generator(model_dir, buckets=(16, 64), context=512, cache_dir=gen.text.cache.root, lanes=2,
                     pooling=resolve_pooling(model_dir))
    assert tail.text.shape.lane_bucket == 64 and tail.text.shape.lane_buckets == (16, 64)
    for words in range(10, 40):  # an item whose last chunks over 16 and 64 are 64 and 16
        item = dict(text=long_text(words, 2), image=images[0])
        solo, tokens = ours(gen, **item)
        if [c.size for c in prefill_chunks(tokens, tail.text.shape)][-2:] == [64, 16]:
            break
    else:
        pytest.fail("no item of 10 to 39 words ends in chunks of 64 and 16")
    vector, _ = ours(tail, **item)
    _, expected = reference_item(model_dir, **item)
    assert rel_l2(vector, expected) <= TOL, rel_l2(vector, expected)
    assert rel_l2(vector, solo) <= 1e-6

    text, pictures = tail.text, [write_images(tmp_path, ((96, 64),), seed=s)[0] for s in (5, 6, 7)]

    def placed(words: int, picture: str):
        item = dict(text=long_text(words, 3), image=picture)
        prompt = tail.prepare(item_messages([{"type": "image"}, {"type": "text", "text": item["text"]}]),
                              [Media("image", picture)], 1)
        seq, start = text.admit(prompt)
        return item, prompt, seq, start, lane_plan(text, prompt, start)

    words = {}  # a rest (after the cached instruction) of 64 + 16 rows, and one of 64
    for n in range(10, 60):
        *_, seq, _, plan = placed(n, pictures[0])
        text.release(seq)
        words.setdefault(plan, n)
    assert (64, 16) in words and (64,) in words, words
    lanes = [placed(words[64, 16], pictures[0]), placed(words[64, 16], pictures[1]), placed(words[64,], pictures[2])]
    try:  # pool_64x2 and pool_64 (the third), then pool_16x2
        rows = pooled_rows(text, [lane[2] for lane in lanes], [lane[1] for lane in lanes], [lane[3] for lane in lanes])
    finally:
        for lane in lanes:
            text.release(lane[2])
    for row, lane in zip(rows, lanes):
        assert rel_l2(finish(row), ours(gen, **lane[0])[0]) <= 1e-6  # the (32, 64) module's, its own cache


def test_two_prompts_in_one_call(setup):
    """pool_32x2 (emitter/text_pool.py): two prompts' rests, each one chunk of the smallest
    bucket from its own slot (the shared instruction's block found in the prefix cache), in
    one call: each row its prompt's alone (`pooled_row`), and transformers' within 1e-5."""
    from runtime.embedding import lane_plan, pooled_rows

    gen, model_dir, images, _ = setup
    items = [dict(text="a cat"), dict(image=images[0])]
    prompts = []
    for item in items:
        parts, media = ([{"type": "text", "text": item["text"]}], []) if "text" in item else \
            ([{"type": "image"}], [Media("image", item["image"])])
        prompts.append(gen.prepare(item_messages(parts), media, 1))
    solo = [gen.text.pooled_row(p) for p in prompts]  # its blocks then in the prefix cache
    text = gen.text
    placed = [text.admit(p) for p in prompts]
    try:
        assert all(lane_plan(text, p, start) == (32,) for p, (_, start) in zip(prompts, placed))
        rows = pooled_rows(text, [seq for seq, _ in placed], prompts, [start for _, start in placed])
    finally:
        for seq, _ in placed:
            text.release(seq)
    for row, alone, item in zip(rows, solo, items):
        assert rel_l2(row, alone) <= 1e-6
        _, expected = reference_item(model_dir, **item)
        assert rel_l2(finish(row), expected) <= TOL


def test_instruction_and_dimensions(setup):
    """The default instruction is the model card's; another one changes the vector (so the
    comparison can fail); Matryoshka: the first N values renormalized."""
    gen, model_dir, _, _ = setup
    default, _ = ours(gen, text="A cat on a red house.")
    same, _ = ours(gen, text="A cat on a red house.", instruction=DEFAULT_INSTRUCTION)
    other, _ = ours(gen, text="A cat on a red house.", instruction="Represent the query")
    assert np.array_equal(default, same) and rel_l2(other, default) > 100 * TOL
    short, _ = ours(gen, text="A cat on a red house.", dimensions=16)
    _, expected = reference_item(model_dir, text="A cat on a red house.")
    truncated = expected[:16] / np.linalg.norm(expected[:16])
    assert short.shape == (16,) and rel_l2(short, truncated) <= TOL
    with pytest.raises(PoolingError, match=r"dimensions 49: expected an integer in \[1, 48\]"):
        ours(gen, text="x", dimensions=49)


def test_detection_and_flags(tmp_path, setup):
    _, model_dir, _, _ = setup
    assert checkpoint_pooling(model_dir).normalize is True
    plain = tmp_path / "plain"
    plain.mkdir()
    assert checkpoint_pooling(plain) is None and resolve_pooling(plain) is None
    assert resolve_pooling(plain, "last").normalize is True
    assert resolve_pooling(plain, "last", False).normalize is False
    with pytest.raises(PoolingError, match="--pooling mean: expected one of last"):
        resolve_pooling(plain, "mean")
    with pytest.raises(PoolingError, match="only with --pooling"):
        resolve_pooling(plain, None, True)
    mean = tmp_path / "mean"
    mean.mkdir()
    write_sentence_transformers(mean)
    (mean / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    with pytest.raises(PoolingError, match="pooling mean_tokens: only last-token pooling"):
        checkpoint_pooling(mean)
    card = tmp_path / "card"
    card.mkdir()
    (card / "README.md").write_text("---\nlicense: apache-2.0\npipeline_tag: feature-extraction\ntags:\n"
                                    "- transformers\n- multimodal embedding\n---\n# Qwen3-VL-Embedding-2B\n")
    assert checkpoint_pooling(card) == Pooling("last", True, "checkpoint's README.md")
    (card / "README.md").write_text("---\npipeline_tag: image-text-to-text\ntags:\n- multimodal rerank\n---\n")
    assert checkpoint_pooling(card) is None
    assert np.array_equal(finish([3.0, 4.0, 12.0], False, 2), [3.0, 4.0])
    assert np.allclose(finish([3.0, 4.0, 12.0], True, 2), [0.6, 0.8])


def test_generative_module_unchanged_by_pooling():
    """The pooling entries are added beside the others: a generative module's MLIR is the
    same bytes, and a pooling module holds it whole but for its header line."""
    cfg = TEXT_PRESETS["tiny"]
    plain = emit_text_module(cfg, TextShape((32,), 64), 2)
    pooled = emit_text_module(cfg, TextShape((32,), 64, pooled=True), 2)
    assert "pool_32" not in plain and "func.func @pool_32" in pooled
    for function in plain.split("\n", 1)[1].split("  func.func ")[1:]:  # globals, each entry: the same text
        assert "  func.func " + function.removesuffix("}\n") in pooled


def test_embed_command_writes_retrieval_vectors(setup, tmp_path):
    """`qwen3vl embed`'s retrieval vectors (runtime/jobs/retrieval.py, at the fixture's shape:
    its module from the cache) on the embedding checkpoint: one row per item (an image of a
    folder, the lines of a .txt, an (image, text) pair of a .jsonl), each the vector of
    `embed`; a rerun skips them, a new line is embedded alone. The command's own branch: its
    one-line refusals."""
    from click.testing import CliRunner
    from safetensors.numpy import load_file
    from runtime.commands.main import main
    from runtime.jobs.retrieval import embed_items

    gen, model_dir, images, _ = setup
    folder = tmp_path / "shots"
    folder.mkdir()
    (folder / "a.png").write_bytes(Path(images[0]).read_bytes())
    lines = tmp_path / "queries.txt"
    lines.write_text("a red cat\n\na dog in the sky\n")
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"image": "shots/a.png", "text": "What is it?"}) + "\n")
    out = tmp_path / "out"

    def run():
        return embed_items(model_dir, [str(folder), str(lines), str(pairs)], out, gen.pooling, batch=2,
                           cache_dir=gen.text.cache.root, progress_bar=False, context=512, buckets=(32, 64))

    assert run().items == 4
    index = json.loads((out / "index.json").read_text())
    assert index["format"] == "retrieval" and index["dimensions"] == 48 and len(index["items"]) == 4
    rows = {e["item"]: load_file(str(out / e["shard"]))["embeddings"][e["row"]] for e in index["items"]}
    expected = {str((folder / "a.png").absolute()): ours(gen, image=images[0]),
                f"{lines.absolute()}:1": ours(gen, text="a red cat"),
                f"{lines.absolute()}:3": ours(gen, text="a dog in the sky"),
                f"{pairs.absolute()}:1": ours(gen, image=images[0], text="What is it?")}
    assert rows.keys() == expected.keys()
    for key, (vector, _) in expected.items():
        assert np.array_equal(rows[key], vector), key  # the same module, the same prompt: the same bits
    lines.write_text("a red cat\n\na dog in the sky\na tree\n")
    again = run()
    assert (again.items, again.skipped) == (1, 4) and len(json.loads((out / "index.json").read_text())["items"]) == 5
    refused = CliRunner().invoke(main, ["embed", "--model", str(model_dir), str(lines), "-o", str(out),
                                        "--format", "vllm"])
    assert refused.exit_code != 0 and "an embedding model writes retrieval vectors" in refused.output, refused.output
    refused = CliRunner().invoke(main, ["embed", "--model", str(model_dir), str(lines), "-o", str(out),
                                        "--no-normalize", "--dimensions", "49"])
    assert refused.exit_code != 0 and "--dimensions 49: expected an integer in [1, 48]" in refused.output


def test_embed_on_ray_equals_local(setup, tmp_path):
    """`qwen3vl embed --ray-local 2` on the embedding checkpoint: two actors, each its own
    Generator opened from the cache; the index and the vectors are the local run's, bit for
    bit, and an item the context cannot hold is a failed entry with its reason."""
    pytest.importorskip("ray.data")
    from safetensors.numpy import load_file
    from runtime.jobs.retrieval import embed_items

    gen, model_dir, images, _ = setup
    pairs = tmp_path / "items.jsonl"
    pairs.write_text("".join(json.dumps(item) + "\n" for item in (
        {"image": str(images[0]), "text": "What is it?"}, {"text": "a red cat"},
        {"text": "a dog", "instruction": "Find the animal."}, {"text": long_text(900, 3)}, {"image": str(images[0])})))

    def run(out, **ray):
        return embed_items(model_dir, [str(pairs)], out, gen.pooling, batch=2, cache_dir=gen.text.cache.root,
                           progress_bar=False, context=512, buckets=(32, 64), **ray)

    local, ray = run(tmp_path / "local"), run(tmp_path / "ray", ray_local=2)
    assert (local.items, local.failed) == (ray.items, ray.failed) == (4, 1)
    indexes = [json.loads((tmp_path / name / "index.json").read_text()) for name in ("local", "ray")]
    assert [i.pop("engine") for i in indexes] == ["local", "ray"] and indexes[0] == indexes[1]
    failed = [e for e in indexes[1]["items"] if "error" in e]
    assert [e["item"] for e in failed] == [f"{pairs.absolute()}:4"] and "512" in failed[0]["error"]
    for entry in indexes[0]["items"]:
        if "shard" in entry:
            rows = [load_file(str(tmp_path / name / entry["shard"]))["embeddings"][entry["row"]]
                    for name in ("local", "ray")]
            assert np.array_equal(*rows), entry["item"]


def test_checkpoint_without_lm_head(setup, tmp_path):
    """An embedding checkpoint stored as Qwen3VLModel stores it (no lm_head, untied) opens with
    pooling, its vector transformers' (whose Qwen3VLModel reads no head either); without
    pooling it is refused in one line, as any checkpoint missing a weight."""
    import shutil
    from safetensors.numpy import load_file, save_file
    from runtime.checkpoints.vision import CheckpointError

    gen, model_dir, _, _ = setup
    folder = tmp_path / "headless"
    shutil.copytree(model_dir, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    assert tensors.pop("lm_head.weight") is not None
    save_file(tensors, str(folder / "model.safetensors"))
    headless = Generator(folder, buckets=(32,), context=128, cache_dir=gen.text.cache.root,
                         pooling=resolve_pooling(folder))
    vector, _ = ours(headless, text="A cat on a red house.")
    _, expected = reference_item(folder, text="A cat on a red house.")
    assert rel_l2(vector, expected) <= TOL
    with pytest.raises(CheckpointError, match="lm_head.weight: missing"):
        Generator(folder, buckets=(32,), context=128, cache_dir=gen.text.cache.root)
