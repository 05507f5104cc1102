"""`qwen3vl bench`: the command over runtime/bench/vision.py."""

from __future__ import annotations

from pathlib import Path

import click

from emitter.errors import command_errors

from runtime.bench.vision import PRECISIONS, BenchOptions
from runtime.bench.roof import DEFAULT_SIZES

DEFAULTS = BenchOptions()


@click.command("bench", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--preset", default=DEFAULTS.preset, show_default=True, help="A preset, with random weights.")
@click.option("--model", metavar="DIR", help="A checkpoint folder instead of a preset.")
@click.option("--bucket", type=int, default=DEFAULTS.bucket, show_default=True, help="Patches per call.")
@click.option("--images", default=DEFAULTS.images, show_default=True, help="Comma-separated WxH sizes (random RGB).")
@click.option("--repeats", type=int, default=DEFAULTS.repeats, show_default=True, help="Timed rounds.")
@click.option("--warmup", type=int, default=DEFAULTS.warmup, show_default=True, help="Untimed rounds first.")
@click.option("--threads", type=int, default=DEFAULTS.threads, show_default=True, help="Threads for every side.")
@click.option("--precision", type=click.Choice(list(PRECISIONS)), default=DEFAULTS.precision, show_default=True,
              help="f32, bf16 (in the CPU's form, as the commands build it), or both in one run.")
@click.option("--weights", type=click.Choice(["parameters", "arguments"]), default=DEFAULTS.weights,
              show_default=True, help="Weight binding (the runtime's default: parameters).")
@click.option("--flag", "flags", multiple=True, metavar="FLAG", help="Extra iree-compile flag (a lever to try).")
@click.option("--no-torch", is_flag=True, help="Do not run transformers (our side and the roof).")
@click.option("--roof-sizes", default=",".join(map(str, DEFAULT_SIZES)), show_default=True,
              help="Square matmul sizes for the roof.")
@click.option("--end-to-end", is_flag=True,
              help="Also time a VisionSession's encode() on image files (writes a random checkpoint for a preset).")
@click.option("--cache-dir", metavar="DIR", help="Artifact cache for --end-to-end (default: a temporary folder).")
@click.option("--seed", type=int, default=DEFAULTS.seed, show_default=True, help="Seed of the run order.")
@click.option("--json", "json_path", metavar="FILE", help="Write the figures here.")
@click.option("--chart", "chart_path", metavar="FILE.svg",
              help="Write the ratios against transformers as an SVG bar chart (default with --json: beside it, .svg).")
def bench_command(json_path, chart_path, **options):
    """Time the compiled tower against transformers' (f32 against f32, bf16 against bf16) and
    the machine's matmul roof, in one process.

    torch and transformers are optional: without them it times our side against the roof.
    """
    from runtime.bench.vision import report, run
    with command_errors():
        figures = run(BenchOptions(json=json_path, **options))
        click.echo(report(figures))
        chart_path = chart_path or (str(Path(json_path).with_suffix(".svg")) if json_path else None)
        if chart_path:
            click.echo(write_ratio_chart(figures, chart_path))


def write_ratio_chart(f: dict, path: str) -> str:
    """The chart of the run's ratios (transformers' time over ours, with the rounds' range),
    or why there is none."""
    from runtime.bench.chart import Bar, write_chart

    bars = [Bar(f"{p}: transformers / ours", f[f"ratio{tag}"], f[f"ratio{tag}_min"], f[f"ratio{tag}_max"])
            for p, tag in (("f32", ""), ("bf16", "_bf16")) if f.get(f"ratio{tag}") is not None]
    if not bars:
        return f"chart: not written (no ratio: transformers did not run: {f['torch']})"
    note = (f"{f['model'] or f['preset']}, bucket {f['bucket']}, images {f['images']}, {f['threads']} threads, "
            f"load {f['loadavg'][0]:.2f}; median of {f['repeats']} rounds, whiskers: the rounds' range")
    write_chart(path, bars, "The vision tower: ours faster than transformers by", note)
    return f"chart: {path}"
