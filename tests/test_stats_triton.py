"""The fused Triton statistics kernel (``distgrad.stats.triton_kernel``) in CI, without a GPU:

- under Triton's interpreter on CPU tensors: tests/stats_triton_cases.py (against float64 and
  the native CPU kernel, chunk/block boundaries, NaN/Inf/-0.0, empty pieces, bf16/fp16, grid
  independence, the table cache, the forced kernel through ``stats_table``), run in a fresh
  process with ``TRITON_INTERPRET=1``, which must be set before anything imports triton (other
  tests import it through torch.compile);
- the compiled kernels lowered to a cubin for sm_90 (no GPU needed to compile);
- the 2-rank PyTorch reference driver with ``DISTGRAD_STATS_KERNEL=triton``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def test_triton_kernel_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop("DISTGRAD_TEST_DEVICE", None)
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                        str(HERE / "stats_triton_cases.py")], env=env, cwd=HERE.parent, capture_output=True,
                       text=True, timeout=1200)
    assert p.returncode == 0, f"{p.stdout[-8000:]}\n{p.stderr[-3000:]}"
    assert " passed" in p.stdout and "skipped" not in p.stdout and "deselected" not in p.stdout, p.stdout[-2000:]


_COMPILE_SCRIPT = r"""
import json, re, sys
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from distgrad.stats import triton_jit as k, triton_kernel as st

target = GPUTarget("cuda", 90, 32)
sig = {"meta": "*i64", "part": "*fp64", "lo": "i32", "count": "i32", "n_blocks": "i32", "grid": "i32",
       "DTYPE": "constexpr", "CHUNK": "constexpr", "ALIGNED": "constexpr"}
out = {}
for name, dtype, variants in (("fp32", tl.float32, (True, False)), ("bf16", tl.bfloat16, (True,)),
                              ("fp16", tl.float16, (True,))):
    for aligned in variants:
        src = ASTSource(k.block_kernel, sig, constexprs={"DTYPE": dtype, "CHUNK": st.CHUNK, "ALIGNED": aligned})
        ptx = triton.compile(src, target=target).asm["ptx"]
        out[f"{name}-{aligned}"] = len(re.findall(r"ld\.global(?:\.\w+)*\.v4\.b32", ptx))
csig = {"meta": "*i64", "part": "*fp64", "out": "*fp64", "n_blocks": "i32", "n_pieces": "i32", "grid": "i32",
        "RB": "constexpr"}
out["combine"] = "cubin" in triton.compile(ASTSource(k.combine_kernel, csig, constexprs={"RB": st.RB}),
                                           target=target).asm
print(json.dumps(out))
"""


def test_compiles_for_a_cuda_target():
    """The compiled (not interpreted) kernels lowered to a cubin for sm_90 without a GPU, in a
    clean process (the interpreter leaves ``triton.language`` patched): catches errors the
    interpreter does not see, and shows 16-byte loads exactly when the blocks are aligned."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    p = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got.pop("combine") is True
    for key, n in got.items():
        assert (n > 0) == key.endswith("True"), got


FORCED_CASES = ["ddp-fp32-gas1", "fsdp2-bf16-gas2"]


@pytest.mark.multirank
def test_reference_driver_with_the_triton_kernel_forced(tmp_path):
    """The PyTorch reference driver (2 gloo ranks: DDP fp32, FSDP2 bf16 with accumulation) with ``DISTGRAD_STATS_KERNEL=triton`` under the interpreter: every record equals the
    float64 full-gradient reference (reference A, 1e-5, extrema and counts exact), and the Triton
    kernel computed every piece (no silent fallback). The other kernels are covered by the rest
    of the suite run with ``DISTGRAD_STATS_KERNEL`` set (docs/performance.md)."""
    from tests.helpers import launch
    from distgrad.record import StepRecord
    from tests.reference import case, check_against

    res = launch("torch_cases.py", tmp_path / "out.json", "--cases", ",".join(FORCED_CASES),
                 env={"DISTGRAD_STATS_KERNEL": "triton", "TRITON_INTERPRET": "1"})
    for key in FORCED_CASES:
        c = case(res, key)
        assert len(c["records"]) == 2 and all(c["records"])
        for rec, ref in zip(c["records"], c["ref_full"]):
            check_against(StepRecord.from_dict(rec), ref, rtol=1e-5, exact=True)
    use = res["stats_kernel_use"]
    assert use.get("triton", 0) > 0 and use.get("eager", 0) == 0 and use.get("native", 0) == 0, use
