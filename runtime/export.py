"""`qwen3vl export`: a folder IREE's own tools can run, no Python of ours needed.

OUT/<name>.vmfb   the artifact module: one entry `encode_<B>` per bucket
OUT/<name>.irpa   the weights exactly as the graph takes them (scope `model`)
OUT/abi.json      every entry's inputs and outputs (name, shape, dtype), the archive, the identity
OUT/README.txt    how to run it with `iree-run-module`

The module and the archive come from the cache (compiled or written on a miss), so an
export of a checkpoint already run costs a copy. See docs/artifact.md.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

from emitter import __version__
from emitter.atomic import write_atomic
from emitter.config import PARAMETER_SCOPE
from emitter.identity import canonical_json
from emitter.targets import runtime_driver
from emitter.vision import entry_name, vision_function

from .archive import cached_archive, open_archive
from .build import BuildPlan, build_artifact, make_plan
from .cache import ArtifactCache

ABI_FORMAT = 1
MODULE_NAME = "qwen3vl_vision"
NUMPY_DTYPES = {"f32": "float32", "i32": "int32", "bf16": "bfloat16"}


def export_name(model_dir) -> str:
    """File stem for the vmfb and the archive: the model folder's name, made filename-safe."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(model_dir).resolve().name).strip("._")
    return name or "qwen3vl_vision"


def _tensors(pairs) -> list[dict]:
    return [{"name": name, "shape": list(t.shape), "dtype": NUMPY_DTYPES[t.dtype]} for name, t in pairs]


def function_abi(plan: BuildPlan, bucket: int, diagnostics: bool = False) -> dict:
    """One entry's name, bucket, inputs and outputs, read off the emitted function itself."""
    function, _ = vision_function(plan.cfg, bucket, entry_name(bucket, diagnostics), diagnostics,
                                  plan.inspect_blocks, plan.precision, plan.weights)
    return {"name": function["name"], "bucket": bucket,
            "inputs": _tensors((abi, value.type) for value, abi in function["arguments"]),
            "outputs": _tensors((abi, value.type) for abi, value in function["results"])}


def abi_document(plan: BuildPlan, identity: str, name: str, archive: Path) -> dict:
    functions = [function_abi(plan, b, plan.diagnostics) for b in plan.buckets]
    return {
        "abi_format": ABI_FORMAT,
        "module": {"file": f"{name}.vmfb", "name": MODULE_NAME, "target": plan.target,
                   "device": runtime_driver(plan.target)},
        "functions": functions,
        "parameters": {"scope": PARAMETER_SCOPE, "file": f"{name}.irpa", "content_key": archive.stem},
        "identity": identity,
        "precision": plan.precision,
        "vision_config": plan.cfg.to_dict(),
        "processor_policy": plan.policy.to_dict(),
        "video_policy": plan.video_policy.to_dict(),
        "emitter_version": __version__,
    }


def readme_text(abi: dict) -> str:
    first = abi["functions"][0]
    vmfb, irpa, device = abi["module"]["file"], abi["parameters"]["file"], abi["module"]["device"]
    zeros = " ".join(f"--input={'x'.join(map(str, t['shape']))}x{t['dtype'].replace('float', 'f').replace('int', 'i')}=0"
                     for t in first["inputs"])
    dumped = " ".join(f"--input=@DUMP/00/{t['name']}.npy" for t in first["inputs"])
    outputs = " ".join(f"--output=@{t['name']}.npy" for t in first["outputs"])
    entries = "\n".join(f"  {f['name']}: " + ", ".join(f"{t['name']} {t['shape']} {t['dtype']}" for t in f["inputs"])
                        + " -> " + ", ".join(f"{t['name']} {t['shape']}" for t in f["outputs"])
                        for f in abi["functions"])
    return f"""Qwen3-VL vision tower, compiled with IREE (exported by qwen3vl-iree {abi['emitter_version']}).

{vmfb}   one module, one entry per bucket (patches per call):
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

Outputs are padded to the bucket: keep the first "merged" rows of each.
"""


def place_file(source: Path, target: Path) -> None:
    """`target` becomes a copy of `source` (a hard link when they share a file system; the
    cache never rewrites an entry in place), replacing it whole or not at all."""
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.tmp.{os.getpid()}.", dir=target.parent)
    os.close(fd)
    os.unlink(tmp)
    try:
        try:
            os.link(source, tmp)
        except OSError:
            shutil.copyfile(source, tmp)
            os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def export(model, out, buckets=(), precision: str = "f32", target: str | None = None, cache_dir=None,
           name: str | None = None, diagnostics: bool = False, progress=None) -> str:
    """Write the export folder `out`; return a summary. ValueError for bad input, before any work."""
    if not model or not Path(model).is_dir():
        raise ValueError(f"--model {model}: not a readable folder; expected a checkpoint folder "
                         f"(config.json, preprocessor_config.json, *.safetensors)")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"-o {out}: is a file; expected a folder (created if missing)")
    if not out.parent.is_dir():
        raise ValueError(f"-o {out}: folder {out.parent} does not exist")
    plan = make_plan(str(model), None, buckets, target, diagnostics, None, precision, "parameters")
    name = name or export_name(model)
    cache = ArtifactCache(cache_dir)
    archive = cached_archive(model, plan.cfg, plan.precision, cache, progress)
    open_archive(archive, plan.cfg, plan.precision)  # holds exactly the graph's weights
    result = build_artifact(plan, cache, progress)
    abi = abi_document(plan, result.identity, name, archive)
    created = not out.exists()
    out.mkdir(exist_ok=True)
    files = [out / f"{name}.irpa", out / f"{name}.vmfb", out / "abi.json", out / "README.txt"]
    try:  # all four or none: a failed write removes what this export placed
        place_file(archive, files[0])
        place_file(result.path, files[1])
        write_atomic(files[2], json.dumps(abi, indent=1) + "\n")
        write_atomic(files[3], readme_text(abi))
    except BaseException:
        for path in files:
            path.unlink(missing_ok=True)
        if created:
            shutil.rmtree(out, ignore_errors=True)
        raise
    assert json.loads(canonical_json(abi)) == abi  # plain JSON only
    sizes = {p: (out / p).stat().st_size for p in (f"{name}.vmfb", f"{name}.irpa")}
    return "\n".join([f"wrote {out}/",
                      *(f"  {p:<40} {s / 2**20:9.1f} MiB" for p, s in sizes.items()),
                      f"  {'abi.json':<40} {len(abi['functions'])} function{'s' * (len(abi['functions']) > 1)}: "
                      + ", ".join(f['name'] for f in abi["functions"]),
                      f"  {'README.txt':<40} iree-run-module command lines"])
