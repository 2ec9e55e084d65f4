"""The kernel tables and call-contract limits, as compiled into the always-built CPU extension.

The C++ headers are the one source of these facts (``kernels/common/contract.h``,
``kernels/cuda/kernel_table.h`` and the family configs it expands); this module only turns what
``_cpu_ext.kernel_tables()`` reports into plain Python data for the planner, validation and
``supported_configs()``. Planning for CUDA therefore works on a host without a GPU or a CUDA build.

Contract of a CUDA plan (the CUDA handler checks it again):
  * ``variant``: ``VARIANT_IDS["decode"]`` (split-K over the candidate list, then a merge of the splits,
    through the workspace) or ``VARIANT_IDS["prefill"]`` (one pass per token and head tile, no
    workspace); the CPU runs ``VARIANT_IDS["reference"]``.
  * ``heads_per_block``: one of ``HEAD_TILES[kv_format]``, or on a device where the Hopper family runs one
    of ``HOPPER_ONLY_TILES[kv_format]``; heads past H in the last tile are masked.
  * decode: ``split_size`` a positive multiple of ``SPLIT_GRANULE`` with
    ``num_splits * split_size >= decode_positions(kv_format, topk, extra_topk)`` (``topk + extra_topk``,
    or without an extra list the main list cut at the format's window); split s covers candidate positions
    ``[s*split_size, (s+1)*split_size)`` of the main list followed by the extra list; the workspace is
    ``workspace_bytes(num_splits, T, H, d_v)`` bytes.
  * On an sm_90 device the handler runs the Hopper kernel of the same (format, head tile) when one
    exists (:func:`kernel_family`): the same variants, split sizes and workspace, so plans do not change.
    A Hopper-only head tile (``dots3_swa``'s 64 heads, a cluster of two blocks a (token, head tile,
    split): ``KernelConfig.cluster_blocks``) has no portable kernel: elsewhere the handler refuses it.
"""

from __future__ import annotations

import os
from typing import NamedTuple

from . import _cpu_ext
from .formats import FORMATS, get_format

__all__ = ["KernelConfig", "VARIANT_IDS", "MIN_HEADS", "MAX_HEADS", "MIN_TOPK", "SPLIT_GRANULE",
           "MIN_COMPUTE_CAPABILITY", "HOPPER_COMPUTE_CAPABILITY", "FAMILIES", "KERNELS", "HOPPER_KERNELS",
           "HEAD_TILES", "HOPPER_ONLY_TILES", "has_cuda_kernels", "workspace_bytes", "backward_workspace_bytes", "backward_chunk_tokens",
           "BACKWARD_CHUNK_BUDGET_BYTES", "kernel_family", "combine_shape", "row_conversion",
           "decode_positions"]

_TABLES = _cpu_ext.kernel_tables()


class KernelConfig(NamedTuple):
    threads: int         # threads per block
    candidate_tile: int  # KV rows gathered and dequantized per pipeline step
    shared_bytes: int    # dynamic shared memory per block
    cluster_blocks: int = 1  # blocks per (token, head tile, split): 2 for a lane-sliced Hopper tile


#: Values of the ``variant`` FFI attribute.
VARIANT_IDS: dict = dict(_TABLES["variants"])
#: Head counts per call (per shard).
MIN_HEADS: int = _TABLES["min_heads"]
MAX_HEADS: int = _TABLES["max_heads"]
#: Smallest index row width.
MIN_TOPK: int = _TABLES["min_topk"]
#: Decode split sizes are positive multiples of this.
SPLIT_GRANULE: int = _TABLES["split_granule"]
#: Oldest compute capability (major*10 + minor) with a kernel.
MIN_COMPUTE_CAPABILITY: int = _TABLES["min_compute_capability"]
#: The compute capability the Hopper family runs on (sm_90a code runs on 9.0 devices only).
HOPPER_COMPUTE_CAPABILITY: int = _TABLES["hopper_compute_capability"]

_FORMAT_KEYS = {f.id: key for key, f in FORMATS.items()}
#: Per family, every instantiated kernel: (kv_format key, heads_per_block) -> its launch shape.
FAMILIES: dict = {}
for _entry in _TABLES["kernels"]:
    FAMILIES.setdefault(_entry["family"], {})[(_FORMAT_KEYS[_entry["kv_format"]], _entry["heads_per_block"])] = (
        KernelConfig(_entry["threads"], _entry["candidate_tile"], _entry["shared_bytes"], _entry["cluster_blocks"]))
#: The portable family (every format; what plans are written for).
KERNELS: dict = FAMILIES["portable"]
#: The Hopper family (sm_90a).
HOPPER_KERNELS: dict = FAMILIES.get("hopper", {})
#: Instantiated head tiles per format, ascending.
HEAD_TILES: dict = {key: tuple(sorted(h for (k, h) in KERNELS if k == key)) for key in dict.fromkeys(k for k, _ in KERNELS)}
#: Hopper head tiles without a portable kernel, per format (plans take them where the Hopper family runs).
HOPPER_ONLY_TILES: dict = {key: tuple(sorted(h for (k, h) in HOPPER_KERNELS if k == key and (k, h) not in KERNELS))
                           for key in HEAD_TILES}


def has_cuda_kernels(kv_format: str) -> bool:
    """Whether the CUDA kernels serve a format (its portable instances exist)."""
    return get_format(kv_format).key in HEAD_TILES


def workspace_bytes(num_splits: int, num_tokens: int, num_heads: int, d_v: int) -> int:
    """Bytes of the decode workspace (layout: ``kernels/cuda/split_workspace.h``)."""
    return int(_cpu_ext.workspace_bytes(num_splits, num_tokens, num_heads, d_v))


#: Default bytes of the CUDA tensor-core cache gradient's per-chunk workspace (``backward_chunk_tokens``).
BACKWARD_CHUNK_BUDGET_BYTES: int = int(_cpu_ext.BACKWARD_CHUNK_BUDGET_BYTES)


def backward_chunk_tokens(num_tokens: int, num_heads: int, topk: int, d_qk: int) -> int:
    """Tokens per chunk of the CUDA tensor-core cache gradient: as many as keep the chunk's P, c and partial
    rows within ``BACKWARD_CHUNK_BUDGET_BYTES``, or within ``JSMLA_BACKWARD_CHUNK_BYTES`` (a positive number of
    bytes) when that variable is set in the environment at trace time; at least 1, at most ``num_tokens``."""
    budget = BACKWARD_CHUNK_BUDGET_BYTES
    text = os.environ.get("JSMLA_BACKWARD_CHUNK_BYTES", "").strip()
    if text:
        try:
            budget = int(text)
        except ValueError:
            budget = 0
        if budget < 1:
            raise ValueError(f"JSMLA_BACKWARD_CHUNK_BYTES: expected a positive number of bytes, got {text!r}")
    return int(_cpu_ext.backward_chunk_tokens(num_tokens, num_heads, topk, d_qk, budget))


def backward_workspace_bytes(num_tokens: int, num_heads: int, topk: int, gradient_groups: int, num_slots: int,
                             cache_gradient: bool, d_qk: int, chunk_tokens: int) -> int:
    """Bytes of the CUDA backward's workspace (layout: ``kernels/cuda/backward_workspace.h``); ``topk`` is the
    main list's width, ``num_slots`` the main cache's slot count, ``d_qk`` its width and ``chunk_tokens``
    the cache gradient's chunk (``backward_chunk_tokens``; all used only with ``cache_gradient``)."""
    return int(_cpu_ext.backward_workspace_bytes(num_tokens, num_heads, topk, gradient_groups, num_slots,
                                                 bool(cache_gradient), d_qk, chunk_tokens))


def kernel_family(kv_format: str, heads_per_block: int, compute_capability: int, max_shared_bytes: int,
                  hopper_compiled: bool = True, split_size: int | None = None) -> str:
    """Which family runs a plan on a device: ``"hopper"`` or ``"portable"``, decided as the CUDA handler
    decides it. ``hopper_compiled``: the build carries sm_90a code (the default architectures do);
    ``split_size``: candidate positions per split of a decode plan (``None``: one split over the whole
    list, as a prefill plan; the Hopper 16-head tile takes no split shorter than its 64-candidate
    tile); ``JSMLA_CUDA_FAMILY=portable`` in the environment keeps every plan on the portable family."""
    return _cpu_ext.kernel_family(get_format(kv_format).id, heads_per_block,
                                  2**62 if split_size is None else split_size, compute_capability,
                                  max_shared_bytes, hopper_compiled)


def combine_shape(rows: int, num_splits: int, d_v: int, sm_count: int) -> str:
    """The block shape of a decode plan's split merge, ``"narrow"``, ``"warp"`` or ``"wide"``, as the
    CUDA launch picks it (``kernels/cuda/combine_shape.h``) for ``rows`` (tokens × heads) rows of
    ``num_splits`` splits on ``sm_count`` SMs. Every shape sums in the same order: it changes the speed only."""
    return _cpu_ext.combine_shape(rows, num_splits, d_v, sm_count)


def row_conversion(kv_format: str) -> str:
    """How the CUDA kernels turn a format's rows into MMA operands (``kernels/common/formats.h``):
    ``"converted"`` (FP8/FP4 lanes to BF16, scales folded in), ``"exact_scales"`` (FP8 with arbitrary
    FP32 scales, applied per group in FP32) or ``"direct"`` (BF16 rows as stored)."""
    return _cpu_ext.row_conversion(get_format(kv_format).id)


def decode_positions(kv_format: str, topk: int, extra_topk: int = 0) -> int:
    """Candidate positions a decode plan's splits must cover: ``topk + extra_topk``, or without an extra
    list the main list cut at the format's window (``dots3_swa``: 513; positions past it are never read,
    so splits there would be empty blocks)."""
    return int(_cpu_ext.decode_positions(topk, get_format(kv_format).max_candidates, extra_topk))
