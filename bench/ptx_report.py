"""Compile the Triton kernels for a GPU target without a GPU and report what the hardware will run:
the width of every global load and store, the rounding of divisions and square roots, FMAs,
registers and spills per thread.

    python bench/ptx_report.py                 # sm_90 (H100/H200), a markdown table
    python bench/ptx_report.py --arch 80       # A100
    python bench/ptx_report.py --json out.json # also machine-readable (tests/numerics/test_triton_codegen.py)

Aligned full blocks must use 16-byte accesses for 4-byte data (``v4.b32``), and the arithmetic
that must equal the CPU's bits must compile to ``div.rn``/``sqrt.rn`` with no ``fma``: checked
here before any GPU time is spent. Run without ``TRITON_INTERPRET=1`` (the interpreter replaces
the compiled kernels).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dist_sr.numerics.backends.triton import kernels as tk  # noqa: E402
from dist_sr.numerics.backends.triton import keys as triton_keys  # noqa: E402
from dist_sr.numerics.backends.triton.launcher import ADAMW_BLOCK, ADAMW_WARPS, FP_OPTIONS, SR_BLOCK, SR_WARPS  # noqa: E402
from dist_sr.numerics.key import STEP_BYTE  # noqa: E402

DIV16 = [["tt.divisibility", 16]]
SR_MANY = {"meta": "*i64", "bmap": "*i64", "keys": "*i64", "T": "i32"}
ADAMW_MANY = {
    "meta": "*i64",
    "bmap": "*i64",
    "keys": "*i64",
    "step_data": "*i64",
    "consts": "*fp32",
    "scale_ptr": "*fp32",
    "T": "i32",
}
SR_ONE = {"x_ptr": "*i32", "out_ptr": "*i16", "n": "i64", "g0": "i64", "key": "i64"}
SR_ROWS = {**SR_ONE, "row_len": "i64", "row_stride": "i64"}
STEP_DATA = {
    "tmpl": "*i64",
    "lens": "*i64",
    "sigma": "*i64",
    "step_ptr": "*i64",
    "keys": "*i64",
    "T": "i32",
    "hyper": "*fp64",
    "consts": "*fp32",
    "S": "i32",
    "NB": "i32",
}


def compile_variant(
    fn, signature: dict, constexprs: dict, arch: int = 90, aligned_args=(), fp_fusion: bool = False, num_warps: int = 8
):
    names = list(signature)
    attrs = {(names.index(a),): DIV16 for a in aligned_args}
    src = triton.compiler.ASTSource(
        fn=fn, signature={**signature, **{k: "constexpr" for k in constexprs}}, constexprs=constexprs, attrs=attrs
    )
    return triton.compile(
        src, target=GPUTarget("cuda", arch, 32), options={"enable_fp_fusion": fp_fusion, "num_warps": num_warps}
    )


def registers(ptx: str, arch: int) -> tuple[int, int]:
    """(registers, spill bytes) per thread, from the ptxas bundled with Triton."""
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    log = ""
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(ptx)
        for ptxas in (bin_dir / "ptxas", bin_dir / "ptxas-blackwell"):  # the one that knows this PTX version
            run = subprocess.run(
                [
                    str(ptxas),
                    f"--gpu-name=sm_{arch}a" if arch >= 90 else f"--gpu-name=sm_{arch}",
                    "-v",
                    str(src),
                    "-o",
                    str(Path(d) / "k.cubin"),
                ],
                capture_output=True,
                text=True,
            )
            log = run.stderr
            if run.returncode == 0:
                break
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores", log)
    return int(regs.group(1)) if regs else -1, int(spill.group(1)) if spill else 0


def accesses(ptx: str) -> Counter:
    return Counter(re.findall(r"(?:ld|st)\.global(?:\.[a-z0-9]+)*", ptx))


def arithmetic(ptx: str) -> list[str]:
    return sorted(set(re.findall(r"(?:div|sqrt)\.[a-z]+\.f(?:32|64)|fma\.rn\.f(?:32|64)", ptx)))


def variants(block_sr: int = SR_BLOCK, block_adamw: int = ADAMW_BLOCK):
    """(name, kernel, signature, constexprs, args known 16-byte aligned, FMA contraction allowed)."""
    fusion = not FP_OPTIONS["enable_fp_fusion"]  # what the code launches with is False: no contraction
    yield (
        "step_data (device keys)",
        triton_keys.step_data_kernel,
        STEP_DATA,
        dict(STEP_BYTE=STEP_BYTE, KEYED_STEP=True, BT=64, BS=2),
        (),
        not fusion,
    )
    for keyed in (True, False):
        for aligned in (True, False):
            yield (
                f"sr_many keyed={keyed} aligned={aligned}",
                tk.sr_many_kernel,
                SR_MANY,
                dict(KEYED=keyed, ALIGNED=aligned, BLOCK=block_sr),
                (),
                False,
            )
    yield (
        "sr_one keyed aligned args",
        tk.sr_one_kernel,
        SR_ONE,
        dict(KEYED=True, ALIGNED=True, BLOCK=block_sr),
        ("x_ptr", "out_ptr"),
        False,
    )
    yield ("block_map", tk.block_map_kernel, {"starts": "*i64", "bmap": "*i64"}, dict(CHUNK=1024), (), False)
    yield ("sr_rows keyed", tk.sr_rows_kernel, SR_ROWS, dict(KEYED=True, BLOCK=block_sr), (), False)
    for pure, moment_bf16 in ((False, False), (True, False), (True, True)):
        for grad_bf16 in (True, False):
            for aligned in (True, False):
                yield (
                    f"adamw_many pure={pure} moments_bf16={moment_bf16} grad_bf16={grad_bf16} aligned={aligned}",
                    tk.adamw_many_kernel,
                    ADAMW_MANY,
                    dict(
                        KEYED=True,
                        ALIGNED=aligned,
                        GRAD_BF16=grad_bf16,
                        PURE=pure,
                        MOMENT_BF16=moment_bf16,
                        BLOCK=block_adamw,
                    ),
                    (),
                    not fusion,
                )
    yield (
        "adamw_many shadow, contraction allowed (control)",
        tk.adamw_many_kernel,
        ADAMW_MANY,
        dict(KEYED=True, ALIGNED=True, GRAD_BF16=True, PURE=False, MOMENT_BF16=False, BLOCK=block_adamw),
        (),
        True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--no-registers", action="store_true", help="skip ptxas (faster)")
    args = ap.parse_args()
    print(
        f"# Triton {triton.__version__}, sm_{args.arch}; launch shapes SR {SR_BLOCK} x {SR_WARPS} warps, "
        f"AdamW {ADAMW_BLOCK} x {ADAMW_WARPS} warps\n\n| kernel | registers | spills | global accesses | "
        "div/sqrt/fma |\n|---|---:|---:|---|---|"
    )
    record = {}
    for name, fn, sig, constexprs, aligned_args, fusion in variants():
        warps = ADAMW_WARPS if fn is tk.adamw_many_kernel else SR_WARPS if fn is not triton_keys.step_data_kernel else 8
        ptx = compile_variant(fn, sig, constexprs, args.arch, aligned_args, fp_fusion=fusion, num_warps=warps).asm[
            "ptx"
        ]
        regs, spills = (-1, -1) if args.no_registers else registers(ptx, args.arch)
        acc, ops = accesses(ptx), arithmetic(ptx)
        record[name] = {"accesses": dict(acc), "arithmetic": ops, "registers": regs, "spills": spills}
        print(
            f"| {name} | {regs} | {spills} | {', '.join(f'{op} x{c}' for op, c in sorted(acc.items()))} | "
            f"{', '.join(ops)} |"
        )
    if args.json:
        args.json.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
