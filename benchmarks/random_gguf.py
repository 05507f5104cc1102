"""A random llama.cpp GGUF text file of any layer count, drawn in its bits: a model too large to
write in f32 first (the full Qwen3-VL-30B-A3B: 120 GB in f32, about 17 GB in Q4_0).

It takes a small file llama.cpp's converter and llama-quantize wrote for the same preset at
fewer layers (benchmarks/bench_llamacpp.py --layers N: its tokenizer, metadata, embedding table
and output head, each tensor's name pattern and type), and writes `--layers` blocks, each
block's tensors of the template block's types and shapes with new random contents: Q4_0 and
Q8_0 blocks drawn as codes and f16 scales (values about N(0, 1 / inputs); down and attention
outputs at half gain, as runtime/checkpoints/synthetic_text.py draws its f32 weights), F32
norms at 1 + 0.1 N(0, 1) and F32 routers at N(0, 1 / inputs). Written a tensor at a time
(gguf's GGUFWriter, its tensor infos first), so memory stays near one expert stack.

    .venv/bin/python benchmarks/random_gguf.py TEMPLATE.gguf OUT.gguf --layers 48

This is a benchmark's helper, not a test; nothing imports it but the benchmarks.
"""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path

import numpy as np

BLOCK = 32
GAINS = {"ffn_down": 0.5, "ffn_down_exps": 0.5, "attn_output": 0.5}
LEVELS = {"Q4_0": 8, "Q8_0": 127}  # the codes' reach either side of zero


def blocks(kind: str, shape: tuple[int, ...], gain: float, rng) -> np.ndarray:
    """Random Q4_0 / Q8_0 bytes of a weight of logical `shape` (last dim the inputs): each block
    of 32 an f16 scale and its codes, drawn so the values are about N(0, gain^2 / inputs)."""
    rows, k = int(np.prod(shape[:-1])), shape[-1]
    nb = k // BLOCK
    spread = LEVELS[kind] / 3  # codes ~ N(0, spread^2), clipped at the type's reach
    scale = np.float16(gain / np.sqrt(k) / spread)
    codes = np.clip(np.rint(rng.standard_normal((rows, nb, BLOCK), dtype=np.float32) * spread),
                    -LEVELS[kind], LEVELS[kind] - (kind == "Q4_0")).astype(np.int8)
    d = np.full((rows, nb, 1), scale, np.float16).view(np.uint8)
    if kind == "Q8_0":
        body = codes.view(np.uint8)
    else:  # Q4_0: element j in the low nibble of byte j, j + 16 in its high one, as u = q + 8
        u = (codes + 8).astype(np.uint8)
        body = u[..., :16] | (u[..., 16:] << np.uint8(4))
    return np.concatenate([d, body], axis=-1).reshape(*shape[:-1], -1)


def contents(name: str, kind: str, shape: tuple[int, ...], rng) -> np.ndarray:
    """A tensor's new random contents (see the module docstring)."""
    part = name.split(".")[2]
    if kind in LEVELS:
        return blocks(kind, shape, GAINS.get(part, 1.0), rng)
    if kind != "F32":
        raise ValueError(f"{name}: template type {kind}: expected Q4_0, Q8_0 or F32 in a block")
    z = rng.standard_normal(shape, dtype=np.float32)
    return 1 + np.float32(0.1) * z if part.endswith("norm") else z / np.float32(np.sqrt(shape[-1]))


def write(template: Path, out: Path, layers: int, seed: int = 0) -> None:
    import gguf

    r = gguf.GGUFReader(template)
    arch = r.fields["general.architecture"].contents()
    first = [t for t in r.tensors if t.name.startswith("blk.0.")]
    w = gguf.GGUFWriter(str(out), arch=arch)
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = layers if key == f"{arch}.block_count" else f.contents()
        if f.types[0] == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, value, f.types[0], sub_type=f.types[-1])
        else:
            w.add_key_value(key, value, f.types[0])
    plan = []  # (name, the template's tensor, new contents or None: copied)
    for t in r.tensors:
        if not t.name.startswith("blk."):
            plan.append((t.name, t, None))
    for n in range(layers):
        plan += [(re.sub(r"^blk\.0\.", f"blk.{n}.", t.name), t, t.tensor_type.name) for t in first]
    for name, t, kind in plan:
        data = np.asarray(t.data)
        w.add_tensor_info(name, data.shape, data.dtype, data.nbytes, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    start = time.perf_counter()
    for name, t, kind in plan:
        shape = tuple(int(x) for x in reversed(t.shape))
        data = np.asarray(t.data) if kind is None else contents(name, kind, shape, rng)
        w.write_tensor_data(np.ascontiguousarray(data).reshape(np.asarray(t.data).shape))
    w.close()
    print(f"wrote {out}: {layers} blocks, {out.stat().st_size / 1e9:.2f} GB in {time.perf_counter() - start:.0f} s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("template", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    write(args.template, args.out, args.layers, args.seed)


if __name__ == "__main__":
    main()
