"""Writes docs/rounding-key-vectors.json from the plain-Python definition in dist_sr.numerics.key.

The file is the contract's fixed point: every backend is tested against it, so regenerate it
only when the key derivation changes on purpose (and bump the key's version tag).
"""

import json
import random
import struct
import sys
from pathlib import Path

from dist_sr.numerics.key import normalize_param_name, random_bits, round_bits, stream_key

SPECIAL = [
    0x00000000,
    0x80000000,  # +0, -0
    0x7F800000,
    0xFF800000,  # +-Inf
    0x7F800001,
    0x7FC00000,
    0x7FFFFFFF,
    0xFFFFFFFF,
    0xFF800001,
    0x7F80FFFF,
    0xFFC00001,  # NaNs
    0x00000001,
    0x0000FFFF,
    0x00008000,
    0x00010000,
    0x007FFFFF,
    0x807FFFFF,
    0x80000001,  # subnormals
    0x7F7F0000,
    0x7F7F7FFF,
    0x7F7F8000,
    0x7F7FFFFF,
    0xFF7FFFFF,
    0xFF7F8001,  # near the BF16 max
    0x3F800000,
    0x3F800001,
    0x3F808000,
    0x3F80FFFF,
    0xBF80FFFF,
    0x3FFFFFFF,  # around 1.0
]

NAMES = [
    "model.layers.0.self_attn.q_proj.weight",
    "module.model.layers.0.self_attn.q_proj.weight",
    "_orig_mod.module.model.embed_tokens.weight",
    "model.layers.3._fsdp_wrapped_module.mlp._checkpoint_wrapped_module.down_proj.weight",
    "module.module.lm_head.weight",
    "encoder.module.weight",
    "module",
]


def f32_bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


def case(seed, step, param, mode, offset, xs):
    key = stream_key(seed=seed, step=step, param=param, mode=mode) if mode != "nearest" else None
    out = [round_bits(b, None if key is None else random_bits(key, offset + j)) for j, b in enumerate(xs)]
    return {
        "seed": seed,
        "step": step,
        "param": param,
        "mode": mode,
        "offset": offset,
        "stream_key": None if key is None else f"{key:016x}",
        "x_bits": [f"{b:08x}" for b in xs],
        "expected_bf16_bits": [f"{b:04x}" for b in out],
    }


def main(path: Path) -> None:
    rng = random.Random(20261129)
    rand = [f32_bits(rng.gauss(0, 1) * 10 ** rng.randint(-6, 3)) for _ in range(100)]
    cases = []
    for mode in ("stochastic", "dither", "nearest"):
        cases.append(case(1234, 7, "model.layers.0.self_attn.q_proj.weight", mode, 0, SPECIAL))
    for seed, step, name, offset in [
        (0, 0, "w", 0),
        (1234, 1, "lm_head.weight", 3),
        (2**64 - 1, 2**40, "model.norm.weight", 1_000_003),
        (42, 99, "module.model.embed_tokens.weight", 2**40 + 5),
    ]:
        for mode in ("stochastic", "dither"):
            cases.append(case(seed, step, name, mode, offset, rand))
    stream = {"key": "0123456789abcdef", "first_block_hashes": []}
    from dist_sr.numerics.key import GAMMA, splitmix64_mix

    k = int(stream["key"], 16)
    stream["first_block_hashes"] = [f"{splitmix64_mix(k + (q + 1) * GAMMA):016x}" for q in range(4)]
    doc = {
        "version": "dist-sr/v1",
        "about": "see docs/rounding-key.md; hex strings are raw bits (FP32 input, BF16 output)",
        "names": [{"raw": n, "normalized": normalize_param_name(n)} for n in NAMES],
        "splitmix64": stream,
        "cases": cases,
    }
    path.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/rounding-key-vectors.json"))
