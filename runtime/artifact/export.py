"""`qwen3vl export`: a folder IREE's own tools can run, no Python of ours needed.

OUT/<name>.vmfb   the artifact module: one entry `encode_<B>` per bucket
OUT/<name>.irpa   the weights exactly as the graph takes them (scope `model`)
OUT/abi.json      every entry's inputs and outputs (name, shape, dtype; "R" for the run-time row
                  count, a whole number of `row_unit`s, "R/4" merged), the archive, the identity
OUT/README.txt    how to run it with `iree-run-module`

The module and the archive come from the cache (compiled or written on a miss), so an
export of a checkpoint already run costs a copy. See docs/artifact.md.
"""

from __future__ import annotations

import json
import re
from fractions import Fraction
from pathlib import Path

from emitter import __version__
from emitter.atomic import folder_atomic, link_atomic, write_atomic
from emitter.config import PARAMETER_SCOPE
from emitter.identity import canonical_json
from emitter.targets import runtime_driver
from emitter.dims import Dim
from emitter.vision import entry_name, row_unit, vision_function

from runtime.artifact.archive import cached_archive, open_archive
from runtime.artifact.build import BuildPlan, build_artifact, make_plan
from runtime.artifact.cache import ArtifactCache
from runtime.outputs import check_output_folder

ABI_FORMAT = 2  # 2: run-time rows ("R" in a shape), `row_unit` per entry
MODULE_NAME = "qwen3vl_vision"
NUMPY_DTYPES = {"f32": "float32", "i32": "int32", "bf16": "bfloat16"}
TEMP = re.compile(r"^\..+\.tmp\.\d+\.")  # a killed writer's temp (emitter.atomic)


def export_name(model_dir) -> str:
    """File stem for the vmfb and the archive: the model folder's name, made filename-safe."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(model_dir).resolve().name).strip("._")
    return name or "qwen3vl_vision"


def _tensors(pairs, unit: int) -> list[dict]:
    """Name, shape and dtype of each (ABI name, tensor type); a run-time dim as "R" (the
    rows, `unit` times the graph's run-time count) or "R/4"."""
    def dim(d):
        if not isinstance(d, Dim):
            return d
        share = Fraction(d.scale, unit)
        return "R" if share == 1 else f"R/{share.denominator}" if share.numerator == 1 else f"{share}R"
    return [{"name": name, "shape": [dim(d) for d in t.shape], "dtype": NUMPY_DTYPES[t.dtype]} for name, t in pairs]


def function_abi(plan: BuildPlan, bucket: int, diagnostics: bool = False) -> dict:
    """One entry's name, bucket (the most patches a call holds), row unit (a call's rows are
    a whole number of them), inputs and outputs, read off the emitted function itself."""
    function, _ = vision_function(plan.cfg, bucket, entry_name(bucket, diagnostics), diagnostics,
                                  plan.inspect_blocks, plan.precision, plan.weights)
    unit = row_unit(plan.cfg, bucket)
    return {"name": function["name"], "bucket": bucket, "row_unit": unit,
            "inputs": _tensors(((abi, value.type) for value, abi in function["arguments"]), unit),
            "outputs": _tensors(((abi, value.type) for abi, value in function["results"]), unit)}


def abi_document(plan: BuildPlan, identity: str, name: str, archive: Path) -> dict:
    functions = [function_abi(plan, b, plan.diagnostics) for b in plan.buckets]
    return {
        "abi_format": ABI_FORMAT,
        "module": {"file": f"{name}.vmfb", "name": MODULE_NAME, "target": plan.target,
                   "device": runtime_driver(plan.target)},
        "functions": functions,
        "parameters": {"scope": PARAMETER_SCOPE, "file": f"{name}.irpa", "content_key": archive.stem},
        "identity": identity,
        "precision": plan.precision.name,
        "vision_config": plan.cfg.to_dict(),
        "processor_policy": plan.policy.to_dict(),
        "video_policy": plan.video_policy.to_dict(),
        "emitter_version": __version__,
    }


def readme_text(abi: dict) -> str:
    first = abi["functions"][0]
    vmfb, irpa, device = abi["module"]["file"], abi["parameters"]["file"], abi["module"]["device"]
    rows = -(-first["bucket"] // first["row_unit"]) * first["row_unit"]  # R of a full call
    zeros = " ".join(f"--input={'x'.join(str(rows if d == 'R' else d) for d in t['shape'])}x"
                     f"{t['dtype'].replace('float', 'f').replace('int', 'i')}=0" for t in first["inputs"])
    dumped = " ".join(f"--input=@DUMP/00/{t['name']}.npy" for t in first["inputs"])
    outputs = " ".join(f"--output=@{t['name']}.npy" for t in first["outputs"])
    entries = "\n".join(f"  {f['name']} (row unit {f['row_unit']}): "
                        + ", ".join(f"{t['name']} {_shape(t)} {t['dtype']}" for t in f["inputs"])
                        + " -> " + ", ".join(f"{t['name']} {_shape(t)}" for t in f["outputs"])
                        for f in abi["functions"])
    return f"""Qwen3-VL vision tower, compiled with IREE (exported by qwen3vl-iree {abi['emitter_version']}).

{vmfb}   one module, one entry per bucket (the most patches a call holds); R, the rows,
           is any whole number of the entry's row unit up to it (padding: each its own segment):
{entries}
{irpa}   the weights, read by every entry from parameter scope `{abi['parameters']['scope']}`
abi.json   every entry's inputs and outputs (name, shape, dtype), in argument order

Run an entry with IREE's own tool (inputs are positional, in the order above):

  iree-run-module --device={device} --module={vmfb} --parameters={abi['parameters']['scope']}={irpa} \\
    --function={first['name']} {zeros}

Real inputs: `qwen3vl run --model MODEL IMAGE... --dump-inputs DUMP` writes each call's
inputs as DUMP/<NN>/<name>.npy and DUMP/<NN>/call.json (the function to call; its
"patches" and "merged" say how many rows are real), then:

  iree-run-module --device={device} --module={vmfb} --parameters={abi['parameters']['scope']}={irpa} \\
    --function={first['name']} {dumped} {outputs}

Outputs are padded like the inputs: keep the first "merged" rows of each.
"""


def _shape(tensor: dict) -> str:
    return "[" + ", ".join(map(str, tensor["shape"])) + "]"


def check_export_folder(out, model) -> Path:
    """OUT before any work: a folder (`check_output_folder`: created if missing, not the
    checkpoint folder) that is new, empty, or an earlier export (its abi.json and
    README.txt, the module and archive abi.json names, and nothing else, so that replacing
    it loses no one's file)."""
    out = check_output_folder(out, model)
    held = {p.name for p in out.iterdir() if not TEMP.match(p.name)} if out.is_dir() else set()
    other = sorted(held - _earlier_export(out))
    if other:
        more = f" and {len(other) - 1} more" if len(other) > 1 else ""
        raise ValueError(f"-o {out}: holds other files ({other[0]}{more}); expected a new or empty folder, "
                         f"or an earlier export to replace")
    return out


def _earlier_export(out: Path) -> set[str]:
    """The file names of the export in `out` by its abi.json (empty when it has none)."""
    try:
        abi = json.loads((out / "abi.json").read_text(encoding="utf-8"))
        return {"abi.json", "README.txt", abi["module"]["file"], abi["parameters"]["file"]}
    except (OSError, ValueError, KeyError, TypeError):
        return set()


def export(model, out, buckets=(), precision: str = "f32", target: str | None = None, cache_dir=None,
           name: str | None = None, diagnostics: bool = False, progress=None) -> str:
    """Write the export folder `out`; return a summary. ValueError for bad input, before any work."""
    if not model or not Path(model).is_dir():
        raise ValueError(f"--model {model}: not a readable folder; expected a checkpoint folder "
                         f"(config.json, preprocessor_config.json, *.safetensors)")
    out = check_export_folder(out, model)
    plan = make_plan(str(model), None, buckets, target, diagnostics, None, precision, "parameters")
    name = name or export_name(model)
    cache = ArtifactCache(cache_dir)
    archive = cached_archive(model, plan.cfg, plan.precision, cache, progress)
    open_archive(archive, plan.cfg, plan.precision)  # holds exactly the graph's weights
    result = build_artifact(plan, cache, progress)
    abi = abi_document(plan, result.identity, name, archive)
    with folder_atomic(out, replace=True) as folder:  # all four or none, an earlier export replaced whole
        link_atomic(archive, folder / f"{name}.irpa")
        link_atomic(result.path, folder / f"{name}.vmfb")
        write_atomic(folder / "abi.json", json.dumps(abi, indent=1) + "\n")
        write_atomic(folder / "README.txt", readme_text(abi))
    assert json.loads(canonical_json(abi)) == abi  # plain JSON only
    sizes = {p: (out / p).stat().st_size for p in (f"{name}.vmfb", f"{name}.irpa")}
    return "\n".join([f"wrote {out}/",
                      *(f"  {p:<40} {s / 2**20:9.1f} MiB" for p, s in sizes.items()),
                      f"  {'abi.json':<40} {len(abi['functions'])} function{'s' * (len(abi['functions']) > 1)}: "
                      + ", ".join(f['name'] for f in abi["functions"]),
                      f"  {'README.txt':<40} iree-run-module command lines"])
