"""`qwen3vl oracle` on a random tiny checkpoint: the diagnostics graph against the numpy
reference stage by stage, same-input verdicts, the negative controls on the compiled path,
precision-aware tolerances, the report, bad input (the report's location: a folder, a
device, a read-only and a full filesystem; a failed compile)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner

from emitter.config import PRESETS
from helpers import write_images
from emitter.vision import default_inspect_blocks
from runtime.oracle.run import (CONTROL_KINDS, DEFAULT_TOLERANCES, REPORT_SCHEMA_VERSION, check_report, compare,
                            format_table, oracle_stage_names, run_oracle)
from runtime.commands.oracle import oracle_command
from runtime.checkpoints.synthetic import DEFAULT_PROCESSOR, write_checkpoint

TINY = PRESETS["tiny"]
SMALL_POLICY = dict(DEFAULT_PROCESSOR, size={"shortest_edge": 4096, "longest_edge": 32768})
BUCKET = "64"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny checkpoint, two images (4x6 and 6x4 patches: 48 in all) and one shared cache."""
    root = tmp_path_factory.mktemp("oracle")
    model = root / "model"
    write_checkpoint(model, TINY, seed=2, processor_policy_dict=SMALL_POLICY)
    images = write_images(root, [(96, 64), (60, 100)], stem="image")
    return {"model": str(model), "images": images, "cache": str(root / "cache"), "root": root}


def invoke(setup, *args, bucket=BUCKET):
    argv = ["--model", setup["model"], *setup["images"], "--cache-dir", setup["cache"], "--bucket", bucket, *args]
    return CliRunner().invoke(oracle_command, argv, catch_exceptions=False)


def oracle(setup, **kwargs):
    kwargs.setdefault("buckets", (int(BUCKET),))
    return run_oracle(setup["model"], setup["images"], cache_dir=setup["cache"], **kwargs)


def table_stages(output: str) -> list[str]:
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("stage ")) + 2
    stop = lines.index("", start)
    return [line.split()[0] for line in lines[start:stop]]


# --------------------------------------------------------------------------- compare

def test_compare_metrics():
    e = np.array([[1.0, -2.0], [0.0, 4.0]], np.float32)
    same = compare(e, e, 0.0, 0.0, 0.0)
    assert same["pass"] and same["max_abs"] == 0 and same["rel_l2"] == 0 and same["violations"] == 0
    a = e + np.array([[0.0, 0.0], [1e-3, 0.0]], np.float32)
    r = compare(a, e, atol=1e-4, rtol=0.0, max_rel_l2=1.0)
    assert r["violations"] == 1 and not r["pass"] and r["max_abs"] == pytest.approx(1e-3)
    assert compare(a, e, atol=2e-3, rtol=0.0, max_rel_l2=1.0)["pass"]
    assert not compare(a, e, atol=2e-3, rtol=0.0, max_rel_l2=1e-6)["pass"], "relative L2 is part of the rule"
    nan = e.copy()
    nan[0, 0] = np.nan
    r = compare(nan, e, 1.0, 1.0, 1.0)
    assert r["nonfinite"] == 1 and not r["pass"]
    missing = compare(None, e, 1.0, 1.0, 1.0)
    assert missing["missing"] and not missing["pass"] and missing["elements"] == 4
    assert not compare(e[:1], e, 1.0, 1.0, 1.0)["pass"], "a shape mismatch fails"
    zero = compare(np.ones(3), np.zeros(3), 0.0, 0.0, 1.0)
    assert zero["rel_l2"] is None and not zero["pass"], "infinite relative L2 is written as null"


# --------------------------------------------------------------------------- passing run

def test_oracle_passes_with_table_in_graph_order_and_a_valid_report(setup, tmp_path):
    path = tmp_path / "report.json"
    result = invoke(setup, "--report", str(path))
    assert result.exit_code == 0, result.output
    inspect = default_inspect_blocks(TINY)
    expected = oracle_stage_names(TINY, inspect)
    assert table_stages(result.stdout) == expected
    assert expected[:4] == ["patch_embed", "pos_embed", "embed", "blocks.0.input"]
    assert expected[-4:] == ["merger.norm", "merger.fc1", "merger.act", "merger"]
    assert "first failure  none" in result.stdout and "result     PASS" in result.stdout

    report = json.loads(path.read_text())
    check_report(report)
    assert report["schema_version"] == REPORT_SCHEMA_VERSION
    assert report["pass"] is True and report["first_failure"] is None
    assert [c["stage"] for c in report["comparisons"]] == expected
    assert report["grids"] == [[1, 4, 6], [1, 6, 4]]
    assert [i["path"] for i in report["images"]] == setup["images"]
    assert report["calls"] == [{"bucket": 64, "images": [0, 1], "patches": 48}]
    assert report["device"]["target"] == "llvm-cpu" and report["device"]["driver"] == "local-task"
    assert report["device"]["cpu"]
    assert report["inspect_blocks"] == list(inspect)
    assert {"atol", "rtol", "max_rel_l2", "rule"} <= set(report["tolerances"])
    assert report["model"]["config"]["depth"] == TINY.depth
    by_stage = {c["stage"]: c for c in report["comparisons"]}
    assert by_stage["merger"]["source"] == "image_embeds" and by_stage["merger"]["elements"] == 12 * 48
    assert by_stage["blocks.0.norm1"]["elements"] == 48 * TINY.hidden_size
    # Same-input: inspected blocks, mergers and the sum always; their rows say so.
    for name in ("embed", "blocks.0.attn", "blocks.0", f"blocks.{TINY.depth - 1}.mlp", "merger.fc1",
                 "deepstack_merger_list.1"):
        assert by_stage[name]["same_input"] is not None and by_stage[name]["same_input"]["pass"], name
    assert by_stage["patch_embed"]["same_input"] is None
    assert report["precision"] == "f32" and report["tolerances"]["defaults"] == DEFAULT_TOLERANCES["f32"]
    controls = {c["kind"]: c for c in report["controls"]}
    assert set(controls) == set(CONTROL_KINDS) and report["controls_pass"] is True
    assert all(c["ran_on"] == "compiled" and c["detected"] is True for c in controls.values())
    # Zeroed: the compiled graph ran again; the branch's own diagnostics stages fail, and
    # nothing else does (a perturbed output could not fail its norm/fc1/act stages).
    zeroed = controls["zeroed_branch"]
    assert zeroed["artifact"] == report["artifact"] and len(report["artifact"]) == 64, "the same compiled graph"
    assert zeroed["first_failing_stage"] == "deepstack_merger_list.0.norm"
    assert zeroed["failing_stages"] == [f"deepstack_merger_list.0{s}" for s in (".norm", ".fc1", ".act", "")]
    dropped = controls["dropped_branch"]
    assert dropped["first_failing_stage"] == "deepstack_merger_list.1"
    assert dropped["refused_by"] == "runtime.inputs.prefill.build_prefill_payload"
    assert dropped["error"].startswith("deepstack_features[1]: missing")
    assert "control    zeroed_branch:" in result.stdout and "NOT DETECTED" not in result.stdout
    assert all(c["rel_l2"] < 1e-5 for c in report["comparisons"])


def test_images_over_several_calls_are_concatenated(setup):
    report = oracle(setup, buckets=(32,), reference_dtype="f32")
    assert [c["images"] for c in report["calls"]] == [[0], [1]]
    assert report["pass"], format_table(report)
    by_stage = {c["stage"]: c for c in report["comparisons"]}
    assert by_stage["blocks.1"]["shape"] == [48, TINY.hidden_size]
    assert by_stage["merger"]["shape"] == [12, TINY.out_hidden_size]


def test_stage_filter_inspects_the_blocks_it_names(setup):
    report = oracle(setup, stages=["merger", "blocks.1.attn", "embed"])
    assert [c["stage"] for c in report["comparisons"]] == ["embed", "blocks.1.attn", "merger"]
    assert 1 in report["inspect_blocks"] and report["pass"]
    assert report["comparisons"][1]["same_input"]["input"] == "blocks.0"
    assert all(c["detected"] for c in report["controls"]), "controls run whatever the filter"


# --------------------------------------------------------------------------- failing runs

def test_a_failing_stage_is_named_exits_1_and_the_report_is_still_written(setup, tmp_path):
    path = tmp_path / "report.json"
    result = invoke(setup, "--report", str(path), "--atol", "0", "--rtol", "0", "--max-rel-l2", "0")
    assert result.exit_code == 1, result.output
    report = json.loads(path.read_text())
    check_report(report)
    first = next(c for c in report["comparisons"] if not c["pass"])
    assert report["pass"] is False and report["first_failure"]["stage"] == first["stage"]
    assert f"first failure  {first['stage']}:" in result.stdout
    assert "result     FAIL" in result.stdout
    assert all(c["detected"] for c in report["controls"])


def test_reference_drift_upstream_is_told_apart_from_local_error(setup, monkeypatch):
    """A different position table in the reference: pos_embed is wrong (local); the blocks
    are right on the graph's own input, so their failures are inherited."""
    import runtime.oracle.reference as reference

    class Skewed(reference.Reference):
        def __init__(self, cfg, weights, dtype):
            weights = dict(weights)
            weights["model.visual.pos_embed.weight"] = weights["model.visual.pos_embed.weight"] * 1.01
            super().__init__(cfg, weights, dtype)

    monkeypatch.setattr(reference, "Reference", Skewed)
    report = oracle(setup)
    check_report(report)
    by_stage = {c["stage"]: c for c in report["comparisons"]}
    assert report["first_failure"]["stage"] == "pos_embed" and report["first_failure"]["verdict"] == "local"
    assert by_stage["patch_embed"]["pass"]
    for name in ("embed", "blocks.0.norm1", "blocks.0.attn", "blocks.0.mlp", "blocks.0", "blocks.1", "merger"):
        assert by_stage[name]["verdict"] == "inherited", name
    assert by_stage["blocks.1"]["same_input"] is not None, "a failing block is recomputed even if not inspected"
    assert "pos_embed" in report["same_input"]["local_failures"]
    assert "right on its own input" not in format_table(report).split("first failure")[1]


def test_an_undetected_control_fails_the_run(setup, tmp_path):
    path = tmp_path / "report.json"
    result = invoke(setup, "--report", str(path), "--atol", "1e9", "--rtol", "1e9", "--max-rel-l2", "1e9")
    assert result.exit_code == 1, result.output
    report = json.loads(path.read_text())
    controls = {c["kind"]: c for c in report["controls"]}
    assert controls["zeroed_branch"]["detected"] is False, "zeroes are within these tolerances"
    assert controls["zeroed_branch"]["first_failing_stage"] is None
    assert controls["dropped_branch"]["detected"] is True, "the payload refuses a missing branch at any tolerance"
    assert report["first_failure"] is None and report["pass"] is False
    assert "NOT DETECTED" in result.stdout


# --------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("args, needle", [
    (["--stage", "blocks.1.nope"], "--stage blocks.1.nope: unknown stage; expected patch_embed"),
    (["--stage", "blocks.99"], "N in 0..3"),
    (["--inspect-block", "99"], "--inspect-block 99: expected a block index in [0, 4)"),
    (["--atol", "-1"], "--atol -1.0: expected a finite, non-negative number"),
    (["--rtol", "-0.5"], "--rtol -0.5"),
    (["--atol", "nan"], "--atol nan"),
    (["--bucket", "30"], "--bucket 30"),
])
def test_bad_input_is_one_line_exit_2(setup, args, needle):
    result = invoke(setup, *args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], result.stderr
    assert result.stdout == ""


def test_missing_model_folder_and_image_are_one_line_errors(setup, tmp_path):
    runner = CliRunner()
    for argv, needle in [
        (["--model", str(tmp_path / "nope"), *setup["images"]], "not a readable folder"),
        (["--model", str(tmp_path), *setup["images"]], "config.json"),
        (["--model", setup["model"], str(tmp_path / "missing.png")], "missing.png: no such image file"),
        (["--model", setup["model"]], "give at least one image"),
        (["--model", setup["model"], *setup["images"], "--report", str(tmp_path / "no" / "r.json")],
         "does not exist"),
    ]:
        result = runner.invoke(oracle_command, argv, catch_exceptions=False)
        assert result.exit_code == 2, (argv, result.output)
        lines = result.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], result.stderr


# --------------------------------------------------------------------------- precision

def test_tolerances_follow_the_precision_and_options_override_them():
    from runtime.oracle.compare import tolerances
    assert tolerances("f32") == DEFAULT_TOLERANCES["f32"]
    assert tolerances("bf16") == DEFAULT_TOLERANCES["bf16"]
    assert all(DEFAULT_TOLERANCES["bf16"][k] > DEFAULT_TOLERANCES["f32"][k] for k in DEFAULT_TOLERANCES["f32"])
    mixed = tolerances("bf16", atol=0.5)
    assert mixed["atol"] == 0.5 and mixed["rtol"] == DEFAULT_TOLERANCES["bf16"]["rtol"]
    with pytest.raises(ValueError, match="--precision f16"):
        tolerances("f16")


def test_an_honest_bf16_graph_passes_its_own_defaults_and_fails_the_f32_ones(setup, tmp_path):
    result = invoke(setup, "--precision", "bf16", "--report", str(tmp_path / "r.json"))
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "r.json").read_text())
    check_report(report)
    assert report["precision"] == "bf16" and report["pass"], format_table(report)
    assert report["tolerances"]["max_rel_l2"] == DEFAULT_TOLERANCES["bf16"]["max_rel_l2"]
    assert all(c["detected"] for c in report["controls"])
    strict = oracle(setup, precision="bf16", **DEFAULT_TOLERANCES["f32"])
    assert not strict["pass"], "bf16 rounding is far outside the f32 bounds"


# --------------------------------------------------------------------------- the report's location

@pytest.mark.parametrize("where, needle", [
    ("folder", "is a folder; expected a file name"),
    ("/dev/full", "not a regular file"),
])
def test_report_to_a_folder_or_a_device_is_refused_before_the_work(setup, tmp_path, where, needle):
    path = str(tmp_path) if where == "folder" else where
    result = invoke(setup, "--report", path)
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --report {path}: ") and needle in lines[0]
    assert result.stdout == "", "refused before the work"
    assert os.path.exists("/dev/full") and not os.path.isfile("/dev/full"), "the device is never replaced"


def test_report_over_an_input_is_refused_before_the_work(setup):
    for path, needle in [(setup["images"][1], "is the input image"),
                         (f"{setup['model']}/config.json", "would write into the checkpoint folder"),
                         (f"{setup['model']}/report.safetensors", "would write into the checkpoint folder")]:
        before = open(setup["images"][1], "rb").read()
        result = invoke(setup, "--report", path)
        assert result.exit_code == 2 and result.stdout == "", result.output
        lines = result.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: --report {path}: ") and needle in lines[0]
        assert open(setup["images"][1], "rb").read() == before


def _namespace_available() -> bool:
    try:
        return subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode == 0
    except OSError:
        return False


def oracle_on_a_small_filesystem(setup, folder, mount: str, fill: int = 0):
    """Run `qwen3vl oracle --report <folder>/r.json` in a private mount namespace where
    `folder` is a fresh tmpfs mounted with `mount` options, after `fill` bytes are written
    to it; afterwards, list what the folder holds."""
    report = folder / "r.json"
    argv = [sys.executable, "-c", "from runtime.commands.main import main; main()", "oracle", "--model", setup["model"],
            *setup["images"], "--cache-dir", setup["cache"], "--bucket", BUCKET, "--report", str(report)]
    script = (f"mount -t tmpfs -o {mount} none {folder} || exit 99; "
              + (f"head -c {fill} /dev/zero > {folder}/fill; " if fill else "")
              + '"$@"; rc=$?; echo "LISTING:$(ls -A ' + str(folder) + ' | tr "\\n" " ")" >&2; exit $rc')
    folder.mkdir()
    done = subprocess.run(["unshare", "-rm", "sh", "-c", script, "sh", *argv], capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.dirname(__file__)))
    assert done.returncode != 99, f"could not mount a tmpfs: {done.stderr}"
    errors = [line for line in done.stderr.splitlines() if not line.startswith("LISTING:")]
    listing = next(line for line in done.stderr.splitlines() if line.startswith("LISTING:"))[len("LISTING:"):]
    return done, errors, listing.split()


needs_namespace = pytest.mark.skipif(not _namespace_available(),
                                     reason="needs unprivileged user and mount namespaces (unshare -rm)")


@needs_namespace
def test_report_on_a_read_only_filesystem_is_refused_before_the_work(setup, tmp_path):
    done, errors, listing = oracle_on_a_small_filesystem(setup, tmp_path / "ro", "ro,size=64k")
    assert done.returncode == 2, done.stderr
    assert len(errors) == 1 and errors[0].startswith("error: --report ") and "Read-only file system" in errors[0]
    assert done.stdout == "" and listing == []


@needs_namespace
def test_report_on_a_full_filesystem_is_refused_before_the_work(setup, tmp_path):
    done, errors, listing = oracle_on_a_small_filesystem(setup, tmp_path / "full", "size=8k", fill=8192)
    assert done.returncode == 2, done.stderr
    assert len(errors) == 1 and "No space left on device" in errors[0], errors
    assert done.stdout == "" and listing == ["fill"]


@needs_namespace
def test_a_report_that_does_not_fit_is_one_line_and_leaves_nothing(setup, tmp_path):
    """The probe fits, the report does not: the run's table is printed, then one line."""
    done, errors, listing = oracle_on_a_small_filesystem(setup, tmp_path / "small", "size=4k")
    assert done.returncode == 2, done.stderr
    assert len(errors) == 1 and errors[0].startswith("error: --report ") and "No space left" in errors[0], errors
    assert "result     PASS" in done.stdout
    assert listing == [], "no report and no temp file is left behind"


# --------------------------------------------------------------------------- a failed compile

def test_a_compile_failure_is_one_line(setup, tmp_path, monkeypatch):
    """The emitter writes an op iree-compile does not know: a real compile failure."""
    import emitter.layers as layers
    monkeypatch.setattr(layers, "gelu_erf", lambda b, x: b._unary("stablehlo.no_such_op", x, "bogus"))
    argv = ["--model", setup["model"], *setup["images"], "--cache-dir", str(tmp_path / "cache"),
            "--bucket", BUCKET, "--report", str(tmp_path / "r.json")]
    result = CliRunner().invoke(oracle_command, argv, catch_exceptions=False)
    assert result.exit_code == 1, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and errors[0].startswith("error: iree-compile failed for target llvm-cpu")
    assert "no_such_op" in errors[0], errors
    assert result.stderr.splitlines()[-1] == errors[0] and "Traceback" not in result.output
    assert not (tmp_path / "r.json").exists() and result.stdout == ""
