"""Videos: PyAV decoding, frame sampling and pixels against transformers'
Qwen3VLVideoProcessor on the same decoded frames; the tower on video grids against
transformers' tower; `qwen3vl run --video`; the prompt with timestamps and M-RoPE ids
against Qwen3VLProcessor and get_rope_index; one-line errors for bad videos."""

from __future__ import annotations

from pathlib import Path

import av
import numpy as np
import pytest

from emitter.config import PRESETS
from emitter.text_config import load_token_ids
from helpers import decode_all, gradient_frames, write_video
from emitter.video_policy import DEFAULT_VIDEO_POLICY, VideoPolicy
from runtime.inputs.video import VideoError, load_video, process_video, video_grid

TINY = PRESETS["tiny"]
SMALL_VIDEO = VideoPolicy(min_pixels=4096, max_pixels=4 * 64 * 64 * 8)  # tiny tests: small frames


def hf_video_processor(policy: VideoPolicy):
    from transformers import Qwen3VLVideoProcessor
    return Qwen3VLVideoProcessor(**policy.to_config())


def hf_process(policy: VideoPolicy, path):
    """transformers' video processor on every decoded frame of `path` with its metadata
    (it samples the frames itself)."""
    from transformers.video_utils import VideoMetadata
    frames, fps = decode_all(path)
    meta = VideoMetadata(total_num_frames=len(frames), fps=fps, width=frames.shape[2], height=frames.shape[1])
    out = hf_video_processor(policy)(videos=[frames], video_metadata=[meta], return_metadata=True,
                                     return_tensors="pt")
    return out["pixel_values_videos"].numpy(), out["video_grid_thw"].numpy(), out["video_metadata"][0]


# (frames, width, height, rate, policy): on the 32-pixel grid, so neither side resizes
ON_GRID = [
    (10, 64, 64, 10, SMALL_VIDEO),     # 2 fps of a 1 s clip -> min_frames 4
    (9, 96, 64, 4, SMALL_VIDEO),       # odd sample count -> the last group padded
    (40, 64, 96, 8, SMALL_VIDEO),      # 5 s -> 10 frames
    (5, 64, 64, 25, SMALL_VIDEO),      # fewer frames than min_frames wanted
    (30, 32, 64, 10, VideoPolicy(min_pixels=4096, max_pixels=1 << 20, fps=None, min_frames=2, max_frames=7)),
]


@pytest.mark.parity
@pytest.mark.parametrize("n,width,height,rate,policy", ON_GRID)
def test_pixels_equal_transformers_on_grid(tmp_path, n, width, height, rate, policy):
    path = write_video(tmp_path / "v.mp4", gradient_frames(n, width, height, seed=n), rate=rate)
    expected, expected_grid, meta = hf_process(policy, path)
    pixels, grid, video = process_video(path, policy)
    assert video.indices == [int(i) for i in meta.frames_indices]
    np.testing.assert_array_equal(np.array([grid]), expected_grid)
    assert video_grid(path, policy) == grid
    np.testing.assert_array_equal(pixels, expected)


RESIZED = [(8, 100, 70), (8, 150, 100), (6, 40, 30), (12, 200, 120), (24, 64, 64), (6, 333, 500)]


@pytest.mark.parity
@pytest.mark.parametrize("n,width,height", RESIZED)
def test_resized_pixels_equal_transformers(tmp_path, n, width, height):
    """Off the grid too: transformers resizes with torchvision's uint8 antialiased bicubic
    (torch's int16 fixed-point kernel on this CPU), reproduced bit for bit. (PIL's bicubic,
    the image processor's, was off by one level in 0.01% to 0.4% of values here, and by
    up to 8 in its own pass order.)"""
    path = write_video(tmp_path / "v.mp4", gradient_frames(n, width, height, seed=n), rate=4)
    policy = SMALL_VIDEO if width != 64 else VideoPolicy(min_pixels=160 * 160 * 8, max_pixels=1 << 22)
    expected, expected_grid, _ = hf_process(policy, path)
    pixels, grid, _ = process_video(path, policy)
    np.testing.assert_array_equal(np.array([grid]), expected_grid)
    assert (grid[1] * 16, grid[2] * 16) != (height, width), "resized"
    np.testing.assert_array_equal(pixels, expected)


POLICIES = [
    {},
    {"fps": 1, "min_frames": 2, "max_frames": 6},
    {"fps": None, "num_frames": 6},
    {"size": {"shortest_edge": 8192, "longest_edge": 65536}, "cap_pixels_per_frame": True, "max_video_tokens": 8},
    {"do_normalize": False},
    {"do_rescale": False, "image_mean": [100, 120, 140], "image_std": [50, 60, 70]},
    {"resample": 2, "fps": None, "num_frames": 6},  # bilinear, resized
]


@pytest.mark.parity
@pytest.mark.parametrize("config", POLICIES)
def test_policy_read_as_transformers_reads_it(tmp_path, config):
    """The same dict through VideoPolicy and Qwen3VLVideoProcessor: same settings, same
    frames and the same pixels."""
    from transformers import Qwen3VLVideoProcessor
    policy = VideoPolicy.from_config(config)
    hf = Qwen3VLVideoProcessor(**config)
    for name in ("patch_size", "temporal_patch_size", "merge_size", "min_frames", "max_frames", "fps", "num_frames",
                 "do_resize", "do_rescale", "do_normalize", "rescale_factor", "max_video_tokens"):
        assert getattr(policy, name) == getattr(hf, name), name
    assert (policy.min_pixels, policy.max_pixels) == (hf.size["shortest_edge"], hf.size["longest_edge"])
    assert list(policy.image_mean) == list(hf.image_mean) and list(policy.image_std) == list(hf.image_std)
    path = write_video(tmp_path / "v.mp4", gradient_frames(24, 64, 64, seed=3), rate=6)
    expected, expected_grid, meta = hf_process(policy, path)
    pixels, grid, video = process_video(path, policy)
    assert video.indices == [int(i) for i in meta.frames_indices]
    np.testing.assert_array_equal(np.array([grid]), expected_grid)
    np.testing.assert_array_equal(pixels, expected)


def test_video_policy_enters_the_artifact_identity():
    from emitter.config import PRESETS
    from emitter.identity import vision_artifact_fields, artifact_identity
    from emitter.policy import DEFAULT_POLICY
    base = vision_artifact_fields(PRESETS["tiny"], 16, DEFAULT_POLICY)
    assert base["video_policy"] == DEFAULT_VIDEO_POLICY.to_dict()
    other = vision_artifact_fields(PRESETS["tiny"], 16, DEFAULT_POLICY,
                                   video_policy=VideoPolicy.from_config({"fps": 1}))
    assert artifact_identity(other) != artifact_identity(base)


def test_timestamps_are_the_processors(tmp_path):
    """Group times as Qwen3VLProcessor._calculate_timestamps gives them (odd count padded)."""
    path = write_video(tmp_path / "v.mp4", gradient_frames(9, 64, 64), rate=4)
    video = load_video(path, SMALL_VIDEO)
    assert video.indices == [0, 3, 5, 8]  # int(9 / 4 * 2) = 4 frames
    assert video.timestamps(2) == [(0 / 4 + 3 / 4) / 2, (5 / 4 + 8 / 4) / 2]
    odd = load_video(path, VideoPolicy(fps=None, num_frames=3, min_pixels=4096, max_pixels=1 << 20))
    assert odd.indices == [0, 4, 8] and odd.timestamps(2) == [(0 + 1) / 2, (2 + 2) / 2]


# --------------------------------------------------------------------------- the tower

TINY_POLICY = {"size": {"shortest_edge": 4096, "longest_edge": 32768}}  # images (runtime.checkpoints.synthetic's defaults)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A random tiny checkpoint with SMALL_VIDEO as its video policy, its source weights,
    and a session over buckets 64 and 128."""
    from runtime.vision import VisionSession
    from runtime.checkpoints.synthetic import DEFAULT_PROCESSOR, write_checkpoint
    folder = tmp_path_factory.mktemp("tiny-video")
    weights = write_checkpoint(folder / "m", TINY, seed=5, processor_policy_dict=dict(DEFAULT_PROCESSOR, **TINY_POLICY),
                               video_policy_dict=SMALL_VIDEO.to_config())
    session = VisionSession(folder / "m", buckets=(64, 128), cache_dir=folder / "cache")
    return folder / "m", weights, session


@pytest.mark.parity
def test_video_embeddings_match_transformers_tower(tmp_path, tiny_model):
    """Two videos (8 and 12 sampled frames, 64x96 and 96x64) through the session against
    transformers' processor + Qwen3VLVisionModel on the same decoded frames: the pixels
    are equal (on the grid) and every output within relL2 1e-5. The videos' frame groups
    span several calls of the 128 bucket."""
    from conftest import rel_l2
    from torch_reference import run_vision_tower
    _, weights, session = tiny_model
    paths = [write_video(tmp_path / "a.mp4", gradient_frames(20, 96, 64, seed=1), rate=5),
             write_video(tmp_path / "b.mkv", gradient_frames(60, 64, 96, seed=2), rate=10, fmt="matroska")]
    pixels, grids = zip(*[hf_process(SMALL_VIDEO, p)[:2] for p in paths])
    expected = run_vision_tower(TINY, weights, np.concatenate(pixels), np.concatenate(grids))
    out = session.encode_videos(paths)
    np.testing.assert_array_equal(out.grid_thw, np.concatenate(grids))
    assert [tuple(g) for g in out.grid_thw] == [(4, 4, 6), (6, 6, 4)]
    assert len(out.calls) >= 2
    assert rel_l2(out.image_embeds, expected["merger"]) <= 1e-5
    for k in range(len(TINY.deepstack_visual_indexes)):
        assert rel_l2(out.deepstack_features[k], expected[f"deepstack_merger_list.{k}"]) <= 1e-5


# --------------------------------------------------------------------------- qwen3vl run --video

QWEN3VL = str(Path(__import__("sys").executable).parent / "qwen3vl")


def qwen3vl(*args):
    import subprocess
    return subprocess.run([QWEN3VL, *args], capture_output=True, text=True)


@pytest.mark.parity
def test_run_writes_video_features_in_input_order(tmp_path, tiny_model):
    """`qwen3vl run IMAGE --video A --video B -o F`: the image's features as before, the
    videos' under video_* keys, videos in the order given, each equal to transformers'."""
    from safetensors.numpy import load_file
    from conftest import rel_l2
    from helpers import write_images
    from torch_reference import run_vision_tower
    model, weights, session = tiny_model
    image = write_images(tmp_path, [(96, 64)])[0]
    a = write_video(tmp_path / "a.mp4", gradient_frames(20, 64, 64, seed=3), rate=5)
    b = write_video(tmp_path / "b.avi", gradient_frames(9, 96, 64, seed=4), rate=4, fmt="avi")
    result = qwen3vl("run", "--model", str(model), image, "--video", b, "--video", a, "-o", str(tmp_path / "f.st"),
                     "--bucket", "64", "--bucket", "128", "--cache-dir", str(model.parent / "cache"))
    assert result.returncode == 0, result.stderr
    assert f"video    {b}: 4 of 9 frames (4 fps), grid (2, 4, 6) -> 12 tokens" in result.stdout
    out = load_file(tmp_path / "f.st")
    assert out["video_grid_thw"].tolist() == [[2, 4, 6], [4, 4, 4]] and out["video_grid_thw"].dtype == np.int64
    assert out["grid_thw"].tolist() == [[1, 4, 6]]
    assert out["video_embeds"].shape == (12 + 16, TINY.out_hidden_size)
    assert out["video_deepstack_features"].shape == (2, 28, TINY.out_hidden_size)
    assert out["image_embeds"].shape == (6, TINY.out_hidden_size)
    np.testing.assert_allclose(out["image_embeds"], session.encode([image]).image_embeds, rtol=0, atol=1e-5)
    pixels, grids = zip(*[hf_process(SMALL_VIDEO, p)[:2] for p in (b, a)])
    expected = run_vision_tower(TINY, weights, np.concatenate(pixels), np.concatenate(grids))
    assert rel_l2(out["video_embeds"], expected["merger"]) <= 1e-5
    for k in range(2):
        assert rel_l2(out["video_deepstack_features"][k], expected[f"deepstack_merger_list.{k}"]) <= 1e-5


# --------------------------------------------------------------------------- bad videos


def zero_frame_video(tmp_path) -> str:
    """An AVI with a video stream and no frames."""
    path = tmp_path / "empty.avi"
    container = av.open(str(path), "w", format="avi")
    stream = container.add_stream("mpeg4", rate=10)
    stream.width = stream.height = 64
    container.start_encoding()
    container.close()
    return str(path)


def truncated_video(tmp_path) -> str:
    """A Matroska file cut before its first cluster."""
    data = Path(write_video(tmp_path / "full.mkv", gradient_frames(4, 64, 64), fmt="matroska")).read_bytes()
    return _write(tmp_path / "cut.mkv", data[:data.index(b"\x1f\x43\xb6\x75")])  # the Cluster element id


def cut_short_video(tmp_path) -> str:
    """A Matroska file of 40 frames cut to 40% of its bytes: its header's duration still
    says 40 frames (Matroska stores no frame count), a few decode."""
    data = Path(write_video(tmp_path / "full.mkv", gradient_frames(40, 64, 64), fmt="matroska")).read_bytes()
    return _write(tmp_path / "short.mkv", data[:len(data) * 2 // 5])


def unknown_codec_video(tmp_path) -> str:
    """An AVI whose codec tag names no decoder (FMP4 rewritten as QQZ9)."""
    data = Path(write_video(tmp_path / "ok.avi", gradient_frames(4, 64, 64), fmt="avi")).read_bytes()
    assert data.count(b"FMP4") == 2
    path = tmp_path / "unknown.avi"
    path.write_bytes(data.replace(b"FMP4", b"QQZ9"))
    return str(path)


BAD_VIDEOS = {  # name -> (make(tmp_path), message)
    "missing": (lambda d: str(d / "nope.mp4"), r"nope\.mp4: no such video file"),
    "directory": (lambda d: str(d), r": is a directory, not a video file"),
    "not a video": (lambda d: _write(d / "junk.mp4", b"not a video at all" * 20),
                    r"junk\.mp4: not a video container PyAV/FFmpeg can read \(.*Invalid data"),
    "image": (lambda d: __import__("helpers").write_images(d, [(64, 64)])[0],
              r"img0\.png: .*(no video stream|frame\(s\) sampled)"),
    "zero frames": (zero_frame_video, r"empty\.avi: video has no frames"),
    "truncated": (truncated_video, r"cut\.mkv: not a video container PyAV/FFmpeg can read \(.*End of file"),
    "cut short": (cut_short_video, r"short\.mkv: \d+ frames decode of the 40 its container's duration declares; "
                                   r"the file is truncated or damaged"),
    "unknown codec": (unknown_codec_video, r"unknown\.avi: video codec not supported by this PyAV/FFmpeg build"),
    "one frame": (lambda d: write_video(d / "one.mp4", gradient_frames(1, 64, 64)),
                  r"one\.mp4: 1 frame\(s\) sampled of 1; the processor needs at least temporal_patch_size = 2"),
    "too long": (lambda d: write_video(d / "long.mp4", gradient_frames(80, 64, 64), rate=4),
                 r"long\.mp4: too long for the video policy: 40 sampled frames need at least 40960 pixels, "
                 r"more than size.longest_edge = 32768"),
}
BOUNDED = VideoPolicy(min_pixels=1024, max_pixels=32768)  # at most 32 frames of 32x32


def _write(path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


@pytest.mark.parametrize("case", list(BAD_VIDEOS))
def test_bad_video_is_one_line_naming_the_file(tmp_path, case):
    make, message = BAD_VIDEOS[case]
    path = make(tmp_path)
    with pytest.raises(VideoError, match=message) as info:
        process_video(path, BOUNDED)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("case", ["not a video", "zero frames", "unknown codec", "too long", "cut short"])
def test_run_refuses_a_bad_video_before_writing_anything(tmp_path, case):
    """One line on stderr, exit 2, no output file and no cache entry."""
    from runtime.checkpoints.synthetic import DEFAULT_PROCESSOR, write_checkpoint
    write_checkpoint(tmp_path / "m", TINY, seed=1, processor_policy_dict=dict(DEFAULT_PROCESSOR, **TINY_POLICY),
                     video_policy_dict=BOUNDED.to_config())
    make, message = BAD_VIDEOS[case]
    path = make(tmp_path)
    result = qwen3vl("run", "--model", str(tmp_path / "m"), "--video", path, "-o", str(tmp_path / "f.st"),
                     "--cache-dir", str(tmp_path / "cache"))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert __import__("re").search(message, lines[0])
    assert not (tmp_path / "f.st").exists() and not (tmp_path / "cache").exists()


# --------------------------------------------------------------------------- prompt and prefill


@pytest.fixture(scope="module")
def answer_model(tmp_path_factory):
    """A random tiny checkpoint with a language model, tokenizer and template."""
    from emitter.text_config import TEXT_PRESETS
    from runtime.checkpoints.synthetic import DEFAULT_PROCESSOR
    from runtime.checkpoints.synthetic_text import write_generation_checkpoint
    folder = tmp_path_factory.mktemp("answer") / "m"
    write_generation_checkpoint(folder, TINY, TEXT_PRESETS["tiny"], seed=3,
                                processor_policy_dict=dict(DEFAULT_PROCESSOR, **TINY_POLICY))
    return folder


@pytest.mark.parity
def test_prompt_and_positions_match_transformers(tmp_path, answer_model, tiny_model):
    """One user turn with an image and two videos (9 and 20 frames: an odd sample count
    pads the last group): our input_ids (timestamps, per-group vision_start/end and pads)
    equal Qwen3VLProcessor's, and our M-RoPE ids and rope delta equal get_rope_index's."""
    from PIL import Image
    from helpers import write_images
    from transformers import AutoTokenizer, Qwen3VLConfig, Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel
    from transformers.video_utils import VideoMetadata
    from emitter.policy import load_policy
    from emitter.video_policy import load_video_policy
    from runtime.inputs.prefill import mrope_position_ids
    from runtime.inputs.processor import process_images
    from runtime.inputs.tokenizer import ChatTokenizer
    from runtime.inputs.video import process_videos, prompt_groups

    policy, video_policy = load_policy(answer_model), load_video_policy(answer_model)
    assert video_policy == DEFAULT_VIDEO_POLICY
    image = write_images(tmp_path, [(96, 64)])[0]
    paths = [write_video(tmp_path / "a.mp4", gradient_frames(9, 64, 96, seed=5), rate=4),
             write_video(tmp_path / "b.mp4", gradient_frames(20, 64, 64, seed=6), rate=4)]
    prompt = "what is shown here"

    # transformers: the processor renders, expands and tokenizes; get_rope_index places
    tokenizer = AutoTokenizer.from_pretrained(answer_model)
    processor = Qwen3VLProcessor(Qwen2VLImageProcessorPil(**policy.to_preprocessor_config()), tokenizer,
                                 hf_video_processor(video_policy),
                                 chat_template=(answer_model / "chat_template.jinja").read_text())
    content = [{"type": "image"}] + [{"type": "video"}] * 2 + [{"type": "text", "text": prompt}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
    videos, metas = [], []
    for path in paths:
        frames, fps = decode_all(path)
        videos.append(frames)
        metas.append(VideoMetadata(total_num_frames=len(frames), fps=fps))
    inputs = processor(text=[text], images=[Image.open(image).convert("RGB")], videos=videos, video_metadata=metas,
                       return_tensors="pt")
    expected_ids = inputs["input_ids"][0].numpy()
    model = Qwen3VLModel(Qwen3VLConfig.from_pretrained(answer_model)).eval()
    expected_pos, expected_delta = model.get_rope_index(
        inputs["input_ids"], mm_token_type_ids=inputs["mm_token_type_ids"], image_grid_thw=inputs["image_grid_thw"],
        video_grid_thw=inputs["video_grid_thw"])
    # video a samples frames 0, 3, 5, 8 of 9 at 4 fps: groups at (0 + 0.75) / 2 and (1.25 + 2) / 2 seconds
    assert "<|vision_start|><0.4 seconds><|vision_start|>" in tokenizer.decode(expected_ids)
    assert "<|vision_end|><1.6 seconds><|vision_start|>" in tokenizer.decode(expected_ids)
    # ours
    _, grids = process_images([image], policy)
    _, video_grids, decoded = process_videos(paths, video_policy)
    np.testing.assert_array_equal(video_grids, inputs["video_grid_thw"].numpy())
    token_ids = load_token_ids(answer_model)
    image_id, video_id = token_ids.image_token_id, token_ids.video_token_id
    ids = ChatTokenizer(answer_model).prompt_ids(
        prompt, token_ids, [int(np.prod(g)) // 4 for g in grids],
        [prompt_groups(v, g, video_policy) for v, g in zip(decoded, video_grids)])
    assert ids.tolist() == expected_ids.tolist()
    position_ids, delta = mrope_position_ids(ids, grids, video_grid_thw=video_grids, image_token_id=image_id,
                                             video_token_id=video_id)
    np.testing.assert_array_equal(position_ids, expected_pos[:, 0].numpy())
    assert delta == int(expected_delta[0, 0])


def test_payload_places_image_and_video_rows_at_their_pads(tmp_path, tiny_model):
    """session.prefill with an image and a video between text: every visual row (main and
    DeepStack) is the image's or the video's own, at its pads in prompt order, as
    transformers' masked scatters and joint DeepStack rows place them."""
    from helpers import write_images
    _, _, session = tiny_model
    ids = load_token_ids(session.model_dir)
    IMAGE_PAD, VIDEO_PAD, VE, VS = (ids.image_token_id, ids.video_token_id, ids.vision_end_token_id,
                                    ids.vision_start_token_id)
    image = write_images(tmp_path, [(64, 64)])[0]
    video = write_video(tmp_path / "a.mp4", gradient_frames(8, 64, 96, seed=7), rate=4)  # 4 frames: 2 groups
    group = [VS] + [VIDEO_PAD] * 6 + [VE]
    ids = [1, 2] + [VS, 30, 31] + group + [32, 33] + group + [VE] + [3, VS, IMAGE_PAD, VE, 4]
    payload = session.prefill(ids, [image], videos=[video])
    image_out, video_out = session.encode([image]), session.encode_videos([video])
    ids = payload.input_ids
    at_video = ids[payload.visual_positions] == VIDEO_PAD
    assert at_video.tolist() == [True] * 12 + [False] * 4
    np.testing.assert_array_equal(payload.image_embeds[at_video], video_out.image_embeds)
    np.testing.assert_array_equal(payload.image_embeds[~at_video], image_out.image_embeds)
    for k, features in payload.deepstack:
        np.testing.assert_array_equal(features[at_video], video_out.deepstack_features[k])
        np.testing.assert_array_equal(features[~at_video], image_out.deepstack_features[k])
    assert payload.position_ids.shape == (3, len(ids))


def test_run_without_any_input_is_one_line(tmp_path):
    result = qwen3vl("run", "--model", str(tmp_path))
    assert result.returncode == 2
    assert result.stderr.strip() == "error: no input: give one or more IMAGE files or --video FILE"


@pytest.mark.parity
def test_generate_with_a_video_matches_transformers(tmp_path, answer_model):
    """Generator.generate with an image and a video against transformers' processor and
    Qwen3VLForConditionalGeneration.generate (greedy) on the same decoded frames: the same
    prompt ids, the same tokens, every step's logits within relL2 1e-5."""
    import torch
    from PIL import Image
    from conftest import rel_l2
    from helpers import write_images
    from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration, Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.video_utils import VideoMetadata
    from emitter.policy import load_policy
    from runtime.generator import Generator

    steps, prompt = 6, "describe the picture"
    image = write_images(tmp_path, [(96, 64)])[0]
    video = write_video(tmp_path / "v.mp4", gradient_frames(12, 64, 64, seed=8), rate=4)  # 6 frames: 3 groups
    processor = Qwen3VLProcessor(Qwen2VLImageProcessorPil(**load_policy(answer_model).to_preprocessor_config()),
                                 AutoTokenizer.from_pretrained(answer_model), hf_video_processor(DEFAULT_VIDEO_POLICY),
                                 chat_template=(answer_model / "chat_template.jinja").read_text())
    content = [{"type": "image"}, {"type": "video"}, {"type": "text", "text": prompt}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
    frames, fps = decode_all(video)
    inputs = processor(text=[text], images=[Image.open(image).convert("RGB")], videos=[frames],
                       video_metadata=[VideoMetadata(total_num_frames=len(frames), fps=fps)], return_tensors="pt")
    model = Qwen3VLForConditionalGeneration.from_pretrained(answer_model, dtype=torch.float32,
                                                            attn_implementation="eager").eval()
    with torch.inference_mode():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=steps, return_dict_in_generate=True,
                             output_logits=True)
    n = inputs["input_ids"].shape[1]
    tokens, logits = out.sequences[0, n:].tolist(), np.stack([x[0].float().numpy() for x in out.logits])

    gen = Generator(answer_model, buckets=(64, 128), context=192, cache_dir=tmp_path / "cache")
    ours = gen.generate(prompt, images=[image], videos=[video], max_new_tokens=steps)
    assert ours.input_ids.tolist() == inputs["input_ids"][0].tolist()
    assert len(tokens) == steps and ours.tokens == tokens
    errors = [rel_l2(a, b) for a, b in zip(ours.logits, logits)]
    assert max(errors) <= 1e-5, errors
