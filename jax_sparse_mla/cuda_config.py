"""Constants of the CUDA kernel families that the planner needs (plain Python, no jax import).

Mirrors ``kernels/cuda/portable`` and ``kernels/cuda/hopper`` (config.cuh, registry.cu) and
``kernels/cuda/split_workspace.h``; ``_cuda_ext.kernel_configs()`` reports the compiled values and a
test compares them with this module.

Plans are written for the portable family. On an sm_90 GPU (H100/H200), with a build that includes
sm_90a, the handler runs a plan whose ``(kv_format, heads_per_block)`` is in ``HOPPER_KERNELS`` on
the Hopper family instead (wgmma, a producer warpgroup): the same variants, split sizes and workspace,
so the plan is unchanged. ``JSMLA_CUDA_FAMILY=portable`` in the environment keeps every call on the
portable kernels.

Contract for a CUDA plan (checked again by ``ffi/cuda_handlers.cu``):
  * ``variant``: ``VARIANTS["decode"]`` (split-K over the candidate list + a combine kernel, needs the
    workspace) or ``VARIANTS["prefill"]`` (one pass per token and head tile, no workspace;
    ``num_splits``/``split_size`` are ignored).
  * ``heads_per_block``: one of ``HEAD_TILES[kv_format]``. Heads past H in the last tile are masked.
    The large tile dequantizes each KV tile once for the most heads (use it when H >= the large tile,
    or when H is above the small tile and blocks are plentiful); the small tile suits H <= 16.
  * decode: ``split_size`` a positive multiple of ``SPLIT_GRANULE`` and
    ``num_splits * split_size >= topk + extra_topk``; split s covers candidate positions
    ``[s*split_size, (s+1)*split_size)`` of the main list followed by the extra list.
  * decode workspace: ``workspace_bytes(num_splits, T, H, d_v)`` bytes (0 for prefill).
  * the device needs compute capability >= ``MIN_COMPUTE_CAPABILITY`` and at least
    ``KERNELS[(kv_format, heads_per_block)].shared_bytes`` of opt-in shared memory per block.
"""

from __future__ import annotations

import os
from typing import NamedTuple

#: Values of the ``variant`` FFI attribute served by the CUDA target.
VARIANTS = {"decode": 1, "prefill": 2}

#: Decode split sizes must be positive multiples of this (a multiple of every kernel's candidate tile).
SPLIT_GRANULE = 32

#: Oldest compute capability (major*10 + minor) with a kernel (SASS for 80/90a/120a, PTX for 80).
MIN_COMPUTE_CAPABILITY = 80


class KernelConfig(NamedTuple):
    threads: int         # threads per block
    candidate_tile: int  # KV rows gathered and dequantized per pipeline step
    shared_bytes: int    # dynamic shared memory per block


#: Every instantiated kernel: (kv_format key, heads_per_block) -> its launch shape.
KERNELS = {
    ("dsv3_2", 16): KernelConfig(128, 32, 68224),
    ("dsv3_2", 64): KernelConfig(256, 32, 78464),
    ("glm_nsa", 16): KernelConfig(128, 32, 69248),
    ("glm_nsa", 64): KernelConfig(256, 32, 79488),
    ("glm53_nope", 16): KernelConfig(128, 32, 61056),
    ("glm53_nope", 64): KernelConfig(256, 32, 71296),
    ("dsv4", 16): KernelConfig(128, 32, 62080),
    ("dsv4", 64): KernelConfig(256, 32, 72320),
    ("dsv4_1", 16): KernelConfig(128, 32, 60032),
    ("dsv4_1", 64): KernelConfig(256, 32, 70272),
    ("dots3_swa", 16): KernelConfig(128, 16, 59712),
    ("dots3_swa", 32): KernelConfig(256, 16, 65856),
    ("bf16_576", 16): KernelConfig(128, 32, 82560),
    ("bf16_576", 64): KernelConfig(256, 32, 90752),
    ("bf16_512", 16): KernelConfig(128, 32, 74368),
    ("bf16_512", 64): KernelConfig(256, 32, 82560),
}

#: The Hopper family (sm_90a only): (kv_format key, heads_per_block) -> its launch shape.
HOPPER_KERNELS = {
    ("dsv3_2", 64): KernelConfig(384, 32, 230656),
    ("dsv4", 64): KernelConfig(384, 32, 206080),
    ("dsv4_1", 64): KernelConfig(384, 32, 206080),
    ("bf16_576", 64): KernelConfig(384, 32, 226560),
    ("bf16_512", 64): KernelConfig(384, 32, 230656),
}
#: The compute capability the Hopper family runs on (sm_90a code runs on 9.0 devices only).
HOPPER_COMPUTE_CAPABILITY = 90


def kernel_family(kv_format: str, heads_per_block: int, compute_capability: int, max_shared_bytes: int) -> str:
    """Which family runs a plan on a device: ``"hopper"`` or ``"portable"``.

    Mirrors the CUDA handler for a build that includes sm_90a (the default architectures do): the Hopper
    kernel when one exists for the format and head tile, the device is sm_90 with enough shared memory,
    and ``JSMLA_CUDA_FAMILY`` is not ``portable``.
    """
    config = HOPPER_KERNELS.get((kv_format, heads_per_block))
    if (config is not None and compute_capability == HOPPER_COMPUTE_CAPABILITY
            and config.shared_bytes <= max_shared_bytes and os.environ.get("JSMLA_CUDA_FAMILY") != "portable"):
        return "hopper"
    return "portable"


#: Instantiated head tiles per format, ascending (dots3_swa's 1088-wide rows cap it at 32).
HEAD_TILES = {
    key: tuple(sorted(heads for (k, heads) in KERNELS if k == key)) for key in dict.fromkeys(k for k, _ in KERNELS)
}


#: Registers per thread the planner assumes for occupancy (ptxas reports 207-255 on sm_90a; a block's
#: register allocation rounds up, so 255 is the safe bound: 128-thread kernels fit twice per SM).
REGISTERS_PER_THREAD = 255
#: Shared memory the runtime reserves per resident block (sm_80 and newer).
SHARED_BYTES_RESERVED_PER_BLOCK = 1024


def workspace_bytes(num_splits: int, num_tokens: int, num_heads: int, d_v: int) -> int:
    """Bytes of the decode workspace: float32 partial_out[S][T][H][d_v] then partial_lse[S][T][H]."""
    return num_splits * num_tokens * num_heads * (d_v + 1) * 4
