"""Trace-time planning: which kernel, tiles, split count and workspace, from static shapes only.

:func:`plan` is a pure, memoised function of the problem's static shape, the device description and
(on CUDA) the kernel family's constants. ``sparse_mla`` plans once per platform it may lower to and
passes the decisions to the FFI call as attributes; the workspace is an extra output sized here, so a
compiled executable replays identical launches every step.

Decode vs prefill (CUDA): a token's candidates are split over several blocks (``decode``: split-K
plus a combine kernel) only while ``tokens × head tiles`` blocks cannot fill the device on their own;
once they can (about two waves of blocks), the single-pass ``prefill`` kernel does less total work.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Union

from . import cuda_config
from .formats import KVFormat, get_format
from .validate import ENVELOPE, IMPLS

__all__ = ["DeviceInfo", "DEFAULT_CUDA_DEVICE", "Plan", "plan", "device_info", "VARIANT_IDS"]

#: Blocks per SM the decode split count aims for (about two waves).
WAVES_TO_FILL = 2
#: Upper bound on decode splits per token (the combine reads every split).
MAX_SPLITS = 64
#: Candidates per split under ``batch_invariant=True`` (independent of T).
BATCH_INVARIANT_SPLIT_SIZE = 256

#: Attribute values of the ``variant`` FFI attribute.
VARIANT_IDS = {"reference": 0, "decode": 1, "prefill": 2}


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    """Static properties of a device that planning depends on."""

    name: str
    platform: str  # "cpu" or "cuda"
    arch: int = 0  # compute capability as major*10+minor (90 for sm_90); 0 on CPU
    sm_count: int = 0
    l2_bytes: int = 0
    smem_per_block: int = 0


#: Used when no CUDA device is present (e.g. exporting for CUDA from a CPU host): an H200.
DEFAULT_CUDA_DEVICE = DeviceInfo(name="NVIDIA H200 (default)", platform="cuda", arch=90, sm_count=132,
                                 l2_bytes=60 * 1024 * 1024, smem_per_block=227 * 1024)
DEFAULT_CPU_DEVICE = DeviceInfo(name="cpu", platform="cpu")


def device_info(platform: str) -> DeviceInfo:
    """The description of the first local device of ``platform``, or the documented default."""
    if platform == "cpu":
        return DEFAULT_CPU_DEVICE
    import jax

    try:
        devices = jax.devices("cuda")
    except RuntimeError:
        return DEFAULT_CUDA_DEVICE
    dev = devices[0]
    major, minor = (int(x) for x in str(getattr(dev, "compute_capability", "9.0")).split("."))
    return DeviceInfo(name=dev.device_kind, platform="cuda", arch=major * 10 + minor,
                      sm_count=int(getattr(dev, "core_count", DEFAULT_CUDA_DEVICE.sm_count)),
                      l2_bytes=DEFAULT_CUDA_DEVICE.l2_bytes, smem_per_block=DEFAULT_CUDA_DEVICE.smem_per_block)


@dataclasses.dataclass(frozen=True)
class Plan:
    """An immutable launch plan. ``attrs()`` gives the FFI attributes it bakes into the call."""

    platform: str
    family: str  # "cpu_reference" or "portable" (mma.sync)
    variant: str  # "reference", "decode" or "prefill"
    kv_format: str
    num_tokens: int
    num_heads: int
    topk: int
    extra_topk: int
    heads_per_block: int
    num_splits: int
    split_size: int  # candidates per split (decode); total candidates otherwise
    workspace_bytes: int
    min_sm_count: int
    batch_invariant: bool
    device_name: str
    reason: str

    @property
    def workspace_shape(self) -> tuple:
        return (self.workspace_bytes,)

    def attrs(self) -> dict:
        """Plan attributes of the FFI call (the ``_v1`` attribute contract)."""
        return {
            "variant": VARIANT_IDS[self.variant],
            "num_splits": self.num_splits,
            "split_size": self.split_size,
            "heads_per_block": self.heads_per_block,
            "min_sm_count": self.min_sm_count,
        }

    def describe(self) -> str:
        """A human-readable summary of the plan and why it was chosen."""
        lines = [
            f"sparse_mla plan for {self.platform} ({self.device_name}): family={self.family} variant={self.variant}",
            f"  problem: format={self.kv_format} T={self.num_tokens} H={self.num_heads} topk={self.topk}"
            + (f" extra_topk={self.extra_topk}" if self.extra_topk else ""),
            f"  tiles: heads_per_block={self.heads_per_block} num_splits={self.num_splits} "
            f"split_size={self.split_size} workspace={self.workspace_bytes} bytes"
            + (" batch_invariant" if self.batch_invariant else ""),
            f"  why: {self.reason}",
        ]
        return "\n".join(lines)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, b: int) -> int:
    return _ceil_div(a, b) * b


def _head_tile(num_heads: int) -> int:
    """The smallest instantiated head tile that covers all heads, else the largest tile."""
    tiles = sorted(cuda_config.HEAD_TILES)
    return next((t for t in tiles if t >= num_heads), tiles[-1])


def _plan_cuda(fmt: KVFormat, num_tokens, num_heads, topk, extra_topk, device: DeviceInfo, batch_invariant,
               impl) -> Plan:
    candidates = topk + extra_topk
    heads_per_block = _head_tile(num_heads)
    head_tiles = _ceil_div(num_heads, heads_per_block)
    tile = cuda_config.CANDIDATE_TILE
    base_blocks = max(1, num_tokens * head_tiles)
    target_blocks = WAVES_TO_FILL * device.sm_count
    common = dict(platform="cuda", family="portable", kv_format=fmt.key, num_tokens=num_tokens,
                  num_heads=num_heads, topk=topk, extra_topk=extra_topk, heads_per_block=heads_per_block,
                  batch_invariant=batch_invariant, device_name=device.name)

    if impl == "prefill" or (impl == "auto" and not batch_invariant and base_blocks >= target_blocks):
        reason = ("impl='prefill' requested" if impl == "prefill" else
                  f"{base_blocks} token x head-tile blocks fill {device.sm_count} SMs "
                  f"(>= {target_blocks}): one pass per token, no combine")
        return Plan(variant="prefill", num_splits=1, split_size=candidates, workspace_bytes=0, min_sm_count=0,
                    reason=reason, **common)

    if batch_invariant:
        split_size = _round_up(BATCH_INVARIANT_SPLIT_SIZE, tile)
        reason = f"batch_invariant: fixed {split_size}-candidate splits, independent of T"
    else:
        max_splits = _ceil_div(candidates, tile)
        wanted = _ceil_div(target_blocks, base_blocks)
        splits = max(1, min(max_splits, wanted, MAX_SPLITS))
        split_size = _round_up(_ceil_div(candidates, splits), tile)
        reason = (("impl='decode' requested; " if impl == "decode" else "")
                  + f"{base_blocks} token x head-tile blocks < {target_blocks}: split each candidate list "
                  f"into {_ceil_div(candidates, split_size)} to fill {device.sm_count} SMs")
    num_splits = _ceil_div(candidates, split_size)
    workspace = num_splits * num_tokens * num_heads * (fmt.d_v + 1) * 4
    return Plan(variant="decode", num_splits=num_splits, split_size=split_size, workspace_bytes=workspace,
                min_sm_count=0, reason=reason, **common)


@functools.lru_cache(maxsize=4096)
def _plan_cached(q_shape, fmt_key, topk, extra_topk, platform, device, batch_invariant, impl) -> Plan:
    fmt = get_format(fmt_key)
    num_heads = q_shape[-2]
    num_tokens = 1
    for d in q_shape[:-2]:
        num_tokens *= d
    if platform == "cpu":
        if impl in ("decode", "prefill"):
            raise ValueError(f"impl: {impl!r} selects a CUDA kernel; on the CPU use impl='auto' or 'xla'")
        return Plan(platform="cpu", family="cpu_reference", variant="reference", kv_format=fmt.key,
                    num_tokens=num_tokens, num_heads=num_heads, topk=topk, extra_topk=extra_topk,
                    heads_per_block=num_heads, num_splits=1, split_size=topk + extra_topk, workspace_bytes=0,
                    min_sm_count=0, batch_invariant=batch_invariant, device_name=device.name,
                    reason="the CPU runs the C++ reference kernel (one pass, no workspace; batch invariant)")
    if platform == "cuda":
        return _plan_cuda(fmt, num_tokens, num_heads, topk, extra_topk, device, batch_invariant, impl)
    raise ValueError(f"platform: expected one of {sorted(ENVELOPE['platforms'])}, got {platform!r}")


def plan(q_shape, kv_format: Union[str, KVFormat], topk: int, *, extra_topk: int = 0, platform: str,
         device: Optional[DeviceInfo] = None, batch_invariant: bool = False, impl: str = "auto") -> Plan:
    """Plans one ``sparse_mla`` call.

    Args:
      q_shape: ``(T, H, d_qk)`` or ``(B, S, H, d_qk)``.
      kv_format: format key or object. topk / extra_topk: index row widths.
      platform: ``"cpu"`` or ``"cuda"``.
      device: the device description; ``None`` uses the local device of that platform or
        :data:`DEFAULT_CUDA_DEVICE`.
      batch_invariant: fix the candidate chunking and combine order independently of T.
      impl: ``"auto"``, ``"decode"`` or ``"prefill"`` (``"xla"`` never reaches the planner).
    Returns:
      A memoised :class:`Plan`.
    """
    fmt = get_format(kv_format)
    if impl not in IMPLS or impl == "xla":
        raise ValueError(f"impl: expected 'auto', 'decode' or 'prefill' for planning, got {impl!r}")
    if device is None:
        device = device_info(platform)
    return _plan_cached(tuple(int(d) for d in q_shape), fmt.key, int(topk), int(extra_topk), platform, device,
                        bool(batch_invariant), impl)
