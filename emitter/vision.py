"""The Qwen3-VL vision tower as one StableHLO function per bucket: `main` alone
(`emit_vision_module`, emit-qwen3vl), or the artifact module (`emit_artifact_module`)
exporting `encode_<B>` (or `encode_<B>_diagnostics`) per bucket over shared weight globals.

A bucket B is the most patches one call holds; the function's rows R are a run-time
count, the call's patches padded to whole row units (`row_unit`: 256- or 512-row
chunks in the blockwise attention form, merge windows of 4 in the dense one), so one
compile serves every image size. Per-call inputs:
  patches     [R, patch_dim] f32   processed pixels, merge-window order
  pos_index   [4, R] i32           bilinear corners (ff, fc, cf, cc) into the position table
  pos_weight  [4, R] f32           their weights
  rope_pos    [2, R] i32           (row, col) of each patch on its image grid
  segment_ids [R] i32              one id per image frame; each padding patch its own
then the weights in checkpoint order (`graph_weights`), each named by its
checkpoint tensor name; or, with weights="parameters", no weight arguments: each weight
is a global read from the parameter archive under that name.
Results: the main merger [R/4, out_hidden], then each DeepStack merger in order;
the diagnostics variant appends the named stages listed by `stage_names`.
"""

from __future__ import annotations

from . import __version__
from .builder import Builder, Value
from .config import (CONV_WEIGHT, HF_PREFIX, MATMUL_WEIGHT_SUFFIXES, PARAMETER_SCOPE, ConfigError, VisionConfig,
                     WeightSpec, weight_schema)
from .attention import ATTENTION_FORMS, attention, attention_chunk, attention_form, attention_inputs
from .dims import Dim
from .layers import Stages, layer_norm, linear, merger, mlp, rope_inv_freq, rotary_tables
from .module import function, render
from .precision import VISION, VISION_PRECISIONS, Precision, for_graph
from .quant import grouped, native_layouts

BLOCK_STAGES = ("norm1", "attn", "attn_residual", "norm2", "mlp")
MERGER_STAGES = ("norm", "fc1", "act")
STAGE_PREFIX = "stage."
# How weights reach the function: as arguments (uploaded once, passed every call) or as
# globals from a parameter archive (packed for the matmuls once, at module load).
WEIGHT_BINDINGS = ("arguments", "parameters")
MODULE_NAME = "qwen3vl_vision"


class BucketError(ValueError):
    """A bucket the graph cannot be built for."""


def check_bucket(bucket, cfg: VisionConfig | None = None) -> int:
    unit = cfg.merge_unit if cfg else 4
    if isinstance(bucket, bool) or not isinstance(bucket, int) or bucket <= 0 or bucket % unit:
        raise BucketError(f"--bucket {bucket}: expected a positive multiple of {unit} (patches)")
    return bucket


def parse_bucket(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"--bucket {text!r}: expected a positive multiple of 4 (patches)") from None


def default_inspect_blocks(cfg: VisionConfig) -> tuple[int, ...]:
    """Blocks whose inner stages the diagnostics variant records unless told otherwise."""
    return tuple(sorted({0, cfg.depth - 1}))


def output_names(cfg: VisionConfig) -> list[str]:
    return ["image_embeds"] + [f"deepstack_features.{k}" for k in range(len(cfg.deepstack_visual_indexes))]


def result_names(cfg: VisionConfig, diagnostics: bool = False, inspect_blocks=None) -> list[str]:
    """ABI names of the results, in order: outputs, then (diagnostics) `stage.<name>`."""
    stages = [f"{STAGE_PREFIX}{s}" for s in stage_names(cfg, inspect_blocks)] if diagnostics else []
    return output_names(cfg) + stages


def stage_names(cfg: VisionConfig, inspect_blocks=None) -> list[str]:
    """Names of the diagnostics stages, in the order the diagnostics variant returns them."""
    inspect = default_inspect_blocks(cfg) if inspect_blocks is None else tuple(inspect_blocks)
    names = ["patch_embed", "pos_embed", "embed"]
    for i in range(cfg.depth):
        if i in inspect:
            names += [f"blocks.{i}.{s}" for s in BLOCK_STAGES]
        names.append(f"blocks.{i}")
        if i in cfg.deepstack_visual_indexes:
            k = cfg.deepstack_visual_indexes.index(i)
            names += [f"deepstack_merger_list.{k}.{s}" for s in MERGER_STAGES] + [f"deepstack_merger_list.{k}"]
    names += [f"merger.{s}" for s in MERGER_STAGES] + ["merger"]
    return names


# The graph's rows are a run-time dimension: a call's patches padded to whole units of
# `row_unit` (the blockwise form's chunk, or the merge unit), at most its bucket.
ROWS = "units"


def row_unit(cfg: VisionConfig, bucket: int, form: str | None = None) -> int:
    """What a call's rows are padded to: whole chunks in the blockwise form (256 or 512
    patches, `attention_chunk`), whole merge windows in the dense form."""
    form = form or attention_form(bucket)
    return attention_chunk(bucket) if form == "blockwise" else cfg.merge_unit


def call_rows(cfg: VisionConfig, bucket: int, patches: int) -> int:
    """The rows of a call of `patches` patches to `bucket`'s entry: whole `row_unit`s."""
    unit = row_unit(cfg, bucket)
    return -(-max(patches, 1) // unit) * unit


def input_specs(cfg: VisionConfig, rows) -> list[tuple[str, tuple, str]]:
    """(name, shape, dtype) of the per-call inputs, in argument order, for `rows` rows (an
    int, or the graph's run-time Dim)."""
    return [
        ("patches", (rows, cfg.patch_dim), "f32"),
        ("pos_index", (4, rows), "i32"),
        ("pos_weight", (4, rows), "f32"),
        ("rope_pos", (2, rows), "i32"),
        ("segment_ids", (rows,), "i32"),
    ]


def block(b: Builder, x: Value, w: dict, cos, sin, segments, cfg: VisionConfig, stages: Stages, name: str) -> Value:
    with b.stage(f"{name}.norm1"):
        normed1 = stages(f"{name}.norm1", layer_norm(b, x, w["norm1.weight"], w["norm1.bias"]))
    with b.stage(f"{name}.attn"):
        attn = stages(f"{name}.attn", attention(b, normed1, w, cos, sin, segments, cfg.num_heads))
        x = stages(f"{name}.attn_residual", b.add(x, attn, hint="residual"))
    with b.stage(f"{name}.norm2"):
        normed2 = stages(f"{name}.norm2", layer_norm(b, x, w["norm2.weight"], w["norm2.bias"]))
    with b.stage(f"{name}.mlp"):
        out = stages(f"{name}.mlp", mlp(b, normed2, w))
        x = b.add(x, out, hint="residual")
    return stages(name, x)


def bind_weight(b: Builder, w, binding: str) -> Value:
    """A weight as a function argument named by its checkpoint name, or as a global read
    from the parameter archive under that name."""
    short = w.name[len(HF_PREFIX):]
    if binding == "arguments":
        return b.argument(short, w.shape, w.dtype, abi_name=w.name)
    return b.parameter(short, w.shape, w.dtype, key=w.name, scope=PARAMETER_SCOPE)


def check_binding(binding: str) -> str:
    if binding not in WEIGHT_BINDINGS:
        raise BucketError(f"--weights {binding!r}: expected one of {', '.join(WEIGHT_BINDINGS)}")
    return binding


def check_attention(form: str | None, bucket: int) -> str:
    """The attention form for `bucket`: `form` if given, else the bucket's default
    (`attention.attention_form`: dense below BLOCKWISE_FROM patches, blockwise from there)."""
    if form is None:
        return attention_form(bucket)
    if form not in ATTENTION_FORMS:
        raise BucketError(f"attention form {form!r}: expected one of {', '.join(ATTENTION_FORMS)}")
    return form


def largest_buffer_bytes(cfg: VisionConfig, bucket: int, patches: int | None = None) -> int:
    """A lower bound on the memory of one call of `patches` patches (default: the bucket's
    most) to `bucket`'s entry: its largest f32 buffer. In the dense attention form that is the
    [heads, R, R] scores (a call holds 2 to 3 of them at its peak); the blockwise form's
    scores are [heads, chunk, chunk] per step, so there it is those or the widest [R, width]
    activation (patches, qkv or the MLP's hidden layer)."""
    rows = call_rows(cfg, bucket, bucket if patches is None else patches)
    if attention_form(bucket) == "dense":
        return 4 * cfg.num_heads * rows * rows
    chunk = attention_chunk(bucket)
    return 4 * max(rows * max(cfg.patch_dim, 3 * cfg.hidden_size, cfg.intermediate_size),
                   cfg.num_heads * chunk * chunk)


def graph_weights(cfg: VisionConfig, precision: Precision | str = "f32") -> list[WeightSpec]:
    """`weight_schema` with dtypes: under bf16 the matmul weights are taken in bf16
    (exact for bf16 checkpoints); norms, biases and the position table stay f32. The linears
    of `cfg.native_weights` (a tower run in its own bits) are i8 / i4 with their scales and
    any biases (emitter/quant.py's `Layout.specs`)."""
    precision = for_graph(precision)
    if VISION not in precision.models:
        raise ConfigError(f"--precision {precision}: the language model's only; the vision tower takes one of "
                          f"{', '.join(VISION_PRECISIONS)}")
    schema = weight_schema(cfg)
    layouts = native_layouts(cfg.native_weights)
    odd = [n for n in layouts if not n.endswith(MATMUL_WEIGHT_SUFFIXES) or n not in dict(schema)]
    if odd:
        raise ConfigError(f"{odd[0]}: quantized in the checkpoint, but only the tower's linears can run quantized")
    specs = []
    for name, shape in schema:
        if name in layouts:
            specs += layouts[name].specs(name, shape)
            continue
        transforms = ["conv3d_flatten"] if name == CONV_WEIGHT else []
        dtype = "f32"
        if precision.weights == "bf16" and name.endswith(MATMUL_WEIGHT_SUFFIXES):
            dtype = "bf16"
            transforms.append("round_to_bf16")
        specs.append(WeightSpec(name, shape, dtype, "+".join(transforms) or "none"))
    return specs



def build_vision_graph(b: Builder, cfg: VisionConfig, bucket: int, precision: Precision | str = "f32",
                       binding: str = "arguments", kept=(), attention: str | None = None
                       ) -> tuple[list[Value], dict[str, Value]]:
    """Emit the tower into `b`; returns (outputs, every named stage). The stages in `kept`
    (those a diagnostics variant returns) are written out as they are (`layers.Stages`).
    `attention` names the attention form (`check_attention`; default: by bucket)."""
    form = check_attention(attention, bucket)
    unit = row_unit(cfg, bucket, form)
    rows = Dim(ROWS, unit)
    inputs = {name: b.argument(name, shape, dtype) for name, shape, dtype in input_specs(cfg, rows)}
    b.bind(ROWS, b.divide(b.dimension_size(inputs["patches"], 0, hint="rows"), b.constant(unit, (), "i32"),
                          hint="units"))
    weights = grouped({w.name[len(HF_PREFIX):]: bind_weight(b, w, check_binding(binding))
                       for w in graph_weights(cfg, precision)})

    def group(prefix):
        return {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}

    stages = Stages(b, kept)
    with b.stage("patch_embed"):
        patch_embed = stages("patch_embed", linear(b, inputs["patches"], weights["patch_embed.proj.weight"],
                                                   weights["patch_embed.proj.bias"], "proj"))
    with b.stage("pos_embed"):
        corners = b.take_rows(weights["pos_embed.weight"], inputs["pos_index"], hint="corners")
        weight = b.broadcast_in_dim(inputs["pos_weight"], corners.shape, [0, 1], hint="corner_weight")
        pos_embed = stages("pos_embed", b.reduce(b.multiply(corners, weight, hint="weighted"), [0], "add",
                                                 hint="blend"))
    with b.stage("embed"):
        x = stages("embed", b.add(patch_embed, pos_embed, hint="sum"))
    with b.stage("rotary"):
        inv_freq = rope_inv_freq(cfg.head_dim // 2, cfg.rope_theta)
        cos, sin = rotary_tables(b, inputs["rope_pos"], inv_freq, cfg.head_dim)
    with b.stage("mask"):
        segments = attention_inputs(b, inputs["segment_ids"], form, attention_chunk(bucket))

    deepstack = []
    for i in range(cfg.depth):
        x = block(b, x, group(f"blocks.{i}."), cos, sin, segments, cfg, stages, f"blocks.{i}")
        if i in cfg.deepstack_visual_indexes:
            name = f"deepstack_merger_list.{cfg.deepstack_visual_indexes.index(i)}"
            with b.stage(name):
                deepstack.append(stages(name, merger(b, x, group(name + "."), cfg.merge_unit, True, stages, name)))
    with b.stage("merger"):
        main = stages("merger", merger(b, x, group("merger."), cfg.merge_unit, False, stages, "merger"))
    return [main, *deepstack], stages


def entry_name(bucket: int, diagnostics: bool = False) -> str:
    """The artifact module's entry for a bucket: `encode_<B>`, or `encode_<B>_diagnostics`."""
    return f"encode_{bucket}" + ("_diagnostics" if diagnostics else "")


def check_inspect_blocks(cfg: VisionConfig, inspect_blocks) -> None:
    bad = [i for i in inspect_blocks or () if not 0 <= i < cfg.depth]
    if bad:
        raise BucketError(f"--inspect-block {bad[0]}: expected a block index in [0, {cfg.depth})")


def vision_function(cfg: VisionConfig, bucket: int, name: str, diagnostics: bool = False, inspect_blocks=None,
                    precision: Precision | str = "f32", weights: str = "arguments", attention: str | None = None
                    ) -> tuple[dict, list[str]]:
    """One bucket's function (name, arguments, results, body) and the weight globals it reads."""
    precision = for_graph(precision)
    b = Builder(activations=precision.activation_dtype)
    kept = stage_names(cfg, inspect_blocks) if diagnostics else []
    outputs, stages = build_vision_graph(b, cfg, bucket, precision, weights, kept, attention)
    values = outputs + [stages[s] for s in kept]
    results = list(zip(result_names(cfg, diagnostics, inspect_blocks), values))
    return function(b, name, results), b.globals


def emit_vision_module(cfg: VisionConfig, bucket: int, diagnostics: bool = False, inspect_blocks=None,
                       title: str = "", precision: Precision | str = "f32", weights: str = "arguments",
                       attention: str | None = None) -> str:
    """MLIR text of the vision tower for one bucket, function `main` (deterministic: same
    input, same bytes). `precision` "bf16" takes the matmul weights in bf16 and runs every
    matmul on bf16 operands with f32 accumulation ("bf16-f32": bf16 weights, widened to
    f32 inside each matmul, all activations f32); everything else stays f32 (the
    blockwise form's softmax denominator sums, in f32, the bf16 weights its context matmul
    takes). `weights` "parameters" reads the weights from a parameter archive (scope
    `model`, keys the checkpoint names) instead of taking them as arguments. `attention`
    overrides the bucket's attention form ("dense" or "blockwise"; for A/B measurements)."""
    check_bucket(bucket, cfg)
    check_inspect_blocks(cfg, inspect_blocks)
    precision = for_graph(precision)
    function, globals_ = vision_function(cfg, bucket, "main", diagnostics, inspect_blocks, precision, weights,
                                         attention)
    return render_functions([function], globals_, title=title, buckets=[bucket], diagnostics=diagnostics,
                            precision=precision, config=cfg.to_dict())


def emit_artifact_module(cfg: VisionConfig, buckets, diagnostics: bool = False, inspect_blocks=None,
                         title: str = "", precision: Precision | str = "f32", weights: str = "parameters") -> str:
    """MLIR text of the artifact module: one entry per bucket, `encode_<B>` (with
    `diagnostics`, `encode_<B>_diagnostics`, whose results start with the same outputs),
    every entry reading the same weight globals (scope `model`, keys the checkpoint names),
    so each weight is loaded and packed once for all buckets. With `weights` "arguments"
    each entry takes them as arguments instead."""
    buckets = [check_bucket(b, cfg) for b in buckets]
    if not buckets or len(set(buckets)) != len(buckets):
        raise BucketError(f"buckets {buckets}: expected one or more distinct buckets")
    check_inspect_blocks(cfg, inspect_blocks)
    precision = for_graph(precision)
    functions, shared = [], None
    for bucket in buckets:
        function, globals_ = vision_function(cfg, bucket, entry_name(bucket, diagnostics), diagnostics,
                                             inspect_blocks, precision, weights)
        assert shared is None or globals_ == shared, "every entry reads the same weight globals"
        functions.append(function)
        shared = globals_
    return render_functions(functions, shared, title=title, buckets=buckets, diagnostics=diagnostics,
                            precision=precision, config=cfg.to_dict())


def vision_header(title: str = "", buckets=(0,), diagnostics: bool = False, precision: Precision | str = "f32",
                  config: dict | None = None, parameters: bool = False) -> str:
    """The vision module's header comment."""
    buckets = list(buckets)
    notes = (" (" + title + ")" if title else "") + f", {'bucket' if len(buckets) == 1 else 'buckets'} " \
        f"{', '.join(map(str, buckets))} patches" + (", diagnostics" if diagnostics else "") + \
        for_graph(precision).note + (", weights from parameters" if parameters else "")
    return (f"// Qwen3-VL vision tower{notes}.\n"
            f"// Emitted by qwen3vl-iree {__version__}; regenerate with emit-qwen3vl, do not edit by hand.\n"
            f"// vision config: {', '.join(f'{k}={v}' for k, v in (config or {}).items())}\n")


def render_functions(functions: list[dict], globals_: list[str], *, title: str = "", buckets=(0,),
                     diagnostics: bool = False, precision: Precision | str = "f32", config: dict | None = None) -> str:
    """Functions (name, arguments, results, body) over shared globals, as the vision module."""
    header = vision_header(title, buckets, diagnostics, precision, config, bool(globals_))
    return render(MODULE_NAME, header, globals_, functions)


def render_module(b: Builder, results: list[tuple[str, Value]], *, title: str = "", bucket: int = 0,
                  diagnostics: bool = False, precision: Precision | str = "f32", config: dict | None = None) -> str:
    """The builder's globals, arguments and lines as function `main` in the vision module,
    with `results` (ABI name, value) returned in order."""
    return render_functions([function(b, "main", results)], b.globals, title=title, buckets=[bucket],
                            diagnostics=diagnostics, precision=precision, config=config)
