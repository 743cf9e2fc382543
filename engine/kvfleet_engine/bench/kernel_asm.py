"""Compile the quantized-product kernels for an H100 / H200 (sm_90) on a machine without a GPU
and read their generated code: Triton's real frontend, its NVIDIA backend and the bundled ptxas
run on the CPU, so a config that cannot compile on the GPU fails here too (the interpreter
accepts code the compiler rejects), and the PTX / SASS show what each thread loads and how many
instructions the dequantize costs.

`sm90_compiles()` swaps in a driver that reports an sm_90 target and turns every kernel launch
inside it into a compile-only warm-up (nothing runs; tensors may be CPU tensors), recording the
compiled kernels; `stats` counts what matters in one: global loads by width, shared-memory
traffic, integer / float / tensor-core instructions, registers, spills, shared memory.

    python -m kvfleet_engine.bench.kernel_asm int4 1 28672 4096 \\
        '{"kernel": "gemv", "block_m": 1, "block_n": 128, "block_k": 64, "split_k": 4}'
    python -m kvfleet_engine.bench.kernel_asm fp8 1 6144 4096 '{"block_m": 16, ...}' --sass
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver as driver_config
from triton.runtime.jit import JITFunction

ARCH = 90  # H100 / H200
CUOBJDUMP = os.path.join(
    os.path.dirname(str(triton.__file__)), "backends", "nvidia", "bin", "cuobjdump"
)


class _CompileOnlyDriver:
    """The parts of Triton's CUDA driver that compiling needs: device 0, an sm_`arch` target."""

    def __init__(self, arch: int) -> None:
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


@dataclass
class Compiled:
    name: str  # the kernel function's name
    kernel: Any  # triton.compiler.CompiledKernel


@contextlib.contextmanager
def sm90_compiles(arch: int = ARCH) -> Iterator[list[Compiled]]:
    """Inside: launches compile for sm_`arch` and do not run; yields the list they append to."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("kernel_asm compiles: unset TRITON_INTERPRET (the interpreter runs)")
    compiled: list[Compiled] = []
    original = JITFunction.__getitem__

    def compile_only(self: JITFunction, grid: Any) -> Any:
        def launch(*args: Any, **kwargs: Any) -> None:
            kernel = self.run(*args, grid=grid, warmup=True, **kwargs)
            compiled.append(Compiled(self.fn.__name__, kernel))

        return launch

    previous = driver_config._active
    driver_config.set_active(_CompileOnlyDriver(arch))
    JITFunction.__getitem__ = compile_only
    try:
        yield compiled
    finally:
        JITFunction.__getitem__ = original
        driver_config._active = previous


LOAD = re.compile(r"\bld\.global\S*?(?:\.v(\d))?\.[bsuf](\d+)\s")  # (vector, bits)
SASS_OPS = ("LDG", "LDS", "LDSM", "STS", "LDGSTS", "LOP3", "SHF", "PRMT", "I2F", "F2F",
            "I2FP", "FFMA", "FMUL", "FADD", "HFMA2", "HADD2", "HMUL2", "HMMA", "HGMMA", "IMAD",
            "BAR", "RED", "ATOM")  # fmt: skip


def _resources(cubin: bytes) -> dict[str, int]:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        text = subprocess.run(
            [CUOBJDUMP, "-res-usage", file.name], capture_output=True, text=True, check=True
        ).stdout
    found = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", text))
    return {key.lower(): int(value) for key, value in found.items()}


def sass(kernel: Any) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(kernel.asm["cubin"])
        file.flush()
        return subprocess.run(
            [CUOBJDUMP, "-sass", file.name], capture_output=True, text=True, check=True
        ).stdout


SASS_LINE = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)([^;]*);")


def loop_ops(code: str) -> dict[str, Any]:
    """SASS op counts of the largest loop (a backward branch's range: the K loop of a product
    kernel), as counted per iteration; {} without a loop."""
    lines = [(int(a, 16), op, rest) for a, op, rest in SASS_LINE.findall(code)]
    best: tuple[int, int] | None = None
    for address, op, rest in lines:
        target = re.search(r"0x([0-9a-f]+)\s*$", rest.strip())
        if op == "BRA" and target and int(target.group(1), 16) < address:
            start = int(target.group(1), 16)
            if best is None or address - start > best[1] - best[0]:
                best = (start, address)
    if best is None:
        return {}
    ops = Counter(op if op in SASS_OPS else "LDG" if op.startswith("LDG") else "other"
                  for address, op, _ in lines if best[0] <= address <= best[1])  # fmt: skip
    return {"instructions": sum(ops.values()), **dict(ops)}


def stats(kernel: Any) -> dict[str, Any]:
    """Registers, spills (local bytes), shared memory, PTX global loads by bytes per thread and
    static SASS counts of the instructions that matter for a dequantizing product."""
    ptx = kernel.asm["ptx"]
    loads: Counter[int] = Counter()
    for vec, bits in LOAD.findall(ptx):
        loads[int(vec or 1) * int(bits) // 8] += 1
    code = sass(kernel)
    ops: Counter[str] = Counter()
    total = 0
    for line in code.splitlines():
        match = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if match:
            total += 1
            op = match.group(1)
            if op in SASS_OPS:
                ops[op] += 1
            elif op.startswith("LDG"):
                ops["LDG"] += 1
    wide = re.findall(r"\bLDG\.E(?:\.[A-Z0-9_]+)*", code)
    resources = _resources(kernel.asm["cubin"])
    return {
        "registers": resources.get("reg", -1),
        "spill_bytes": resources.get("local", 0) + resources.get("stack", 0),
        "shared_bytes": kernel.metadata.shared,
        "ptx_global_loads_by_bytes": dict(sorted(loads.items())),
        "sass_ldg": dict(Counter(wide)),
        "sass_ops": dict(ops),
        "sass_instructions": total,
        "loop": loop_ops(code),
    }


def compile_plan(kind: str, m: int, n: int, k: int, plan: dict[str, Any]) -> list[Compiled]:
    """Compile (for sm_90, nothing runs) the kernels one plan launches for an [m, k] x [k, n]
    product of `kind` ("int4" group 128, "int8", "fp8" weight-only GEMV, "fp8-w8a8" with
    plan {"blocks": [...]}) on CPU tensors of the kernels' layouts."""
    from kvfleet_engine.kernels import fp8_gemv, int_plan
    from kvfleet_engine.kernels import fp8_matmul as fp8
    from kvfleet_engine.kernels import int4_matmul as ints

    x = torch.zeros(m, k, dtype=torch.bfloat16)  # [M, K]
    with sm90_compiles() as compiled:
        if kind in ("int4", "int8"):
            group = 128 if kind == "int4" else k
            rows = k // 8 if kind == "int4" else k
            dtype = torch.int32 if kind == "int4" else torch.int8
            qweight = torch.zeros(rows, n, dtype=dtype)  # int4: [K/8, N]; int8: [K, N]
            scales = torch.ones(k // group, n, dtype=torch.bfloat16)  # [K/g, N]
            offsets = torch.zeros(k // group, n, dtype=torch.bfloat16) if kind == "int4" else None
            ints.launch(x, qweight, scales, offsets, group, int_plan.plan_from_dict(plan))
        elif kind == "fp8":
            weight = torch.zeros(n, k, dtype=fp8.FP8_DTYPE)  # [N, K]
            scale = torch.ones(n, dtype=torch.float32)  # [N]
            fp8_gemv.fp8_gemv(x, weight, scale, torch.bfloat16, fp8_gemv.Fp8GemvPlan(**plan))
        elif kind == "fp8-w8a8":
            weight = torch.zeros(n, k, dtype=fp8.FP8_DTYPE)  # [N, K]
            x_q = torch.zeros(m, k, dtype=fp8.FP8_DTYPE)  # [M, K]
            x_scale = torch.ones(m, 1, dtype=torch.float32)  # [M, 1]
            scale = torch.ones(n, dtype=torch.float32)  # [N]
            fp8.triton_fp8_gemm(x_q, x_scale, weight, scale, torch.bfloat16, tuple(plan["blocks"]))
        else:
            raise ValueError(f"kind {kind!r} unknown; allowed: int4, int8, fp8, fp8-w8a8")
    return compiled


# The products whose compiles differ: (kind, N, K) per dispatch form (int8's one group of K;
# Triton specializes integers equal to 1, so one row compiles apart from more rows).
COMPILE_SHAPES = {"int4": (4096, 4096), "int8": (4096, 4096), "fp8": (4096, 4096)}


def compile_jobs(
    rows: list[int], *, sweep: bool = True
) -> list[tuple[str, int, int, int, dict[str, Any]]]:
    """Every distinct compile of the plan tables (kernels/quant_plans.json) and, with `sweep`, of
    the sweep's candidates at these rows (`bench.quant_candidates`; the default rules' kernels
    come with them): (kind, rows, N, K, plan), split-K fixed at 2 (not a compile-time constant)."""
    from kvfleet_engine.bench import quant_candidates
    from kvfleet_engine.kernels import int_plan

    jobs: dict[str, tuple[str, int, int, int, dict[str, Any]]] = {}

    def add(kind: str, m: int, plan: dict[str, Any]) -> None:
        n, k = COMPILE_SHAPES["fp8" if kind.startswith("fp8") else kind]
        if kind == "fp8" or plan.get("kernel") in ("gemv", "lean", "dot", "mma"):
            plan = plan | {"split_k": 2}
        if plan.get("kernel") == "gemv":
            plan = plan | {"block_m": 1 if m == 1 else next_pow2(m)}
        key = json.dumps([kind, m == 1, m if plan.get("kernel") == "gemv" else 0, plan],
                         sort_keys=True)  # fmt: skip
        jobs.setdefault(key, (kind, m, n, k, plan))

    for m in rows if sweep else []:
        for kind in ("int4", "int8", "fp8"):
            for config in quant_candidates.configs(kind, m):
                family, plan = config["family"], dict(config["plan"])
                if family == "int" and plan["kernel"] != "dequantize":
                    add(kind, m, plan)
                elif family == "fp8-gemv":
                    add("fp8", m, plan)
                elif family == "fp8-w8a8-triton":
                    add("fp8-w8a8", m, plan)
    with open(int_plan.BAKED_PLANS) as file:
        for entry in json.load(file)["plans"]:
            plan = entry["plan"]
            if entry["kind"] == "fp8" or plan.get("kernel") != "dequantize":
                add(entry["kind"], entry["rows"], plan)
    return list(jobs.values())


def next_pow2(m: int) -> int:
    return 1 << (m - 1).bit_length()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvfleet_engine.bench.kernel_asm")
    parser.add_argument("kind", choices=["int4", "int8", "fp8", "fp8-w8a8", "sweep"])
    parser.add_argument("rows", help="rows of x (sweep: comma-separated)")
    parser.add_argument("n", type=int, nargs="?", default=0)
    parser.add_argument("k", type=int, nargs="?", default=0)
    parser.add_argument("plan", nargs="?", default="{}", help="plan fields as JSON (MatmulPlan, "
                        "Fp8GemvPlan; fp8-w8a8: blocks)")  # fmt: skip
    parser.add_argument("--sass", action="store_true", help="print the main kernel's SASS")
    parser.add_argument("--ptx", action="store_true", help="print the main kernel's PTX")
    args = parser.parse_args(argv)
    if args.kind == "sweep":  # every sweep / plan-table compile: stats per job, failures
        failed = 0
        for kind, m, n, k, plan in compile_jobs([int(r) for r in args.rows.split(",")]):
            try:
                found = compile_plan(kind, m, n, k, plan)
                print(kind, m, json.dumps(plan), json.dumps(stats(found[0].kernel)))
            except Exception as error:  # reported, then counted
                failed += 1
                print(kind, m, json.dumps(plan), "FAILED", type(error).__name__, str(error)[:200])
        return 1 if failed else 0
    args.rows = int(args.rows)
    compiled = compile_plan(args.kind, args.rows, args.n, args.k, json.loads(args.plan))
    for item in compiled:
        print(item.name, json.dumps(stats(item.kernel)))
    if compiled and args.sass:
        print(sass(compiled[0].kernel))
    if compiled and args.ptx:
        print(compiled[0].kernel.asm["ptx"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
