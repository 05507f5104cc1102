"""`qwen3vl generate`: images and a prompt in, the greedy answer streamed to stdout."""

from __future__ import annotations

import io
import json
import sys

import click

from emitter.errors import command_errors

from runtime.commands.options import CONTEXT, text_options
from runtime.text import CONTEXT_LADDER, DEFAULT_PROMPT_BUCKETS


def _npy_bytes(array) -> bytes:
    import numpy as np
    buffer = io.BytesIO()
    np.save(buffer, np.asarray(array, np.float32))
    return buffer.getvalue()


def sampling_options(defaults, temperature, top_p, top_k, seed):
    """The checkpoint's sampling settings with the command's options; an option that
    only applies to sampling while decoding greedily is an error, not ignored."""
    from runtime.sampling import SamplingError

    params = defaults.with_overrides(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    given = [name for name, value in (("--top-p", top_p), ("--top-k", top_k), ("--seed", seed)) if value is not None]
    if given and not params.do_sample:
        raise SamplingError(f"{given[0]}: only applies when sampling; give --temperature above 0 (decoding is "
                            "greedy: generation_config.json does not set do_sample true)")
    return params


@click.command("generate", context_settings=CONTEXT)
@text_options(context_help="Tokens the KV cache holds (default: the least of "
                           f"{', '.join(map(str, CONTEXT_LADDER))} that holds the prompt and answer; docs/text.md).",
              buckets_help="Prefill bucket in tokens (repeatable; default "
                           f"{' '.join(map(str, DEFAULT_PROMPT_BUCKETS))}); a longer prompt runs in chunks of the largest.")
@click.option("--image", "images", multiple=True, metavar="PATH", help="An image, in prompt order (repeatable).")
@click.option("--video", "videos", multiple=True, metavar="PATH",
              help="A video, after the images, in prompt order (repeatable; see qwen3vl run --video).")
@click.option("--prompt", required=True, metavar="TEXT", help="The user message's text (after the images and videos).")
@click.option("--max-new-tokens", type=int, default=64, show_default=True, metavar="N",
              help="Stop after N new tokens (or at an EOS id of generation_config.json).")
@click.option("--json", "json_path", metavar="FILE",
              help="Write {prompt_tokens, tokens, text, seconds: {vision, prefill, decode}} here.")
@click.option("--save-logits", metavar="FILE.npy", help="Write the [new tokens, vocab] f32 logits of each step.")
@click.option("--temperature", type=float, metavar="T",
              help="0: greedy; > 0: sampled (default: generation_config.json's; docs/text.md, Sampling).")
@click.option("--top-p", type=float, metavar="P", help="Nucleus sampling mass (default: generation_config.json's).")
@click.option("--top-k", type=int, metavar="K", help="Sample among the K likeliest, 0 for all (default: "
                                                      "generation_config.json's, else 50).")
@click.option("--seed", type=int, metavar="N", help="Seed of the sampler (same seed, same answer).")
def generate_command(text, images, videos, prompt, max_new_tokens, json_path, save_logits, temperature, top_p, top_k,
                     seed):
    """Answer one user message (the images in order, the videos, then the prompt), greedily or
    sampled as generation_config.json and the sampling options say, with the checkpoint's
    tokenizer and chat template; the text streams to stdout. The vision tower is let go once
    the images and videos are encoded, before the language model loads (its weights are not
    resident beside the language model's)."""
    from emitter.atomic import write_atomic

    from runtime.generator import Generator
    from runtime.outputs import check_output_paths
    from runtime.inputs.tokenizer import check_utf8

    def say(message: str) -> None:
        click.echo(message, err=True)

    def stream(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    with command_errors():
        if max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens {max_new_tokens}: expected 1 or more")
        check_utf8(prompt, "--prompt")
        text = text.resolved()
        check_output_paths({"--json": json_path, "--save-logits": save_logits}, text.model, [*images, *videos])
        for path in images:
            try:
                with open(path, "rb"):
                    pass
            except OSError as e:
                raise ValueError(f"--image {path}: cannot read ({e.strerror or e}); expected an image file") from None
        # keep_vision False: one answer, the tower goes once the media are encoded
        generator = Generator(text.model, text.buckets or DEFAULT_PROMPT_BUCKETS, text.context, target=text.target,
                              cache_dir=text.cache_dir, precision=text.precision, threads=text.threads, progress=say,
                              kv_cache_dtype=text.kv_cache_dtype, keep_vision=False)
        sampling = sampling_options(generator.sampling, temperature, top_p, top_k, seed)
        result = generator.generate(prompt, list(images), max_new_tokens, on_text=stream, videos=list(videos),
                                    sampling=sampling)
        stream("\n")
        if save_logits:
            write_atomic(save_logits, _npy_bytes(result.logits))
        if json_path:
            write_atomic(json_path, json.dumps(result.to_json(), indent=1) + "\n")
