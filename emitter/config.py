"""The vision config the graph depends on: parsed from a Hugging Face `config.json`,
validated, its weight schema, and the presets of the released checkpoints (plus `tiny` for
tests). Precisions are emitter/precision.py's."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

LAYER_NORM_EPS = 1e-6  # hard-coded in transformers' Qwen3-VL, not in any config
ROPE_THETA = 10000.0  # vision rotary base (transformers' default for the axial rope)
MODEL_TYPES = ("qwen3_vl", "qwen3_vl_moe")
HF_PREFIX = "model.visual."  # Hugging Face checkpoint names of the vision tower
CONV_WEIGHT = HF_PREFIX + "patch_embed.proj.weight"  # the graph takes it flattened to [hidden, patch_dim]


class ConfigError(ValueError):
    """A config that the graph cannot be built from; the message names the field."""


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    out_hidden_size: int
    num_heads: int
    deepstack_visual_indexes: tuple[int, ...]
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    num_position_embeddings: int = 2304
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = ROPE_THETA
    # A quantized tower run in its bits (`--precision native`): (Hugging Face name, bits, group
    # size[, quant.SYMMETRIC]) of each quantized linear, as the checkpoint stores it
    # (emitter/quant.py's `native_layouts`; runtime/checkpoints/vision.py's
    # `vision_native_weights`, gguf_vision.py's `native_weights`); empty otherwise.
    native_weights: tuple[tuple, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "deepstack_visual_indexes", tuple(self.deepstack_visual_indexes))
        object.__setattr__(self, "native_weights", tuple(tuple(w) for w in self.native_weights))
        self.validate()

    # Derived sizes, one place each.
    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size**2

    @property
    def merged_hidden_size(self) -> int:
        return self.hidden_size * self.merge_unit

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def conv_shape(self) -> tuple[int, ...]:
        """The patch-embed Conv3d weight as the checkpoint stores it: [hidden, C, T, P, P]."""
        return (self.hidden_size, self.in_channels, self.temporal_patch_size, self.patch_size, self.patch_size)

    @property
    def grid_side(self) -> int:
        return math.isqrt(self.num_position_embeddings)

    def validate(self, source: str = "vision_config") -> None:
        def bad(name, value, expected):
            raise ConfigError(f"{source}: field '{name}' = {value!r}: expected {expected}")

        for name in ("depth", "hidden_size", "intermediate_size", "out_hidden_size", "num_heads",
                     "patch_size", "temporal_patch_size", "in_channels", "num_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                bad(name, value, "a positive integer")
        if self.depth > MAX_DEPTH:  # checked before anything loops over the blocks
            bad("depth", self.depth, f"at most {MAX_DEPTH} blocks (released towers have 24-27)")
        size = sum(math.prod(shape) for _, shape in weight_schema(self)) * 4
        if size > MAX_WEIGHT_BYTES:
            raise ConfigError(f"{source}: depth {self.depth}, hidden_size {self.hidden_size}, intermediate_size "
                              f"{self.intermediate_size} need {size >> 30} GiB of f32 vision weights: expected at "
                              f"most {MAX_WEIGHT_BYTES >> 30} GiB")
        if self.hidden_size % self.num_heads:
            bad("hidden_size", self.hidden_size, f"a multiple of num_heads ({self.num_heads})")
        if self.head_dim % 4:
            bad("num_heads", self.num_heads,
                f"a head count giving a head_dim divisible by 4 (hidden_size {self.hidden_size} / "
                f"{self.num_heads} = {self.head_dim})")
        if self.spatial_merge_size != 2:
            bad("spatial_merge_size", self.spatial_merge_size, "2")
        if self.grid_side**2 != self.num_position_embeddings:
            bad("num_position_embeddings", self.num_position_embeddings,
                "a perfect square (the learned position table is a square grid)")
        if self.hidden_act != "gelu_pytorch_tanh":
            bad("hidden_act", self.hidden_act, "'gelu_pytorch_tanh'")
        if not _is_positive_number(self.rope_theta):
            bad("rope_theta", self.rope_theta, "a finite positive number (the rotary base)")
        indexes = self.deepstack_visual_indexes
        for i in indexes:
            if not isinstance(i, int) or not 0 <= i < self.depth:
                bad("deepstack_visual_indexes", list(indexes), f"block indexes in [0, {self.depth})")
        if list(indexes) != sorted(set(indexes)):
            bad("deepstack_visual_indexes", list(indexes), "strictly increasing block indexes")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["deepstack_visual_indexes"] = list(self.deepstack_visual_indexes)
        if not self.native_weights:
            del d["native_weights"]  # the identity of a float checkpoint's tower as it was
        return d

    def to_hf_vision_config(self) -> dict:
        """The `vision_config` block of a Hugging Face `config.json` for this config."""
        d = self.to_dict()
        d.pop("rope_theta")
        d.pop("native_weights", None)
        d["initializer_range"] = 0.02
        return d


# Sanity bounds, so that a corrupt config fails at once instead of growing without bound.
MAX_DEPTH = 1024
MAX_WEIGHT_BYTES = 1 << 40


def _is_positive_number(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and value > 0)


REQUIRED_FIELDS = ("depth", "hidden_size", "intermediate_size", "out_hidden_size", "num_heads",
                   "deepstack_visual_indexes")
OPTIONAL_FIELDS = ("patch_size", "temporal_patch_size", "spatial_merge_size", "in_channels",
                   "num_position_embeddings", "hidden_act")


def from_hf_config(config: dict, source: str = "config.json") -> VisionConfig:
    """Read the vision part of a Hugging Face Qwen3-VL `config.json` (already parsed)."""
    if not isinstance(config, dict):
        raise ConfigError(f"{source}: expected a JSON object")
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ConfigError(f"{source}: field 'model_type' = {model_type!r}: expected one of {list(MODEL_TYPES)}")
    vision = config.get("vision_config")
    if not isinstance(vision, dict):
        raise ConfigError(f"{source}: field 'vision_config' is missing: expected an object")
    kwargs = {}
    for name in REQUIRED_FIELDS:
        if name not in vision:
            raise ConfigError(f"{source}: field 'vision_config.{name}' is missing")
        kwargs[name] = vision[name]
    for name in OPTIONAL_FIELDS:
        if name in vision:
            kwargs[name] = vision[name]
    for name in ("patch_size", "temporal_patch_size"):
        if isinstance(kwargs.get(name), (list, tuple)):
            sizes = set(kwargs[name])
            if len(sizes) != 1:
                raise ConfigError(f"{source}: field 'vision_config.{name}' = {kwargs[name]!r}: expected one size")
            kwargs[name] = sizes.pop()
    kwargs["rope_theta"] = _rope_theta(vision, source)
    if not isinstance(kwargs["deepstack_visual_indexes"], (list, tuple)):
        raise ConfigError(f"{source}: field 'vision_config.deepstack_visual_indexes' = "
                          f"{kwargs['deepstack_visual_indexes']!r}: expected a list of block indexes")
    try:
        return VisionConfig(**kwargs)
    except ConfigError as e:
        raise ConfigError(str(e).replace("vision_config: field '", f"{source}: field 'vision_config.")) from None


def _rope_theta(vision: dict, source: str) -> float:
    """The vision rotary base. The rope type, if given, must be what transformers' vision
    rotary embedding accepts: 'axial' ('default' is read as axial)."""
    return read_rope(vision, "vision_config", source, ("axial", "default"),
                     "'axial' (the vision tower's 2-D rotary embedding)", ROPE_THETA)[1]


def read_rope(section: dict, where: str, source: str, types: tuple, expected: str,
              default_theta: float) -> tuple[dict, float]:
    """(rotary settings, rope_theta) of a config section, in either spelling:
    `rope_parameters` (transformers 5) or the older `rope_scaling` beside a top-level
    `rope_theta`. A rope type outside `types` is refused, saying `expected`."""
    rope = section.get("rope_parameters")
    if rope is None:
        rope = section.get("rope_scaling")
    if rope is not None and not isinstance(rope, dict):
        raise ConfigError(f"{source}: field '{where}.rope_parameters' = {rope!r}: expected an object")
    rope = rope or {}
    rope_type = rope.get("rope_type", rope.get("type", types[0]))
    if rope_type not in types:
        raise ConfigError(f"{source}: field '{where}.rope_parameters.rope_type' = {rope_type!r}: expected {expected}")
    field, theta = "rope_parameters.rope_theta", rope.get("rope_theta")
    if theta is None:
        field, theta = "rope_theta", section.get("rope_theta", default_theta)
    if not _is_positive_number(theta):
        raise ConfigError(f"{source}: field '{where}.{field}' = {theta!r}: expected a finite positive "
                          f"number (the rotary base)")
    return rope, float(theta)


def load_model_config(model_dir: str | Path) -> VisionConfig:
    """The vision config of a checkpoint folder (its `config.json`)."""
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).is_dir():
        raise ConfigError(f"--model {model_dir}: not a readable folder")
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    return from_hf_config(config, source=str(path))


# The parameter scope every module's weight globals are read from (keys: checkpoint names).
PARAMETER_SCOPE = "model"
MATMUL_WEIGHT_SUFFIXES = ("proj.weight", "qkv.weight", "linear_fc1.weight", "linear_fc2.weight")


@dataclass(frozen=True)
class WeightSpec:
    """One graph weight argument: its checkpoint name, the shape and dtype the graph
    takes, and what the host does to the checkpoint tensor to get there."""
    name: str
    shape: tuple[int, ...]
    dtype: str
    host_transform: str


def weight_schema(cfg: VisionConfig) -> list[tuple[str, tuple[int, ...]]]:
    """Graph weight arguments in checkpoint order: (HF tensor name, shape the graph takes).

    The patch-embed conv weight is taken pre-flattened to [hidden, patch_dim]."""
    h, i, h4, out = cfg.hidden_size, cfg.intermediate_size, cfg.merged_hidden_size, cfg.out_hidden_size
    p = HF_PREFIX
    names: list[tuple[str, tuple[int, ...]]] = [
        (CONV_WEIGHT, (h, cfg.patch_dim)),
        (p + "patch_embed.proj.bias", (h,)),
        (p + "pos_embed.weight", (cfg.num_position_embeddings, h)),
    ]
    for b in range(cfg.depth):
        q = f"{p}blocks.{b}."
        names += [
            (q + "norm1.weight", (h,)), (q + "norm1.bias", (h,)),
            (q + "norm2.weight", (h,)), (q + "norm2.bias", (h,)),
            (q + "attn.qkv.weight", (3 * h, h)), (q + "attn.qkv.bias", (3 * h,)),
            (q + "attn.proj.weight", (h, h)), (q + "attn.proj.bias", (h,)),
            (q + "mlp.linear_fc1.weight", (i, h)), (q + "mlp.linear_fc1.bias", (i,)),
            (q + "mlp.linear_fc2.weight", (h, i)), (q + "mlp.linear_fc2.bias", (h,)),
        ]

    def merger(prefix, norm_size):
        return [
            (prefix + "norm.weight", (norm_size,)), (prefix + "norm.bias", (norm_size,)),
            (prefix + "linear_fc1.weight", (h4, h4)), (prefix + "linear_fc1.bias", (h4,)),
            (prefix + "linear_fc2.weight", (out, h4)), (prefix + "linear_fc2.bias", (out,)),
        ]

    names += merger(p + "merger.", h)
    for k in range(len(cfg.deepstack_visual_indexes)):
        names += merger(f"{p}deepstack_merger_list.{k}.", h4)
    return names


def _released(depth, hidden, intermediate, out_hidden, deepstack):
    return VisionConfig(depth=depth, hidden_size=hidden, intermediate_size=intermediate,
                        out_hidden_size=out_hidden, num_heads=16, deepstack_visual_indexes=deepstack)


PRESETS: dict[str, VisionConfig] = {
    "qwen3-vl-2b": _released(24, 1024, 4096, 2048, (5, 11, 17)),
    "qwen3-vl-4b": _released(24, 1024, 4096, 2560, (5, 11, 17)),
    "qwen3-vl-8b": _released(27, 1152, 4304, 4096, (8, 16, 24)),
    "qwen3-vl-32b": _released(27, 1152, 4304, 5120, (8, 16, 24)),
    "qwen3-vl-30b-a3b": _released(27, 1152, 4304, 2048, (8, 16, 24)),
    "qwen3-vl-235b-a22b": _released(27, 1152, 4304, 4096, (8, 16, 24)),
    # Small enough to compile and run in a unit test; same structure as the real ones.
    "tiny": VisionConfig(depth=4, hidden_size=64, intermediate_size=128, out_hidden_size=48,
                         num_heads=4, deepstack_visual_indexes=(1, 2)),
}
PRESETS["tiny-moe"] = PRESETS["tiny"]  # the tiny tower beside a tiny mixture-of-experts language model
DEFAULT_PRESET = "qwen3-vl-2b"
PRESET_MODEL_TYPES = {"qwen3-vl-30b-a3b": "qwen3_vl_moe", "qwen3-vl-235b-a22b": "qwen3_vl_moe",
                      "tiny-moe": "qwen3_vl_moe"}


def preset(name: str) -> VisionConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"--preset {name!r}: unknown preset; expected one of {', '.join(PRESETS)}") from None


def resolve_config(model: str | None, preset_name: str | None) -> tuple[VisionConfig, str]:
    """The vision config asked for on the command line, and a title naming its source."""
    if model and preset_name:
        raise ValueError("--model and --preset: give one, not both")
    if model:
        return load_model_config(model), f"model {Path(model).name}"
    name = preset_name or DEFAULT_PRESET
    return preset(name), f"preset {name}"
