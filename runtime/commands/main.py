"""`qwen3vl`: the command-line entry point (presets, build, run, export, random-checkpoint here; generate,
serve, embed, oracle and bench in their own modules)."""

from __future__ import annotations

import signal

import click

from emitter.cli import precision_option
from emitter.precision import VISION_CHOICES
from emitter.errors import command_errors
from runtime.commands.options import (CONTEXT, cache_dir_option, mmproj_option, model_option, packed_buckets_option,
                                      patch_buckets_option, target_option, threads_option, weights_option,
                                      with_mmproj)


def say(message: str) -> None:
    click.echo(message, err=True)


def terminated(signum, frame) -> None:
    """SIGTERM unwinds like Ctrl-C: a running iree-compile is killed, temp files removed."""
    click.echo("error: terminated (SIGTERM)", err=True)
    raise SystemExit(128 + signum)


class OneLineErrors(click.Group):
    """The `qwen3vl` group: every subcommand's failures, Ctrl-C included, are one `error:`
    line with the exit status of `emitter.errors` (not click's "Aborted!")."""

    def invoke(self, ctx):
        with command_errors():
            return super().invoke(ctx)


@click.group(cls=OneLineErrors, context_settings=CONTEXT)
def main():
    """Compile and run Qwen3-VL (the vision tower and the language model) with IREE."""
    signal.signal(signal.SIGTERM, terminated)


@main.command()
def presets():
    """List the named configs."""
    from emitter.config import PRESETS
    click.echo(f"{'name':<20} {'depth':>5} {'hidden':>6} {'out_hidden':>10}  deepstack")
    for name, cfg in PRESETS.items():
        ds = ",".join(str(i) for i in cfg.deepstack_visual_indexes)
        click.echo(f"{name:<20} {cfg.depth:>5} {cfg.hidden_size:>6} {cfg.out_hidden_size:>10}  {ds}")


@main.command(context_settings=CONTEXT)
@click.option("--model", metavar="DIR", help="Checkpoint folder (config.json, preprocessor_config.json).")
@click.option("--preset", "preset_name", metavar="NAME", help="A named config (see `qwen3vl presets`).")
@patch_buckets_option
@target_option
@cache_dir_option
@click.option("--diagnostics", is_flag=True, help="Build the diagnostics variant (named intermediate stages).")
@click.option("--inspect-block", "inspect_blocks", type=int, multiple=True, metavar="N",
              help="With --diagnostics: a block whose inner stages to return (repeatable).")
@precision_option(VISION_CHOICES)
@weights_option
@click.option("--explain", is_flag=True,
              help="Print the artifact's identity, cache state and hashed fields; compile nothing.")
def build(model, preset_name, buckets, target, cache_dir, diagnostics, inspect_blocks, precision, weights, explain):
    """Compile the artifact module (one entry per asked bucket) into the cache, and with --model
    write its weight archive there too (hits redo nothing)."""
    from runtime.artifact.build import build_artifact, explain_plan, make_plan
    from runtime.artifact.cache import ArtifactCache

    if not model and not preset_name:
        raise ValueError("--model DIR or --preset NAME: give one")
    plan = make_plan(model, preset_name, buckets, target, diagnostics, inspect_blocks, precision, weights)
    cache = ArtifactCache(cache_dir)
    if explain:
        click.echo(explain_plan(plan, cache), nl=False)
        return
    cache.ensure_root()
    r = build_artifact(plan, cache, progress=say)
    click.echo(f"buckets {','.join(map(str, r.buckets))}  {r.identity[:12]}  {'built' if r.built else 'hit':<5} "
               f"{r.seconds:7.2f} s  {r.path}")
    if model and plan.weights == "parameters":  # the weight archive the module reads
        from runtime.artifact.archive import cached_archive
        click.echo(f"weights  {cached_archive(model, plan.cfg, plan.precision, cache, progress=say)}")


@main.command(context_settings=CONTEXT)
@model_option
@mmproj_option
@click.argument("images", nargs=-1, metavar="[IMAGE]...")
@click.option("--video", "videos", multiple=True, metavar="FILE",
              help="A video file (repeatable), sampled as video_preprocessor_config.json says (docs/inputs.md).")
@click.option("-o", "--output", metavar="FILE",
              help="Write image_embeds, deepstack_features and grid_thw here (safetensors; videos': docs/inputs.md).")
@packed_buckets_option
@target_option
@cache_dir_option
@threads_option()
@precision_option(VISION_CHOICES)
@weights_option
@click.option("--dump-inputs", metavar="DIR",
              help="Write each call's inputs as DIR/<NN>/<name>.npy with DIR/<NN>/call.json (see `qwen3vl export`).")
def run(model, mmproj, images, videos, output, buckets, target, cache_dir, threads, precision, weights, dump_inputs):
    """Encode images and videos: merged embeddings and the DeepStack features, images in
    order, then videos in order."""
    from runtime.jobs.run import run_images

    click.echo(run_images(with_mmproj(model, mmproj, cache_dir), images, output, cache_dir, buckets or None, target,
                          threads, progress=say, precision=precision, weights=weights, dump_inputs=dump_inputs,
                          videos=videos))


@main.command(context_settings=CONTEXT)
@click.option("--model", required=True, metavar="DIR", help="Checkpoint folder (HF or MLX layout).")
@click.option("-o", "--output", required=True, metavar="OUT", help="Folder to write (created if missing).")
@patch_buckets_option
@precision_option(VISION_CHOICES)
@target_option
@click.option("--name", metavar="NAME", help="File stem of the vmfb and irpa (default: the model folder's name).")
@click.option("--diagnostics", is_flag=True,
              help="Entries encode_<B>_diagnostics: the outputs, then the named intermediate stages.")
@cache_dir_option
def export(model, output, buckets, precision, target, name, diagnostics, cache_dir):
    """Write OUT/NAME.vmfb (one entry per bucket), OUT/NAME.irpa (the weights), OUT/abi.json and
    OUT/README.txt: a folder IREE's own iree-run-module runs."""
    from runtime.artifact.export import export as export_folder

    click.echo(export_folder(model, output, buckets, precision, target, cache_dir, name, diagnostics,
                             progress=say))


@main.command("random-checkpoint", context_settings=CONTEXT)
@click.argument("folder", metavar="DIR")
@click.option("--preset", "preset_name", default="tiny", show_default=True, metavar="NAME")
@click.option("--layout", type=click.Choice(["hf", "mlx"]), default="hf", show_default=True)
@click.option("--dtype", type=click.Choice(["f32", "bf16", "f16"]), default="f32", show_default=True)
@click.option("--bits", type=click.Choice(["4", "8"]), default=None, help="MLX affine quantization.")
@click.option("--group-size", type=click.Choice(["32", "64", "128"]), default="64", show_default=True,
              help="Weights per MLX scale and bias (with --bits).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--with-text", is_flag=True,
              help="Also a random language model, BPE tokenizer and chat template (for generate; docs/text.md).")
@click.option("--layers", type=click.IntRange(min=1), default=None, metavar="N",
              help="With --with-text: the language model's first N layers only (a smaller stand-in at the "
                   "preset's widths, e.g. for benchmarks).")
def random_checkpoint(folder, preset_name, layout, dtype, bits, group_size, seed, with_text, layers):
    """Write a deterministic random-weight checkpoint folder (for demos and tests).

    DIR must be new or empty; the folder is written whole or not at all."""
    from emitter.config import preset
    from runtime.checkpoints.synthetic import write_checkpoint

    cfg = preset(preset_name)
    if with_text:
        click.echo(with_text_checkpoint(folder, preset_name, layout, dtype, bits, seed, int(group_size), layers))
        return
    if layers:
        raise click.UsageError("--layers: only with --with-text (the language model's layers)")
    write_checkpoint(folder, cfg, seed=seed, layout=layout, dtype=dtype, bits=int(bits) if bits else None,
                     group_size=int(group_size))
    click.echo(f"wrote {folder} ({preset_name}, {layout}, {dtype}{', ' + bits + '-bit' if bits else ''})")


def with_text_checkpoint(folder, preset_name: str, layout: str, dtype: str, bits, seed: int, group_size: int,
                         layers: int | None = None) -> str:
    """`random-checkpoint --with-text`: the vision and text presets of one name (the text
    model's first `layers` only, where given), in the Hugging Face layout in f32
    (`synthetic_text`), or in mlx-vlm's (`synthetic_mlx`: any dtype, quantized with `bits`);
    a line saying what."""
    from dataclasses import replace

    from emitter.config import ConfigError, preset
    from emitter.text_config import TEXT_PRESETS

    if layout == "hf" and (dtype != "f32" or bits):
        raise ValueError("--with-text: writes the Hugging Face layout in f32 only (no --dtype, --bits; "
                         "--layout mlx takes them)")
    if preset_name not in TEXT_PRESETS:
        raise ConfigError(f"--preset {preset_name!r}: no language-model preset; expected one of "
                          f"{', '.join(TEXT_PRESETS)}")
    text = TEXT_PRESETS[preset_name]
    if layers:
        if layers > text.num_hidden_layers:
            raise ConfigError(f"--layers {layers}: more than the preset's {text.num_hidden_layers}")
        text = replace(text, num_hidden_layers=layers,
                       mlp_only_layers=tuple(n for n in text.mlp_only_layers if n < layers))
    what = f", the first {layers} of its {TEXT_PRESETS[preset_name].num_hidden_layers} layers" if layers else ""
    if layout == "mlx":
        from runtime.checkpoints.synthetic_mlx import write_mlx_generation_checkpoint
        write_mlx_generation_checkpoint(folder, preset(preset_name), text, int(bits) if bits else None, group_size,
                                        dtype, seed)
        quantized = f", {bits}-bit groups of {group_size}" if bits else ""
        return (f"wrote {folder} ({preset_name}, mlx, {dtype}{quantized}, with a language model{what}, tokenizer "
                "and chat template)")
    from runtime.checkpoints.synthetic_text import write_generation_checkpoint
    write_generation_checkpoint(folder, preset(preset_name), text, seed=seed)
    return f"wrote {folder} ({preset_name}, hf, f32, with a language model{what}, tokenizer and chat template)"


from runtime.commands.oracle import oracle_command  # noqa: E402
from runtime.commands.generate import generate_command  # noqa: E402
from runtime.commands.embed import embed_command  # noqa: E402
from runtime.commands.serve import serve_command  # noqa: E402
from runtime.commands.bench import bench_command  # noqa: E402

main.add_command(oracle_command)
main.add_command(generate_command)
main.add_command(embed_command)
main.add_command(serve_command)
main.add_command(bench_command)


