"""Run by tests/kernels/test_triton_interpreted.py in a process of its own, without the
interpreter: each of our Triton kernels compiled ahead of time for an H200 (sm_90, Triton's
own ptxas; no GPU needed) at Kimi Linear's shapes, in the configuration its launcher uses.
It must compile, and it must not spill registers to the stack: the interpreter runs none of
what the GPU compiler does, so this is where a kernel that cannot be compiled, or that
would run out of registers, shows up before a GPU is lent."""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kdaserve.kernels.triton import (
    conv_kernels,
    k3_kernels,
    kda_kernels,
    mla,
    mla_kernels,
    moe,
    moe_kernels,
)

TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def resources(fn: Any, pointers: dict[str, str], scalars: dict[str, str],
              constexprs: dict[str, Any], num_warps: int = 4, num_stages: int = 3
              ) -> tuple[int, int]:
    """(registers, stack bytes) of fn compiled for sm_90; arguments in fn's order."""
    names = fn.arg_names
    sig = {n: pointers.get(n) or scalars.get(n) or "constexpr" for n in names}
    assert set(names) == set(pointers) | set(scalars) | set(constexprs), names
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": num_warps, "num_stages": num_stages})
    cubin = Path(tempfile.mkdtemp()) / "k.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    usage = subprocess.run([str(TOOLS / "cuobjdump"), "-res-usage", str(cubin)],
                           capture_output=True, text=True, check=True).stdout
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))
    return regs, stack


BF16 = "*bf16"
H, K, D_CONV, W = 32, 128, 3 * 32 * 128, 4  # Kimi Linear's KDA heads and conv width
K3_D = 7168  # Kimi K3's hidden size; its AttnRes bank holds at most 9 sources


def kda_decode(lower_bound: bool) -> tuple[int, int]:
    return resources(
        kda_kernels.kda_decode_kernel,
        {"qkv_ptr": BF16, "f_ptr": BF16, "beta_ptr": BF16, "z_ptr": BF16, "conv_w_ptr": BF16,
         "A_log_ptr": "*fp32", "dt_bias_ptr": "*fp32", "norm_w_ptr": BF16, "state_ptr": "*fp32",
         "conv_ptr": BF16, "slot_ptr": "*i64", "cu_ptr": "*i64", "out_ptr": BF16},
        {"eps": "fp32", "scale": "fp32", "lower_bound": "fp32", "H": "i32", "D": "i32"},
        {"LOWER_BOUND": lower_bound, "K": K, "V": K, "W": W, "BLOCK_K": K, "BLOCK_V": K,
         "BLOCK_W": 4, "BLOCK_TAPS": 4}, num_warps=8)


def moe_gate_up(situ: bool, mxfp4: bool = False) -> tuple[int, int]:
    w = "*u8" if mxfp4 else BF16  # MXFP4: codes and E8M0 scales
    return resources(
        moe_kernels.gate_up_kernel,
        {"x_ptr": BF16, "w_ptr": w, "s_ptr": w, "pairs_ptr": "*i64",
         "block_expert_ptr": "*i64", "h_ptr": BF16},
        {"num_pairs": "i32", "top_k": "i32", "D": "i32", "inter": "i32", "beta": "fp32",
         "linear_beta": "fp32"},
        {"HAS_SCALE": False, "SITU": situ, "CAP_UP": situ, "BLOCK_M": 16, "BLOCK_N": 64,
         "BLOCK_K": 64, "PRECISION": "tf32", "MXFP4": mxfp4}, num_warps=8)


def moe_down(mxfp4: bool) -> tuple[int, int]:
    w = "*u8" if mxfp4 else BF16
    return resources(
        moe_kernels.down_kernel,
        {"h_ptr": BF16, "w_ptr": w, "s_ptr": w, "pairs_ptr": "*i64",
         "block_expert_ptr": "*i64", "weights_ptr": "*fp32", "out_ptr": BF16},
        {"num_pairs": "i32", "D": "i32", "inter": "i32"},
        {"HAS_SCALE": False, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64,
         "PRECISION": "tf32", "MXFP4": mxfp4})


CASES = {
    "kda_decode": lambda: kda_decode(False),
    "kda_decode_k3_gate": lambda: kda_decode(True),
    "short_conv": lambda: resources(
        conv_kernels.conv_kernel,
        {"x_ptr": BF16, "w_ptr": BF16, "state_ptr": BF16, "seq_ptr": "*i64", "pos_ptr": "*i64",
         "slot_ptr": "*i64", "start_ptr": "*i64", "out_ptr": BF16},
        {"D": "i32"}, {"W": W, "BLOCK_W": 4, "BLOCK_D": 128}),
    "conv_state": lambda: resources(
        conv_kernels.state_kernel,
        {"x_ptr": BF16, "state_ptr": BF16, "slot_ptr": "*i64", "start_ptr": "*i64",
         "count_ptr": "*i64"},
        {"D": "i32"}, {"W": W, "BLOCK_W": 4, "BLOCK_D": 128}),
    "moe_gate_up": lambda: moe_gate_up(False),
    "moe_gate_up_situ": lambda: moe_gate_up(True),
    "moe_gate_up_situ_mxfp4": lambda: moe_gate_up(True, mxfp4=True),  # K3's experts (W4A16)
    "situ_mul": lambda: resources(
        k3_kernels.situ_mul_kernel, {"gu_ptr": BF16, "y_ptr": BF16},
        {"inter": "i32", "beta": "fp32", "linear_beta": "fp32"},
        {"CAP_UP": True, "BLOCK": 1024}),
    "attn_res_norm": lambda: resources(
        k3_kernels.attn_res_norm_kernel,
        {"bank_ptr": BF16, "partial_ptr": BF16, "w_ptr": "*fp32", "norm_w_ptr": BF16,
         "out_ptr": BF16},
        {"NB": "i32", "T": "i32", "D": "i32", "eps": "fp32", "norm_eps": "fp32"},
        {"BLOCK_D": 1024, "BLOCK_S": 16}),
    "moe_down": lambda: moe_down(False),
    "moe_down_mxfp4": lambda: moe_down(True),
    "moe_route": lambda: resources(
        moe_kernels.route_kernel,
        {"logits_ptr": "*fp32", "bias_ptr": "*fp32", "weights_ptr": "*fp32", "ids_ptr": "*i64"},
        {"T": "i32", "E": "i32", "scaling": "fp32"},
        {"HAS_BIAS": True, "SIGMOID": True, "RENORMALIZE": True, "TOP_K": 8, "NUM_GROUP": 1,
         "TOPK_GROUP": 1, "BLOCK_T": 16, "BLOCK_E": 256, "BLOCK_K": 8, "BLOCK_G": 2}),
    # DeepSeek-V3's group-limited routing: 256 experts in 8 groups, 4 kept
    "moe_route_grouped": lambda: resources(
        moe_kernels.route_kernel,
        {"logits_ptr": "*fp32", "bias_ptr": "*fp32", "weights_ptr": "*fp32", "ids_ptr": "*i64"},
        {"T": "i32", "E": "i32", "scaling": "fp32"},
        {"HAS_BIAS": True, "SIGMOID": True, "RENORMALIZE": True, "TOP_K": 8, "NUM_GROUP": 8,
         "TOPK_GROUP": 4, "BLOCK_T": moe.route_block_t(8), "BLOCK_E": 256, "BLOCK_K": 8,
         "BLOCK_G": 8}),
    "mla_split": lambda: resources(
        mla_kernels.mla_split_kernel,
        {"q_lat_ptr": BF16, "q_pe_ptr": BF16, "kv_ptr": BF16, "block_table_ptr": "*i64",
         "seq_ptr": "*i64", "last_ptr": "*i64", "o_ptr": "*fp32", "m_ptr": "*fp32",
         "l_ptr": "*fp32"},
        {"H": "i32", "R": "i32", "DR": "i32", "bt_stride": "i32", "page": "i32",
         "num_splits": "i32", "scale": "fp32"},
        {"BLOCK_H": 16, "BLOCK_N": mla.BLOCK_N, "BLOCK_R": 512, "BLOCK_DR": 64,
         "PRECISION": "tf32"}, num_warps=8, num_stages=2),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_compiles_for_sm90_without_spills(name: str) -> None:
    regs, stack = CASES[name]()
    assert 0 < regs <= 255
    assert stack == 0, f"{name}: {regs} registers and {stack} bytes of stack (spills)"
