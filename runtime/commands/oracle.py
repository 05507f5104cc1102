"""`qwen3vl oracle`: the command over runtime/oracle/run.py."""

from __future__ import annotations

import click

from emitter.errors import EXIT_FAILED, command_errors, fail

from runtime.commands.options import CONTEXT, cache_dir_option, patch_buckets_option, target_option, threads_option
from runtime.oracle.run import DEFAULT_TOLERANCES, format_table, run_oracle, tolerances
from runtime.oracle.report import check_report_path, write_report


def _defaults(key: str) -> str:
    return "default " + ", ".join(f"{p} {t[key]:g}" for p, t in DEFAULT_TOLERANCES.items())


@click.command("oracle", context_settings=CONTEXT)
@click.option("--model", metavar="DIR", required=True, help="Checkpoint folder (config.json, "
                                                               "preprocessor_config.json, *.safetensors).")
@click.argument("images", nargs=-1, metavar="IMAGE...")
@click.option("--report", "report_path", metavar="FILE", help="Write the JSON report here (also when a stage fails).")
@click.option("--precision", type=click.Choice(list(DEFAULT_TOLERANCES)), default="f32", show_default=True,
              help="The graph's precision (bf16: matmul operands in bf16); it picks the default tolerances.")
@click.option("--atol", type=float, default=None, help=f"Absolute tolerance per element ({_defaults('atol')}).")
@click.option("--rtol", type=float, default=None, help=f"Relative tolerance per element ({_defaults('rtol')}).")
@click.option("--max-rel-l2", type=float, default=None,
              help=f"Largest relative L2 error ||a-e||/||e|| a stage may have ({_defaults('max_rel_l2')}).")
@click.option("--inspect-block", "inspect_blocks", type=int, multiple=True, metavar="N",
              help="A block whose inner stages to compare (repeatable; default the first and the last).")
@click.option("--stage", "stages", multiple=True, metavar="NAME",
              help="Compare only this stage (repeatable), e.g. embed, blocks.3, blocks.0.attn, merger.fc1.")
@click.option("--reference-dtype", type=click.Choice(["f32", "f64"]), default="f64", show_default=True,
              help="Precision of the numpy reference.")
@patch_buckets_option
@target_option
@cache_dir_option
@threads_option()
def oracle_command(model, images, report_path, precision, atol, rtol, max_rel_l2, inspect_blocks, stages,
                   reference_dtype, buckets, target, cache_dir, threads):
    """Compare the compiled diagnostics graph with the numpy reference, stage by stage.

    Prints a table in graph order (embeddings, every block output, the inner stages of
    the inspected blocks, each merger's norm/fc1/act and output), names the first
    failing stage and whether it is wrong on the graph's own input to its block
    (local) or only inherits drift (inherited), and checks that two negative controls
    are detected: the compiled graph run again with DeepStack branch 0's weights
    zeroed, and the prefill payload refusing the outputs with the last branch missing.

    \b
    Pass rule (a = graph, e = reference): a stage passes when its shape
    matches, no element is non-finite, no element has |a-e| > atol + rtol*|e|,
    and ||a-e||/||e|| <= max-rel-l2. Exit 0 when every stage passes and both
    controls are detected, 1 otherwise (the report is written either way) or
    when the graph does not compile, 2 for bad input or an unwritable report.
    """
    def say(message):
        click.echo(message, err=True)

    with command_errors():
        tolerances(precision, atol, rtol, max_rel_l2)
        if report_path:
            check_report_path(report_path, model, images)
        report = run_oracle(model, images, atol=atol, rtol=rtol, max_rel_l2=max_rel_l2,
                            inspect_blocks=inspect_blocks or None, stages=stages, reference_dtype=reference_dtype,
                            cache_dir=cache_dir, buckets=buckets or None, target=target, threads=threads,
                            progress=say, precision=precision)
    click.echo(format_table(report))
    if report_path:
        try:
            write_report(report_path, report)
        except OSError as e:
            fail(f"--report {report_path}: {e.strerror or e}")
        click.echo(f"report     {report_path}")
    if not report["pass"]:
        raise SystemExit(EXIT_FAILED)
