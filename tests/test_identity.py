"""Artifact identity: every field that decides reuse changes it; it is stable across processes."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from emitter import identity as ident
from emitter.config import PRESETS
from emitter.identity import DEFAULT_LADDER, vision_artifact_fields, artifact_identity, explain_identity
from emitter.policy import DEFAULT_POLICY
from emitter.video_policy import DEFAULT_VIDEO_POLICY

TINY = PRESETS["tiny"]


def ident_of(**overrides) -> str:
    kwargs = dict(cfg=TINY, buckets=16, policy=DEFAULT_POLICY, target="llvm-cpu", diagnostics=False)
    kwargs.update(overrides)
    return artifact_identity(vision_artifact_fields(**kwargs))


@pytest.fixture(scope="module")
def base() -> str:
    return ident_of()


def test_deterministic_and_json(base):
    fields = vision_artifact_fields(TINY, 16, DEFAULT_POLICY)
    assert json.loads(json.dumps(fields)) == fields
    assert artifact_identity(fields) == base == ident_of()
    assert len(base) == 64 and int(base, 16) >= 0
    # What the design says the identity covers is all there.
    assert {"format_version", "emitter_version", "vision_config", "buckets", "diagnostics", "inspect_blocks",
            "processor_policy", "weight_schema", "graph_sha256", "target", "compiler"} <= set(fields)
    assert fields["target"]["flags"][0] == "--iree-input-type=stablehlo"
    assert fields["target"]["backend"] == "llvm-cpu"
    assert fields["target"]["host_cpu"]["name"] and "+" in fields["target"]["host_cpu"]["features"]
    assert fields["compiler"]["version"].startswith("3.13")
    assert fields["weight_schema"]["count"] == len(ident.graph_weights(TINY))


def _policy_variants():
    """One changed value per policy field."""
    changed = {
        "min_pixels": 65536 * 2, "max_pixels": 16777216 // 2, "patch_size": 14, "temporal_patch_size": 1,
        "merge_size": 3, "image_mean": (0.5, 0.5, 0.25), "image_std": (0.5, 0.25, 0.5),
        "rescale_factor": 1 / 256, "resample": 2, "do_resize": False, "do_rescale": False,
        "do_normalize": False, "do_convert_rgb": False,
    }
    names = [f.name for f in dataclasses.fields(DEFAULT_POLICY)]
    assert sorted(changed) == sorted(names), "a policy field without a variant here"
    return [(name, changed[name]) for name in names]


@pytest.mark.parametrize("name,value", _policy_variants())
def test_each_policy_field_changes_identity(base, name, value):
    policy = dataclasses.replace(DEFAULT_POLICY, **{name: value})
    assert getattr(policy, name) != getattr(DEFAULT_POLICY, name)
    assert ident_of(policy=policy) != base


def test_bucket_changes_identity(base):
    assert ident_of(buckets=32) != base
    assert ident_of(buckets=(16, 32)) != base and ident_of(buckets=(32, 16)) == ident_of(buckets=(16, 32))


@pytest.mark.parametrize("name,value", [("depth", 3), ("hidden_size", 128), ("intermediate_size", 256),
                                        ("out_hidden_size", 64), ("num_heads", 2),
                                        ("deepstack_visual_indexes", (1, 3)), ("rope_theta", 20000.0),
                                        ("num_position_embeddings", 1024)])
def test_config_field_changes_identity(base, name, value):
    assert ident_of(cfg=dataclasses.replace(TINY, **{name: value})) != base


def test_compiler_flag_changes_identity(base):
    assert ident_of(extra_flags=("--iree-opt-level=O3",)) != base


def test_target_flags_table_change_changes_identity(base, monkeypatch):
    from emitter import targets
    driver, flags = targets.TARGETS["llvm-cpu"]
    patched = dict(targets.TARGETS)
    patched["llvm-cpu"] = (driver, tuple(f for f in flags if f != "--iree-opt-data-tiling"))
    monkeypatch.setattr(targets, "TARGETS", patched)
    monkeypatch.setattr(ident, "TARGETS", patched)
    assert ident_of() != base


def test_target_changes_identity(base):
    gpu = vision_artifact_fields(TINY, 16, DEFAULT_POLICY, target="cuda-sm80")
    assert artifact_identity(gpu) != base
    assert "sm_80" in gpu["target"]["device_target"] and "host_cpu" not in gpu["target"]
    assert ident_of(target="rocm-gfx942") not in (base, artifact_identity(gpu))


def test_diagnostics_and_inspect_blocks_change_identity(base):
    diag = ident_of(diagnostics=True)
    assert diag != base
    # None means the default blocks (first and last); naming them explicitly is the same artifact.
    assert ident_of(diagnostics=True, inspect_blocks=(3, 0, 0)) == diag
    assert ident_of(diagnostics=True, inspect_blocks=(1,)) != diag
    # The plain variant ignores inspected blocks.
    assert ident_of(inspect_blocks=(1,)) == base


def test_compiler_version_changes_identity(base):
    fields = vision_artifact_fields(TINY, 16, DEFAULT_POLICY)
    other = dict(fields["compiler"], version="3.14.0")
    assert ident_of(compiler_version=other) != base
    assert ident_of(compiler_version=fields["compiler"]) == base


def test_weight_schema_change_changes_identity(base, monkeypatch):
    import dataclasses
    real = ident.graph_weights

    def renamed(cfg, precision):
        schema = real(cfg, precision)
        return [dataclasses.replace(schema[0], name=schema[0].name + "_x")] + schema[1:]

    def reshaped(cfg, precision):
        schema = real(cfg, precision)
        return schema[:-1] + [dataclasses.replace(schema[-1], shape=schema[-1].shape + (1,))]

    def retyped(cfg, precision):
        schema = real(cfg, precision)
        return schema[:-1] + [dataclasses.replace(schema[-1], dtype="bf16")]

    for fake in (renamed, reshaped, retyped):
        monkeypatch.setattr(ident, "graph_weights", fake)
        assert ident_of() != base


def test_precision_changes_identity(base):
    assert ident_of(precision="bf16") != base


def test_emitted_graph_change_changes_identity(base, monkeypatch):
    real = ident.emit_artifact_module
    monkeypatch.setattr(ident, "emit_artifact_module", lambda *a, **k: real(*a, **k).replace("1.0e-01", "2.0e-01"))
    assert ident_of() != base


def test_title_does_not_change_identity(base):
    from emitter.vision import emit_vision_module
    assert emit_vision_module(TINY, 16, title="x") != emit_vision_module(TINY, 16)
    # The identity hashes the graph without its title comment: preset and model folder agree.
    assert ident_of() == base


def test_format_and_emitter_version_change_identity(base, monkeypatch):
    monkeypatch.setattr(ident, "FORMAT_VERSION", ident.FORMAT_VERSION + 1)
    assert ident_of() != base
    monkeypatch.undo()
    monkeypatch.setattr(ident, "__version__", "9.9.9")
    assert ident_of() != base


def test_same_identity_in_fresh_process(base):
    code = ("from emitter.identity import vision_artifact_fields, artifact_identity\n"
            "from emitter.config import PRESETS\nfrom emitter.policy import DEFAULT_POLICY\n"
            "print(artifact_identity(vision_artifact_fields(PRESETS['tiny'], 16, DEFAULT_POLICY)))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == base


def test_identity_module_does_not_import_runtime():
    code = "import sys, emitter.identity, emitter.cli; print(any(m.split('.')[0] == 'runtime' for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_explain_identity(tmp_path, base):
    text = explain_identity(TINY, 16)
    assert text.startswith(f"identity {base}\n")
    assert '"buckets": [\n    16\n  ]' in text
    # A model folder's preprocessor config is the policy.
    policy = dataclasses.replace(DEFAULT_POLICY, max_pixels=1024 * 1024)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(policy.to_preprocessor_config()))
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(DEFAULT_VIDEO_POLICY.to_config()))
    text = explain_identity(TINY, 16, model_dir=tmp_path)
    assert text.startswith(f"identity {ident_of(policy=policy)}\n")


def test_emit_cli_explain():
    from click.testing import CliRunner
    from emitter.cli import emit_main
    result = CliRunner().invoke(emit_main, ["--bucket", "16", "--preset", "tiny", "--explain"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"identity {ident_of()}\n")


def test_default_buckets_take_any_row_count():
    """Each default entry's patches are [?, patch_dim]: one compile for every image size."""
    from emitter.vision import emit_artifact_module, entry_name
    text = emit_artifact_module(TINY, DEFAULT_LADDER)
    for bucket in DEFAULT_LADDER:
        signature = text[text.index(f"@{entry_name(bucket)}("):].split("\n", 2)[1]
        assert f"%patches: tensor<?x{TINY.patch_dim}xf32>" in signature, signature


def test_weight_binding_changes_identity(base):
    assert ident_of(weights="parameters") != base
