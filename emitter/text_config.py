"""The text (language-model) config the decoder graph depends on, read from a Hugging Face
Qwen3-VL `config.json` (`text_config` plus the top-level special-token ids), and the
presets of the released dense models (plus `tiny` for tests).

Both spellings of the rotary settings are read: `rope_parameters {rope_theta,
mrope_section, ...}` (transformers 5) and the older `rope_theta` + `rope_scaling`.
`tie_word_embeddings` is read from the top level only, as transformers 5.24 reads it.

A `qwen3_vl_moe` checkpoint's language model is the same decoder with a mixture-of-experts
MLP in its sparse layers (`TextConfig.sparse`, transformers' Qwen3VLMoeTextDecoderLayer
rule); the expert count is read as released configs name it (`num_experts`) and as
transformers 5 writes it (`num_local_experts`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from .config import ConfigError, read_rope

DENSE_MODEL_TYPE = "qwen3_vl"
MOE_MODEL_TYPE = "qwen3_vl_moe"
DEFAULT_ROPE_THETA = 500000.0  # transformers' Qwen3VLTextConfig.default_theta, when the config names none
DEFAULT_MAX_POSITIONS = 128000  # transformers' Qwen3VLTextConfig.max_position_embeddings default
MOE_TEXT_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step")
# transformers' Qwen3VLMoeTextConfig defaults, for a qwen3_vl_moe config.json that names none.
MOE_DEFAULTS = {"num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408, "decoder_sparse_step": 1}
DEFAULT_MROPE_SECTION = (24, 20, 20)  # transformers' fallback when rope_parameters has none
TEXT_PREFIX = "model.language_model."  # Hugging Face names of the decoder's tensors
LM_HEAD = "lm_head.weight"
TOKEN_ID_FIELDS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = DEFAULT_ROPE_THETA
    mrope_section: tuple[int, int, int] = DEFAULT_MROPE_SECTION
    tie_word_embeddings: bool = False
    max_position_embeddings: int = DEFAULT_MAX_POSITIONS
    # A quantized checkpoint run in its bits (`--precision native`): (Hugging Face name, bits,
    # group size[, quant.SYMMETRIC]) of each quantized weight, as the checkpoint stores it
    # (runtime/checkpoints/text.py's `native_weights`; emitter/quant.py's `native_layouts`);
    # empty otherwise.
    native_weights: tuple[tuple, ...] = ()
    # Mixture of experts (qwen3_vl_moe); num_experts 0: every layer's MLP is dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "mrope_section", tuple(self.mrope_section))
        object.__setattr__(self, "native_weights", tuple(tuple(w) for w in self.native_weights))
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        self.validate()

    @property
    def groups(self) -> int:
        """Query heads per KV head."""
        return self.num_attention_heads // self.num_key_value_heads

    def sparse(self, layer: int) -> bool:
        """Whether decoder layer `layer`'s MLP is the mixture of experts (else the dense gated
        MLP of intermediate_size): transformers' Qwen3VLMoeTextDecoderLayer rule, the one place
        that decides it."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def moe(self) -> bool:
        """Some layer's MLP is a mixture of experts."""
        return any(self.sparse(n) for n in range(self.num_hidden_layers))

    def validate(self, source: str = "text_config") -> None:
        def bad(name, value, expected):
            raise ConfigError(f"{source}: field '{name}' = {value!r}: expected {expected}")

        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                bad(name, value, "a positive integer")
        if self.num_attention_heads % self.num_key_value_heads:
            bad("num_key_value_heads", self.num_key_value_heads,
                f"a divisor of num_attention_heads ({self.num_attention_heads})")
        if self.head_dim % 2:
            bad("head_dim", self.head_dim, "an even number")
        section = self.mrope_section
        if len(section) != 3 or any(not isinstance(s, int) or s < 0 for s in section) or \
                sum(section) != self.head_dim // 2:
            bad("rope_parameters.mrope_section", list(section), f"three non-negative sizes summing to head_dim/2 "
                f"({self.head_dim // 2})")
        if not self.rms_norm_eps > 0:
            bad("rms_norm_eps", self.rms_norm_eps, "a positive number")
        if not self.rope_theta > 0:
            bad("rope_parameters.rope_theta", self.rope_theta, "a positive number")
        if self.num_experts:
            self._validate_experts(bad)

    def _validate_experts(self, bad) -> None:
        def count(v):
            return isinstance(v, int) and not isinstance(v, bool)

        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
            if not count(getattr(self, name)) or getattr(self, name) <= 0:
                bad(name, getattr(self, name), "a positive integer")
        if self.num_experts_per_tok > self.num_experts:
            bad("num_experts_per_tok", self.num_experts_per_tok,
                f"at most num_experts ({self.num_experts}): the experts a token chooses among them")
        odd = [n for n in self.mlp_only_layers if not count(n) or not 0 <= n < self.num_hidden_layers]
        if odd:
            bad("mlp_only_layers", list(self.mlp_only_layers),
                f"layer indexes in [0, {self.num_hidden_layers}) (num_hidden_layers)")

    def check_context(self, context: int) -> None:
        """A KV cache of `context` tokens the model's positions cover (rotary positions past
        max_position_embeddings were never trained); ConfigError naming --context if not."""
        if context > self.max_position_embeddings:
            raise ConfigError(f"--context {context}: more than the model's max_position_embeddings "
                              f"({self.max_position_embeddings}, config.json); give at most that")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["mrope_section"] = list(self.mrope_section)
        if not self.native_weights:
            del d["native_weights"]  # the identity of a float checkpoint's model as it was
        if not self.num_experts:  # a dense model's identity as it was
            for name in (*MOE_TEXT_FIELDS, "mlp_only_layers"):
                del d[name]
        else:
            d["mlp_only_layers"] = list(self.mlp_only_layers)
        return d

    def to_hf_text_config(self) -> dict:
        """The `text_config` block of a Hugging Face `config.json` (transformers 5 spelling)."""
        d = self.to_dict()
        rope = {"rope_type": "default", "rope_theta": d.pop("rope_theta"),
                "mrope_section": d.pop("mrope_section"), "mrope_interleaved": True}
        d.pop("tie_word_embeddings")
        d.pop("native_weights", None)
        model_type = "qwen3_vl_moe_text" if self.num_experts else "qwen3_vl_text"
        return {"model_type": model_type, **d, "hidden_act": "silu", "attention_bias": False,
                "rope_parameters": rope}


@dataclass(frozen=True)
class TokenIds:
    """The special-token ids the prompt needs, from config.json's top level
    (`token_ids_from_hf`). The defaults are what transformers' Qwen3VLConfig gives a
    config.json that names none (Qwen's released ids); code takes the checkpoint's."""
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653


REQUIRED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def _rope(text: dict, source: str) -> tuple[float, tuple]:
    """(rope_theta, mrope_section) from either spelling."""
    rope, theta = read_rope(text, "text_config", source, ("default", "mrope"),
                            "'default' (scaled rotary embeddings are not supported)", DEFAULT_ROPE_THETA)
    section = rope.get("mrope_section", DEFAULT_MROPE_SECTION)
    if not isinstance(section, (list, tuple)):
        raise ConfigError(f"{source}: field 'text_config.rope_parameters.mrope_section' = {section!r}: "
                          "expected a list of three sizes")
    return theta, tuple(section)


def text_config_from_hf(config: dict, source: str = "config.json") -> tuple[TextConfig, TokenIds]:
    """The text config and special-token ids of a parsed Qwen3-VL `config.json` (dense
    `qwen3_vl` or mixture-of-experts `qwen3_vl_moe`)."""
    if not isinstance(config, dict):
        raise ConfigError(f"{source}: expected a JSON object")
    model_type = config.get("model_type")
    if model_type not in (DENSE_MODEL_TYPE, MOE_MODEL_TYPE):
        raise ConfigError(f"{source}: field 'model_type' = {model_type!r}: expected {DENSE_MODEL_TYPE!r} or "
                          f"{MOE_MODEL_TYPE!r}")
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"{source}: field 'text_config' is missing: expected an object")
    kwargs = _experts(text, source) if model_type == MOE_MODEL_TYPE else _refuse_moe_text(text, source)
    for name in REQUIRED_FIELDS:
        if name not in text:
            raise ConfigError(f"{source}: field 'text_config.{name}' is missing")
        kwargs[name] = text[name]
    kwargs["num_key_value_heads"] = text.get("num_key_value_heads") or text["num_attention_heads"]
    heads = text["num_attention_heads"]
    kwargs["head_dim"] = text.get("head_dim") or (text["hidden_size"] // heads if isinstance(heads, int) and heads
                                                  else heads)
    for name in ("rms_norm_eps", "max_position_embeddings"):
        if name in text:
            kwargs[name] = text[name]
    if text.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{source}: field 'text_config.hidden_act' = {text['hidden_act']!r}: expected 'silu'")
    if text.get("attention_bias", False):
        raise ConfigError(f"{source}: field 'text_config.attention_bias' = true: expected false")
    kwargs["rope_theta"], kwargs["mrope_section"] = _rope(text, source)
    # transformers 5.24 ties lm_head to the embeddings by the top-level flag only (default
    # false), whatever text_config says.
    kwargs["tie_word_embeddings"] = bool(config.get("tie_word_embeddings", False))
    ids = token_ids_from_hf(config, source)
    try:
        cfg = TextConfig(**kwargs)
    except ConfigError as e:
        raise ConfigError(str(e).replace("text_config: field '", f"{source}: field 'text_config.")) from None
    except TypeError as e:
        raise ConfigError(f"{source}: text_config: {e}") from None
    # A named id outside the vocabulary would put a token the embedding table has no row for in
    # the prompt. Named ones only: an absent one means Qwen's id, which a small test vocabulary
    # lacks but a prompt without images or videos never holds.
    for name in TOKEN_ID_FIELDS:
        if name in config and getattr(ids, name) >= cfg.vocab_size:
            raise ConfigError(f"{source}: field '{name}' = {getattr(ids, name)}: outside the vocabulary "
                              f"[0, {cfg.vocab_size}) of text_config.vocab_size")
    return cfg, ids


def token_ids_from_hf(config: dict, source: str = "config.json") -> TokenIds:
    """The special-token ids of a parsed `config.json` (its top-level fields; a field left
    out takes transformers' Qwen3VLConfig default)."""
    ids = {}
    for name in TOKEN_ID_FIELDS:
        value = config.get(name, getattr(TokenIds, name))
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"{source}: field '{name}' = {value!r}: expected a token id")
        ids[name] = value
    return TokenIds(**ids)


def _refuse_moe_text(text: dict, source: str) -> dict:
    """A mixture-of-experts language model declared only in text_config (its model_type or
    expert fields) under a dense top-level model_type is refused: transformers would build
    a dense model and drop the experts. {} (no expert fields) otherwise."""
    experts = [name for name in (*MOE_TEXT_FIELDS, "num_local_experts") if text.get(name)]
    if text.get("model_type") == "qwen3_vl_moe_text" or experts:
        what = f"model_type {text.get('model_type')!r}" if not experts else f"field {experts[0]!r}"
        raise ConfigError(f"{source}: text_config {what} declares a mixture-of-experts language model, but "
                          f"model_type is {DENSE_MODEL_TYPE!r}; expected {MOE_MODEL_TYPE!r}")
    return {}


def _experts(text: dict, source: str) -> dict:
    """The expert fields of a qwen3_vl_moe text_config (transformers' defaults where absent;
    the count as `num_experts` or `num_local_experts`, equal where both are given)."""
    out = {name: text.get(name, default) for name, default in MOE_DEFAULTS.items()}
    if "num_local_experts" in text:
        if "num_experts" in text and text["num_experts"] != text["num_local_experts"]:
            raise ConfigError(f"{source}: fields 'text_config.num_experts' = {text['num_experts']!r} and "
                              f"'text_config.num_local_experts' = {text['num_local_experts']!r}: expected one "
                              "expert count (give one of them)")
        out["num_experts"] = text["num_local_experts"]
    only = text.get("mlp_only_layers") or []
    if not isinstance(only, list):
        raise ConfigError(f"{source}: field 'text_config.mlp_only_layers' = {only!r}: expected a list of layer "
                          "indexes")
    out["mlp_only_layers"] = tuple(only)
    return out


def load_text_config(model_dir: str | Path) -> tuple[TextConfig, TokenIds]:
    """The text config and special-token ids of a checkpoint folder (its `config.json`)."""
    config, path = _read_config(model_dir)
    return text_config_from_hf(config, source=str(path))


def load_token_ids(model_dir: str | Path) -> TokenIds:
    """The special-token ids of a checkpoint folder's `config.json` (no language model needed)."""
    config, path = _read_config(model_dir)
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return token_ids_from_hf(config, source=str(path))


def _read_config(model_dir: str | Path) -> tuple[object, Path]:
    """A checkpoint folder's parsed `config.json` and its path; ConfigError naming it."""
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).is_dir():
        raise ConfigError(f"--model {model_dir}: not a readable folder")
    try:
        config = json.loads(path.read_text())
    except OSError as e:
        raise ConfigError(f"{path}: cannot read ({e.strerror or e})") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    return config, path


def _released(hidden, layers, heads, intermediate, tied, kv_heads=8, **experts):
    return TextConfig(vocab_size=151936, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=128,
                      rope_theta=5000000.0, mrope_section=(24, 20, 20), tie_word_embeddings=tied,
                      max_position_embeddings=262144, **experts)


TEXT_PRESETS: dict[str, TextConfig] = {
    "qwen3-vl-2b": _released(2048, 28, 16, 6144, True),
    "qwen3-vl-4b": _released(2560, 36, 32, 9728, True),
    "qwen3-vl-8b": _released(4096, 36, 32, 12288, False),
    "qwen3-vl-32b": _released(5120, 64, 64, 25600, False),
    "qwen3-vl-30b-a3b": _released(2048, 48, 32, 6144, False, kv_heads=4, num_experts=128, num_experts_per_tok=8,
                                  moe_intermediate_size=768),
    # Small enough to compile and run in a unit test; hidden = the tiny vision preset's out_hidden.
    "tiny": TextConfig(vocab_size=384, hidden_size=48, intermediate_size=96, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=5000000.0,
                       mrope_section=(4, 2, 2)),
    # tiny with experts: layers 0 and 2 sparse (8 experts, 2 a token), layer 1 dense.
    "tiny-moe": TextConfig(vocab_size=384, hidden_size=48, intermediate_size=96, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=5000000.0,
                           mrope_section=(4, 2, 2), num_experts=8, num_experts_per_tok=2, moe_intermediate_size=40,
                           mlp_only_layers=(1,)),
}
