"""A llama.cpp GGUF text file (what its `convert_hf_to_gguf.py` writes for a Qwen3-VL
checkpoint, architecture `qwen3vl`) read as it is, through the `gguf` package: the text
config from the `qwen3vl.*` metadata, the decoder's tensors under their Hugging Face names
(`hf_name`, the one place llama.cpp's names are mapped), each either exact f32 (F32, F16,
BF16 widened; the quantized types by `gguf.quants.dequantize`) or, run in its bits
(`--precision native`), in emitter/quant.py's layout: Q8_0, Q4_0, Q5_0 and Q6_K symmetric in
their own groups (32; Q6_K 16), Q4_1, Q5_1, Q4_K and Q5_K affine in groups of 32
(runtime/checkpoints/gguf_blocks.py); the Q8_0, Q4_0 and Q6_K matrices (but a Q6_K embedding
table) and the expert stacks through the block kernel as the file holds them (`on_kernel`).
Every problem is a one-line `CheckpointError` naming the file and the tensor.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path

import numpy as np

from emitter import quant
from emitter.experts import DOWN, GATE_UP, ROUTER, is_expert
from emitter.text import EMBEDDING, text_weights, weight_layouts, weight_shapes
from emitter.text_config import LM_HEAD, TEXT_PREFIX, TextConfig, TokenIds, text_config_from_hf
from runtime.checkpoints.gguf_blocks import LAYOUTS, in_bits
from runtime.checkpoints.tensor_files import CheckpointError

ARCH, MOE_ARCH = "qwen3vl", "qwen3vlmoe"  # the dense and the mixture-of-experts language models
MAGIC = b"GGUF"
FLOAT_TYPES = ("F32", "F16", "BF16")
TYPES = FLOAT_TYPES + tuple(LAYOUTS)  # what is read; the quantized ones run in their bits
# llama.cpp's names of the decoder's tensors (gguf-py's tensor_mapping for qwen3vl)
GLOBAL_NAMES = {"token_embd.weight": TEXT_PREFIX + "embed_tokens.weight",
                "output_norm.weight": TEXT_PREFIX + "norm.weight", "output.weight": LM_HEAD}
BLOCK_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
               "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
               "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
# The mixture of experts (qwen3vlmoe): the router, and the expert stacks [E, out, in]; llama.cpp
# stores gate and up apart, the graph takes them as one stack, gate rows first (GATE_UP).
EXPERT_NAMES = {"ffn_gate_inp": ROUTER, "ffn_gate_exps": GATE_UP + ":gate", "ffn_up_exps": GATE_UP + ":up",
                "ffn_down_exps": DOWN}
KERNEL_TYPES = ("Q8_0", "Q4_0")  # run in their bits through the block kernel, as llama.cpp runs them
EXPERT_TYPES = KERNEL_TYPES  # the quantized types an expert stack may have
Q6_K = "Q6_K"  # a matrix of it (not the embedding table) through the kernel's q6k entry (`quant.Q6_K_TILES`)
SPECIAL_TOKENS = {"image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>",
                  "vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>"}


def starts_gguf(path: Path) -> bool:
    """Whether `path` is a file that starts with GGUF's magic."""
    try:
        with open(path, "rb") as f:
            return path.is_file() and f.read(4) == MAGIC
    except OSError:
        return False


def text_file(path) -> Path | None:
    """The GGUF text file `--model` names: the file itself, or the one `*.gguf` of a folder
    without config.json whose name does not start with `mmproj` (llama.cpp's naming of the
    projector beside it); None for anything else."""
    path = Path(path)
    if path.is_dir() and not (path / "config.json").exists():
        found = [p for p in sorted(path.glob("*.gguf")) if not p.name.lower().startswith("mmproj")]
        if len(found) > 1:
            raise CheckpointError(f"--model {path}: {len(found)} GGUF text files ({', '.join(p.name for p in found)}); "
                                  "expected one beside its mmproj, or the file itself")
        path = found[0] if found else path
    return path if starts_gguf(path) else None


def is_gguf(path) -> bool:
    """Whether `--model` names a GGUF text file (`text_file`)."""
    return text_file(path) is not None


def hf_name(name: str) -> str | None:
    """The Hugging Face name of one of llama.cpp's decoder tensor names, or None."""
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in BLOCK_NAMES:
        return f"{TEXT_PREFIX}layers.{parts[1]}.{BLOCK_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in EXPERT_NAMES and \
            parts[3] == "weight":
        return f"{TEXT_PREFIX}layers.{parts[1]}.{EXPERT_NAMES[parts[2]]}"
    return None


def parsed(file):
    """`gguf.GGUFReader(file)`, parsed once a process for each version of the file (its
    resolved path, mtime and size): a Qwen vocabulary's metadata alone takes ~6 s to parse,
    and one `generate` reads the file's metadata in a dozen places."""
    file = Path(file)
    stat = file.stat()
    return _parsed(str(file.resolve()), stat.st_mtime_ns, stat.st_size)


@lru_cache(maxsize=4)
def _parsed(file: str, mtime_ns: int, size: int):
    import gguf

    class Reader(gguf.GGUFReader):
        """GGUFReader over a plain ndarray view of its memory map: the same fields and
        tensors, parsed x3.3 faster (a np.memmap slice costs more than the parse's work)."""
        data = property(lambda self: self._data, lambda self, value: setattr(self, "_data", value.view(np.ndarray)))

    return Reader(file)


def reader(path):
    """The file's `gguf.GGUFReader` (`parsed`), its architecture checked."""
    try:
        r = parsed(text_file(path) or path)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not a readable GGUF file ({e})") from None
    arch = field(r, "general.architecture", path)
    if arch not in (ARCH, MOE_ARCH):
        raise CheckpointError(f"{path}: GGUF architecture {arch!r} is not supported; expected {ARCH!r} or "
                              f"{MOE_ARCH!r} (a Qwen3-VL text model as llama.cpp's convert_hf_to_gguf.py writes it)")
    return r


def architecture(r) -> str:
    """The file's architecture (`reader` has checked it): its metadata keys' prefix."""
    return r.fields["general.architecture"].contents()


def field(r, key: str, path, default=None):
    """One metadata value (a list for an array), or `default`; CheckpointError if needed."""
    f = r.fields.get(key)
    if f is None:
        if default is None:
            raise CheckpointError(f"{path}: GGUF metadata {key!r} is missing")
        return default
    return f.contents()


def f32_decimal(value) -> float:
    """A float GGUF stores in f32 as the shortest decimal that rounds to it (1e-06, not
    9.99999997e-07), the number config.json would have held."""
    return float(str(np.float32(value)))


def text_config(path) -> tuple[TextConfig, TokenIds]:
    """The text config and special-token ids of a GGUF text file, from its `qwen3vl.*`
    metadata (tied embeddings where it stores no `output.weight`) and its vocabulary."""
    r = reader(path)
    arch = architecture(r)
    key = lambda k, default=None: field(r, f"{arch}.{k}", path, default)  # noqa: E731
    tokens = field(r, "tokenizer.ggml.tokens", path)
    sections = key("rope.dimension_sections")
    text = {"vocab_size": len(tokens), "hidden_size": key("embedding_length"),
            "intermediate_size": key("feed_forward_length"), "num_hidden_layers": key("block_count"),
            "num_attention_heads": key("attention.head_count"), "num_key_value_heads": key("attention.head_count_kv"),
            "head_dim": key("attention.key_length"),
            "rms_norm_eps": f32_decimal(key("attention.layer_norm_rms_epsilon")),
            "max_position_embeddings": key("context_length"),
            "rope_parameters": {"rope_type": "default", "rope_theta": f32_decimal(key("rope.freq_base")),
                                "mrope_section": list(sections[:3]), "mrope_interleaved": True}}
    if arch == MOE_ARCH:
        text.update(experts_config(r, path, key))
    ids = {name: tokens.index(tok) for name, tok in SPECIAL_TOKENS.items() if tok in tokens}
    config = {"model_type": "qwen3_vl_moe" if arch == MOE_ARCH else "qwen3_vl", "text_config": text, **ids,
              "tie_word_embeddings": not any(t.name == "output.weight" for t in r.tensors)}
    return text_config_from_hf(config, source=str(path))


def experts_config(r, path, key) -> dict:
    """The expert fields of a qwen3vlmoe file's text config: counts and width from its
    metadata (one width for every layer), and as dense (mlp_only_layers) the layers that
    store no router (llama.cpp writes none such, but a file may hold them)."""
    width = key("expert_feed_forward_length")
    if isinstance(width, list):
        if len(set(width)) != 1:
            raise CheckpointError(f"{path}: GGUF metadata '{MOE_ARCH}.expert_feed_forward_length' = {width}: expected "
                                  "one expert width for every layer")
        width = width[0]
    routed = {t.name.split(".")[1] for t in r.tensors if t.name.endswith(".ffn_gate_inp.weight")}
    return {"num_experts": key("expert_count"), "num_experts_per_tok": key("expert_used_count"),
            "moe_intermediate_size": width, "decoder_sparse_step": 1,
            "mlp_only_layers": [n for n in range(key("block_count")) if str(n) not in routed]}


def deepstack_layers(path) -> int:
    """The decoder layers that take DeepStack features (`qwen3vl.n_deepstack_layers`)."""
    r = reader(path)
    return int(field(r, f"{architecture(r)}.n_deepstack_layers", path, 0))


def text_tensors(path, cfg: TextConfig) -> dict:
    """{Hugging Face name: the reader's tensor} of every weight the config needs, each of a
    supported type and shape; CheckpointError naming the first that is missing, unknown, of
    an unsupported type or shape."""
    r = reader(path)
    found = {}
    for t in r.tensors:
        name = hf_name(t.name)
        if name is None:
            raise CheckpointError(f"{t.name}: a tensor of {path} that a Qwen3-VL language model does not have")
        check_type(t, path)
        found[name] = t
    out = {}
    for name, shape in weight_shapes(cfg):
        if name.endswith(GATE_UP):  # gate's and up's stacks, one weight of the graph
            parts = [found.get(f"{name}:{half}") for half in ("gate", "up")]
            if None in parts:
                raise CheckpointError(f"{path}: the tensors for {name} (ffn_gate_exps and ffn_up_exps) are missing")
            half = (shape[0], shape[1] // 2, shape[2])
            for t in parts:
                check_shape(t, half, path)
            if parts[0].tensor_type != parts[1].tensor_type:
                raise CheckpointError(f"{parts[1].name}: GGUF type {parts[1].tensor_type.name}: expected its gate's, "
                                      f"{parts[0].tensor_type.name} (in {path})")
            out[name] = parts  # a list: gguf's tensors are named tuples
            continue
        if name not in found:
            raise CheckpointError(f"{path}: the tensor for {name} is missing")
        check_shape(found[name], shape, path)
        out[name] = found[name]
    for name, t in out.items():
        first = t[0] if isinstance(t, list) else t
        if is_expert(name) and first.tensor_type.name not in (*FLOAT_TYPES, *EXPERT_TYPES):
            raise CheckpointError(f"{first.name}: GGUF type {first.tensor_type.name} for an expert stack is not "
                                  f"supported (in {path}); expected one of {', '.join(EXPERT_TYPES + FLOAT_TYPES)} "
                                  "(the K-quants of a Q4_K_M file have no expert kernel yet: take the model's Q4_0 "
                                  "or Q8_0 GGUF, or its safetensors with --precision q4_0)")
    return out


def check_shape(t, shape, path) -> None:
    if tuple(int(n) for n in reversed(t.shape)) != tuple(shape):
        raise CheckpointError(f"{t.name}: shape {list(reversed(t.shape.tolist()))} (expected {list(shape)}) "
                              f"(in {path})")


def check_type(t, path) -> None:
    """CheckpointError naming the tensor where its type is none of `TYPES`."""
    if t.tensor_type.name not in TYPES:
        raise CheckpointError(f"{t.name}: GGUF type {t.tensor_type.name} is not supported (in {path}); expected "
                              f"one of {', '.join(TYPES)}")


def native_entries(tensors: dict, keep=lambda name: True, packed=lambda name, t: is_expert(name)) -> tuple[tuple, ...]:
    """`quant.native_layouts`' entries of the quantized tensors of {Hugging Face name:
    the reader's tensor} for which `keep(name)`: each in its own bits (gguf_blocks.LAYOUTS);
    those for which `packed(name, t)` (an expert stack; the language model's `on_kernel`) in
    the block kernel's tiles (form `quant.PACKED`, its ISA for the runtime to add)."""
    out = []
    for name, t in tensors.items():
        kind = (t[0] if isinstance(t, list) else t).tensor_type.name
        if kind in LAYOUTS and keep(name):
            layout = LAYOUTS[kind]
            tiles = quant.Q6_K_TILES if kind == Q6_K else layout  # the kernel's form: Q6_K's d per 256
            out.append((name, tiles.bits, tiles.group, quant.PACKED) if packed(name, t)
                       else quant.native_entry(name, layout))
    return tuple(out)


def on_kernel(name: str, t) -> bool:
    """A language-model tensor that runs through the block kernel in its bits, as llama.cpp
    runs it (its rows' activations in Q8_0 blocks): an expert stack, any Q8_0 or Q4_0 matrix
    whose rows fill the kernel's tiles (`quant.Layout`'s 32), and any such Q6_K matrix but the
    embedding table (lm_head of llama.cpp's Q4_0 files: the q6k entry, int8 scales per 16, d
    per 256; the table's rows are gathered on the native path, and a tied head with it). The
    others, in their bits, are dequantized per call against f32 activations."""
    first = t[0] if isinstance(t, list) else t
    kind, rows = first.tensor_type.name, int(first.shape[1])
    if kind == Q6_K:
        return name != TEXT_PREFIX + EMBEDDING and len(first.shape) == 2 and rows % 32 == 0
    return is_expert(name) or (kind in KERNEL_TYPES and rows % 32 == 0)


def native_arrays(name: str, t, pending: dict) -> np.ndarray:
    """q of one tensor in its bits, as the archive holds it (`gguf_blocks.in_bits`); its
    scales and any biases put in `pending` under their names, for the graph's next weights."""
    q, pending[quant.scales_name(name)], biases = in_bits(t)
    if biases is not None:
        pending[quant.biases_name(name)] = biases
    return q


def dequantized(t) -> np.ndarray:
    """One tensor as exact f32 in its logical shape (`gguf.quants.dequantize`); gate's and
    up's expert stacks as one [E, 2I, D]."""
    from gguf.quants import dequantize

    if isinstance(t, list):
        return np.concatenate([dequantized(part) for part in t], axis=1)
    shape = tuple(int(n) for n in reversed(t.shape))
    return np.asarray(dequantize(t.data, t.tensor_type), np.float32).reshape(shape)


def packed_blocks(name: str, t) -> tuple[np.ndarray, np.ndarray]:
    """A matrix of Q8_0 or Q4_0 blocks, or an expert stack of them (gate's and up's as one,
    gate rows first), in the block kernel's tiles as it is: its (each expert's) codes and f16
    scales repacked (kernels/q8_matmul.py `pack_weight`, `pack_scales`), not a bit changed.
    ([N, K * bits / 8] i8 and [N, K / 32] f16; a stack's [E, ...] of each.)"""
    from kernels.build import KernelError
    from kernels.q8_matmul import pack_scales, pack_weight
    from runtime.checkpoints.gguf_blocks import signed

    parts = t if isinstance(t, list) else [t]
    kind = parts[0].tensor_type.name
    if kind == Q6_K:
        return packed_q6_k(parts[0])
    bits = LAYOUTS[kind].bits
    stack = len(parts[0].shape) == 3
    raws = [np.asarray(p.data, np.uint8).reshape(int(p.shape[2]) if stack else 1, int(p.shape[1]), -1)
            for p in parts]
    k = int(parts[0].shape[0])
    qs, scales = [], []
    for e in range(raws[0].shape[0]):
        rows = [signed(kind, raw[e].reshape(raw.shape[1], k // 32, -1)) for raw in raws]
        q = np.concatenate([r[0] for r in rows])
        try:
            qs.append(pack_weight(q, bits).reshape(q.shape[0], -1))
        except KernelError as err:
            raise CheckpointError(f"{parts[0].name}: " + (f"expert {e}: " if stack else "") + str(err)) from None
        scales.append(pack_scales(np.concatenate([r[1] for r in rows]).astype(np.float16)).reshape(q.shape[0], -1))
    return (np.stack(qs), np.stack(scales)) if stack else (qs[0], scales[0])


def packed_q6_k(t) -> tuple[np.ndarray, np.ndarray]:
    """A Q6_K matrix in the kernel's tiles as it is (`packed_blocks`' form for the q6k entry):
    its codes and int8 sub-scales ([N, K * 13 / 16] i8: kernels/q8_matmul.py `pack_q6_k`) and
    its f16 d ([N, K / 256], `pack_scales`), not a bit changed."""
    from kernels.build import KernelError
    from kernels.q8_matmul import SUPER, pack_q6_k, pack_scales
    from runtime.checkpoints.gguf_blocks import q6_k_parts, shape_of

    n, k = shape_of(t)
    q, sc, d = q6_k_parts(np.asarray(t.data, np.uint8).reshape(n, k // SUPER, -1))
    try:
        return pack_q6_k(q, sc).reshape(n, -1), pack_scales(d).reshape(n, -1)
    except KernelError as err:
        raise CheckpointError(f"{t.name}: {err}") from None


def native_weights(path, cfg: TextConfig) -> tuple[tuple, ...]:
    """The entries of the quantized weights, each in its own bits (`native_entries`,
    `TextConfig.native_weights`)."""
    return native_entries(text_tensors(path, cfg), packed=on_kernel)


def load_text_weights(path, cfg: TextConfig) -> dict[str, np.ndarray]:
    """The decoder's weights as exact f32 (`dequantized`), keyed by Hugging Face name."""
    return {name: dequantized(t) for name, t in text_tensors(path, cfg).items()}


def text_arrays(path, cfg: TextConfig, precision: str = "f32") -> Iterator:
    """(name, array) in graph order (`text_weights(cfg, precision)`), yielded one at a time,
    as the graph takes them: the weights of `cfg.native_weights` in their bits (`native_arrays`), the rest f32
    (or the precision's bf16 / int8 / int4, as for a folder)."""
    import ml_dtypes

    tensors = text_tensors(path, cfg)
    layouts = weight_layouts(cfg, precision, list(tensors))
    native = {entry[0] for entry in cfg.native_weights}
    pending = {}
    for s in text_weights(cfg, precision):
        if s.name in pending:
            yield (s.name, pending.pop(s.name))
            continue
        layout, t = layouts.get(s.name), tensors[s.name]
        if s.name in native and layout.packed:
            q, pending[quant.scales_name(s.name)] = packed_blocks(s.name, t)
        elif s.name in native:
            q = native_arrays(s.name, t, pending)
        elif layout:
            q, pending[quant.scales_name(s.name)] = layout.store(dequantized(t))
        else:
            w = dequantized(t)
            q = w if s.dtype == "f32" else w.astype(ml_dtypes.bfloat16)
        yield (s.name, q)


def content_fields(path, digest) -> dict:
    """What decides an archive's bytes from this file: its sha256, `digest(file)`."""
    return {"gguf_sha256": digest(text_file(path))}


# Qwen2's pre-tokenizer split (tokenizer.json of the Qwen2/Qwen3 models; llama.cpp's `qwen2` pre)
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")
CONTROL, USER_DEFINED = 3, 4  # gguf.TokenType: the converter's special and non-special added tokens


def tokenizer(path):
    """The file's byte-level BPE (`tokenizer.ggml.*`, model gpt2, pre qwen2) as a `tokenizers`
    Tokenizer, the way Qwen's tokenizer.json builds it: Qwen2's split then byte-level, the
    CONTROL tokens added as special tokens and the USER_DEFINED ones (`<think>`, ...) as
    added tokens that are not special."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    r = reader(path)
    model, pre = field(r, "tokenizer.ggml.model", path), field(r, "tokenizer.ggml.pre", path, "")
    if model != "gpt2" or pre != "qwen2":
        raise CheckpointError(f"{path}: tokenizer.ggml.model {model!r}, pre {pre!r}: expected 'gpt2', 'qwen2' "
                              "(Qwen's byte-level BPE)")
    tokens, types = field(r, "tokenizer.ggml.tokens", path), field(r, "tokenizer.ggml.token_type", path)
    merges = [tuple(m.split(" ", 1)) for m in field(r, "tokenizer.ggml.merges", path)]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    added = [AddedToken(t, special=ty == CONTROL, normalized=False) for t, ty in zip(tokens, types)
             if ty in (CONTROL, USER_DEFINED)]
    tok.add_tokens(added)  # ids are the vocabulary's own (each is already in it)
    tok.add_special_tokens([a for a in added if a.special])
    return tok


def chat_settings(path) -> tuple[str, tuple[int, ...], dict]:
    """The chat template (`tokenizer.chat_template`), the EOS ids (eos, then eot where the
    file names one) and the special tokens as tokenizer_config.json would name them."""
    r = reader(path)
    template = field(r, "tokenizer.chat_template", path, "")
    if not template:
        raise CheckpointError(f"{path}: no chat template (expected GGUF metadata 'tokenizer.chat_template')")
    tokens = field(r, "tokenizer.ggml.tokens", path)
    eos = [field(r, f"tokenizer.ggml.{k}_token_id", path, -1) for k in ("eos", "eot")]
    ids = tuple(dict.fromkeys(i for i in eos if i >= 0))
    config = {"eos_token": tokens[ids[0]]} if ids else {}
    pad = field(r, "tokenizer.ggml.padding_token_id", path, -1)
    if pad >= 0:
        config["pad_token"] = tokens[pad]
    return template, ids, config
