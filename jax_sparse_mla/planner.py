"""Trace-time planning: which kernel, tiles, split count and workspace, from static shapes only.

:func:`plan` is a pure, memoised function of the problem's static shape, the device description and
(on CUDA) the kernel family's constants. ``sparse_mla`` plans once per platform it may lower to and
passes the decisions to the FFI call as attributes; the workspace is an extra output sized here, so a
compiled executable replays identical launches every step.

Decode vs prefill (CUDA), the documented rule: the planner evaluates :class:`CostModel` for the
single-pass ``prefill`` kernel and for split-K ``decode`` with each split count of
:data:`SPLIT_CHOICES` and each instantiated head tile, and takes the cheapest. Splitting pays while
``tokens × head tiles`` blocks leave SMs idle (few tokens); once they fill the device in whole
waves, splitting only adds the combine and ``prefill`` wins. ``impl="decode"``/``"prefill"`` restrict
the choice; ``Plan.describe()`` prints the prediction and the runner-up.

Staging (CUDA): a quantized cache whose values are exact in BF16 (:func:`staging_format`) can be
dequantized once per call into a BF16 copy of every slot, which the BF16 kernels then read. The
conversion is then done once per slot instead of once per (token, head tile) that references it, at the
price of one pass over the cache: it pays when the rows are referenced many times (prefill: thousands
of tokens over a pool of similar size). Given the cache's slot count, the planner weighs every choice
both ways and stages when that is cheaper and the copy fits in :data:`STAGE_MAX_BYTES`. The
environment variable ``JSMLA_CUDA_STAGING`` (read at trace time) overrides the choice: ``off`` never
stages, ``on`` stages every call that can be staged (for comparisons and tests), ``auto`` (the default)
lets the cost model decide.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Optional, Union

import numpy as np

from . import _ffi, calibration_store, kernel_tables
from .formats import FORMATS, KVFormat, get_format
from .kernel_tables import VARIANT_IDS
from .validate import RULE

__all__ = ["DeviceInfo", "DEFAULT_CUDA_DEVICE", "CostModel", "Plan", "plan", "clear_cache", "device_info",
           "VARIANT_IDS", "STAGE_MAX_BYTES", "STAGING_ENV", "staging_format", "staging_mode"]

#: Candidates per split under ``batch_invariant=True`` (independent of T).
BATCH_INVARIANT_SPLIT_SIZE = 256
#: Split counts the planner considers (the combine reads every split of a token).
SPLIT_CHOICES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
#: Bytes per partial value the split merge's cost charges: the combine constants (``combine_gbps``,
#: ``warp_combine_gbps``) were fitted on sweeps timed when the partial rows were FP32. The kernels now
#: write BF16 partial rows (half the bytes; the merge measured 0.82x its former time at T = 1, H = 128,
#: 32 splits), so the model overstates the merge until a sweep on the BF16 layout refits the constants.
COMBINE_FIT_PARTIAL_BYTES = 4
#: The largest BF16 copy of a cache (bytes) a plan may stage: the copy is a temporary of the call.
STAGE_MAX_BYTES = 2 * 1024**3
#: The environment variable that overrides the staging choice (module docstring).
STAGING_ENV = "JSMLA_CUDA_STAGING"
STAGING_MODES = ("auto", "on", "off")


def staging_mode() -> str:
    """The staging override of the environment (:data:`STAGING_ENV`): ``"auto"`` when unset.

    Raises:
      ValueError: a value other than ``auto``, ``on`` or ``off``.
    """
    text = os.environ.get(STAGING_ENV, "").strip().lower() or "auto"
    if text not in STAGING_MODES:
        raise ValueError(f"{STAGING_ENV}: expected one of {', '.join(STAGING_MODES)}, got {text!r}")
    return text


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Analytic time model of the CUDA kernels, in microseconds.

    A block over ``n`` candidates with a head tile of ``h`` heads costs, alone on an SM,
    ``per_block = block_us + n * (row_ns + h * mma_ns_per_head) / 1000`` (:meth:`block_time_us`). Its
    fixed cost ``block_us`` and its row cost ``row_ns`` (gather and conversion of one candidate row) are
    the kernel family's: on the Hopper family ``block_us`` and, by the format's row conversion
    (:func:`jax_sparse_mla.kernel_tables.row_conversion`), ``dequant_ns`` (converted FP8/FP4 rows),
    ``exact_scales_row_ns`` (FP8 rows with arbitrary FP32 scales) or ``direct_row_ns`` (BF16 rows); on
    the portable family ``portable_block_us`` and ``portable_dequant_ns``. A device with the Hopper
    family runs portable-family plans for the head tiles and splits the Hopper tiles lack, so its
    planner weighs plans of both. A launch of at most one block per SM takes ``launch_us + per_block``.
    A larger launch is work-conserving: the SMs run ``c = min(resident, blocks / sm_count)`` blocks each
    on average (``resident`` is the kernel's occupancy, :func:`resident_blocks`), an SM's throughput
    grows from 1 (one block) to ``co_residency_gain`` (``resident`` blocks) with ``c``, and the last
    blocks add a tail of ``tail`` block times:
    ``launch_us + blocks * per_block / (sm_count * throughput) + tail * per_block``.
    Many small blocks thus shorten the tail at the price of ``block_us`` each. A staged plan (module
    docstring) adds :meth:`stage_us`, the copy's pass at ``stage_gbps``. The decode combine
    streams the partial results at ``warp_combine_gbps`` in its warp shape and at ``combine_gbps`` in
    the others (:func:`jax_sparse_mla.kernel_tables.combine_shape` says which runs). The defaults were
    fitted on an H200 to sweeps that timed every plan of a grid of shapes
    (``benchmarks/planner_sweep.py --refit``); :func:`jax_sparse_mla.calibration.calibrate` fits them
    per device.
    """

    # Fitted on an H200 (sm_90, 132 SMs) to planner sweeps of dsv3_2, glm_nsa and bf16_576 (every plan
    # of each grid timed with the queued-call method, 32 scan steps per call for T <= 16; all head tiles
    # at every H; T = 1..256), rounded: the picks are within 7% of the best timed plan on all 51 shapes
    # and the predictions 0.86-1.14x the measured times (benchmarks/results/planner_sweep*.md);
    # co_residency_gain is the dsv3_2 run's calibrated value (the sweeps' grids do not pin it).
    launch_us: float = 3.75  # per launch
    block_us: float = 2.76  # Hopper family: a block's fixed cost (Q load, barriers, epilogue)
    dequant_ns: float = 42.4  # Hopper family: gather + FP8/FP4 -> BF16 conversion of one candidate row
    exact_scales_row_ns: float = 61.1  # the same for FP8 rows with arbitrary FP32 scales
    direct_row_ns: float = 34.3  # the same for BF16 rows (no conversion)
    portable_block_us: float = 0.225  # the portable (mma.sync) family's fixed cost and row cost (every row)
    portable_dequant_ns: float = 97.4
    mma_ns_per_head: float = 0.11  # S = Q·Kᵀ and O += P·V of one candidate for one head (mostly hidden on H200)
    co_residency_gain: float = 1.67  # throughput of `resident` co-resident blocks over one
    combine_gbps: float = 1520.0  # the combine's narrow and wide shapes (a block per row or row slice)
    warp_combine_gbps: float = 2110.0  # its warp shape (a row per warp; at most 8 splits, many rows)
    tail: float = 0.21  # the last wave's imbalance, in block times
    stage_gbps: float = 2000.0  # staging: the cache read and its BF16 copy written, GB/s (calibration times it)
    # Per-format constants where they were measured (benchmarks/format_costs.py, one H100 run; calibrate
    # measures those of the formats it is given). The staging pass's rate of a format, GB/s, where it is
    # not stage_gbps: (format key, GB/s).
    stage_gbps_by_format: tuple = (("dsv3_2", 1792.0), ("dsv4", 1824.0), ("dsv4_1", 2184.0), ("dsv4_nvfp4", 1732.0),
                                   ("dsv4_1_fp4", 1046.0))
    # A format's Hopper-family row cost over its row conversion's constant, per head tile: (format key, head
    # tile, factor); 1 for every other (format, tile) and for the formats the conversion constants are
    # fitted on (calibration.ROW_FACTOR_REFERENCES). The factor makes the model's prefill time stand to
    # the reference format's as measured (T = 1024 H = 128 for the 64-head tile, T = 256 H = 16 for the
    # 16-head one): UE8M0 rows cost 0.93-0.94x dsv3_2's at 64 heads and 0.83x at 16, FP4 rows 1.04-1.06x
    # and 0.98-0.99x.
    row_factors: tuple = (("bf16_512", 64, 0.961), ("dsv4", 16, 0.825), ("dsv4", 64, 0.941), ("dsv4_1", 16, 0.825),
                          ("dsv4_1", 64, 0.928), ("dsv4_1_fp4", 16, 0.979), ("dsv4_1_fp4", 64, 1.037),
                          ("dsv4_nvfp4", 16, 0.993), ("dsv4_nvfp4", 64, 1.062), ("glm53_nope", 64, 0.935))

    def row_factor(self, kv_format: Optional[str], head_tile: int) -> float:
        """The factor of ``kv_format``'s Hopper-family row cost at ``head_tile`` (1 where not measured)."""
        return next((f for key, tile, f in self.row_factors if key == kv_format and tile == head_tile), 1.0)

    def block_time_us(self, candidates_per_block: int, head_tile: int, family: str = "hopper",
                      conversion: str = "converted", kv_format: Optional[str] = None) -> float:
        """One block of ``family`` ("hopper" or "portable") over rows of ``conversion`` (of ``kv_format``,
        whose :meth:`row_factor` applies on the Hopper family) alone on an SM."""
        if family == "portable":
            block_us, row_ns = self.portable_block_us, self.portable_dequant_ns
        elif family == "hopper":
            rows = {"converted": self.dequant_ns, "exact_scales": self.exact_scales_row_ns,
                    "direct": self.direct_row_ns}
            if conversion not in rows:
                raise ValueError(f"no row conversion {conversion!r} (expected one of {sorted(rows)})")
            block_us, row_ns = self.block_us, rows[conversion] * self.row_factor(kv_format, head_tile)
        else:
            raise ValueError(f"no CUDA kernel family {family!r} (expected 'hopper' or 'portable')")
        return block_us + candidates_per_block * (row_ns + head_tile * self.mma_ns_per_head) / 1e3

    def kernel_us(self, blocks: int, candidates_per_block: int, head_tile: int, sm_count: int,
                  resident: int = 1, family: str = "hopper", conversion: str = "converted",
                  kv_format: Optional[str] = None) -> float:
        per_block = self.block_time_us(candidates_per_block, head_tile, family, conversion, kv_format)
        sm_count = max(1, sm_count)
        if blocks <= sm_count:
            return self.launch_us + per_block
        resident = max(1, resident)
        throughput = 1.0
        if resident > 1:
            concurrency = min(float(resident), blocks / sm_count)
            throughput = 1.0 + (self.co_residency_gain - 1.0) * (concurrency - 1.0) / (resident - 1)
        return self.launch_us + blocks * per_block / (sm_count * throughput) + self.tail * per_block

    def combine_us(self, num_splits: int, num_tokens: int, num_heads: int, d_v: int, sm_count: int) -> float:
        """The split merge of a decode plan on ``sm_count`` SMs."""
        # Charged as the FP32 partial rows the recorded sweeps were timed with (COMBINE_FIT_PARTIAL_BYTES).
        moved = (num_splits * num_tokens * num_heads * (d_v * COMBINE_FIT_PARTIAL_BYTES + 4)
                 + num_tokens * num_heads * (2 * d_v + 4))
        shape = kernel_tables.combine_shape(num_tokens * num_heads, num_splits, d_v, max(1, sm_count))
        return self.launch_us + moved / ((self.warp_combine_gbps if shape == "warp" else self.combine_gbps) * 1e3)

    def stage_rate(self, kv_format: str) -> float:
        """GB/s of the copy pass of a ``kv_format`` cache: its entry in ``stage_gbps_by_format``, else
        ``stage_gbps``."""
        return next((gbps for key, gbps in self.stage_gbps_by_format if key == kv_format), self.stage_gbps)

    def stage_us(self, num_slots: int, fmt: KVFormat, staged: KVFormat) -> float:
        """Dequantizing every slot of a ``fmt`` cache into ``staged`` (BF16) rows: one pass over both."""
        moved = num_slots * (fmt.bytes_per_token + staged.bytes_per_token)
        return self.launch_us + moved / (self.stage_rate(fmt.key) * 1e3)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Optional[dict]) -> "CostModel":
        """A model with ``values`` (unknown keys ignored; lists, as JSON stores ``row_factors``, taken as
        tuples) over the defaults."""
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: _frozen(v) for k, v in (values or {}).items() if k in known})


def _frozen(value):
    """``value`` with every list turned into a tuple (hashable: plans are memoised on the constants)."""
    return tuple(_frozen(v) for v in value) if isinstance(value, (list, tuple)) else value


#: Registers per thread assumed for occupancy (ptxas reports 207-255 on sm_90a; a block's register
#: allocation rounds up, so 255 is the safe bound: 128-thread kernels fit twice per SM).
REGISTERS_PER_THREAD = 255
#: Shared memory the runtime reserves per resident block (sm_80 and newer).
SHARED_BYTES_RESERVED_PER_BLOCK = 1024


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    """Static properties of a device that planning depends on."""

    name: str
    platform: str  # "cpu" or "cuda"
    arch: int = 0  # compute capability as major*10+minor (90 for sm_90); 0 on CPU
    sm_count: int = 0
    smem_per_block: int = 0
    smem_per_sm: int = 0
    registers_per_sm: int = 65536


#: Used when no CUDA device is present (e.g. exporting for CUDA from a CPU host): an H200.
DEFAULT_CUDA_DEVICE = DeviceInfo(name="NVIDIA H200 (default)", platform="cuda", arch=90, sm_count=132,
                                 smem_per_block=227 * 1024, smem_per_sm=228 * 1024)
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
                      smem_per_block=DEFAULT_CUDA_DEVICE.smem_per_block,
                      smem_per_sm=DEFAULT_CUDA_DEVICE.smem_per_sm)


@dataclasses.dataclass(frozen=True)
class Plan:
    """An immutable launch plan. ``attrs()`` gives the FFI attributes it bakes into the call."""

    platform: str
    family: str  # "cpu_reference", "portable" (mma.sync) or "hopper" (wgmma, sm_90): kernel_tables.kernel_family
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
    batch_invariant: bool
    device_name: str
    reason: str
    predicted_us: Optional[float] = None  # the cost model's estimate (CUDA)
    # Staging (CUDA): the BF16 format the cache is dequantized into before the kernel runs (the tiles,
    # splits and family above are that format's), and the copy's bytes; None / 0 without staging.
    staged_format: Optional[str] = None
    staged_bytes: int = 0

    @property
    def workspace_shape(self) -> tuple:
        return (self.workspace_bytes,)

    def attrs(self) -> dict:
        """Plan attributes of the FFI call (the attribute contract of the ``jax_sparse_mla_fwd_v2`` target)."""
        return {
            "variant": VARIANT_IDS[self.variant],
            "num_splits": self.num_splits,
            "split_size": self.split_size,
            "heads_per_block": self.heads_per_block,
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
        if self.staged_format is not None:
            lines.insert(3, f"  staging: the {self.kv_format} cache is dequantized into a {self.staged_format} copy "
                            f"({self.staged_bytes} bytes) that the kernel reads")
        return "\n".join(lines)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, b: int) -> int:
    return _ceil_div(a, b) * b


def resident_blocks(kv_format: str, heads_per_block: int, device: DeviceInfo, split_size=None) -> int:
    """Blocks of the kernel that runs a plan (``split_size``: a decode plan's; ``None``: one split over
    the whole list) that fit on one SM at once: limited by registers and shared memory."""
    return _resident(kv_format, heads_per_block, device, _family(get_format(kv_format), heads_per_block,
                                                                 split_size, device))


def _kernel(kv_format: str, heads_per_block: int, family: str) -> kernel_tables.KernelConfig:
    """The launch shape of the (format, head tile) kernel of ``family`` ("hopper" or "portable")."""
    tables = kernel_tables.HOPPER_KERNELS if family == "hopper" else kernel_tables.KERNELS
    return tables[(kv_format, heads_per_block)]


def _cluster_blocks(kv_format: str, heads_per_block: int, family: str) -> int:
    """Blocks per (token, head tile, split) of the kernel of ``family``: a lane-sliced Hopper tile's
    cluster (each of its blocks costs a block of its slice's rows), 1 otherwise."""
    return _kernel(kv_format, heads_per_block, family).cluster_blocks


def head_tiles(kv_format: str, device: DeviceInfo) -> tuple:
    """The head tiles a CUDA plan for ``device`` may take: the format's portable tiles, and its Hopper-only
    tiles (:data:`kernel_tables.HOPPER_ONLY_TILES`) where the Hopper family runs them on ``device``."""
    key = get_format(kv_format).key
    only = tuple(t for t in kernel_tables.HOPPER_ONLY_TILES.get(key, ())
                 if _family(get_format(key), t, None, device) == "hopper")
    return tuple(sorted(kernel_tables.HEAD_TILES[key] + only))


def _resident(kv_format: str, heads_per_block: int, device: DeviceInfo, family: str) -> int:
    kernel = _kernel(kv_format, heads_per_block, family)
    by_registers = device.registers_per_sm // (kernel.threads * REGISTERS_PER_THREAD)
    by_shared = device.smem_per_sm // (kernel.shared_bytes + SHARED_BYTES_RESERVED_PER_BLOCK)
    return max(1, min(by_registers, by_shared))


def option_us(model: CostModel, fmt: KVFormat, num_tokens: int, num_heads: int, candidates: int, variant: str,
              heads_per_block: int, num_splits: int, device: DeviceInfo) -> float:
    """The model's time for one choice: ``candidates`` positions of each row read
    (:func:`jax_sparse_mla.kernel_tables.decode_positions`), ``num_splits`` rounded to whole split granules."""
    base_blocks = num_tokens * _ceil_div(num_heads, heads_per_block)
    conversion = kernel_tables.row_conversion(fmt.key)
    if variant == "prefill":
        family = _family(fmt, heads_per_block, None, device)
        return model.kernel_us(base_blocks * _cluster_blocks(fmt.key, heads_per_block, family), candidates,
                               heads_per_block, device.sm_count, _resident(fmt.key, heads_per_block, device, family),
                               family, conversion, fmt.key)
    split_size, num_splits = split_layout(candidates, num_splits)
    family = _family(fmt, heads_per_block, split_size, device)
    base_blocks *= _cluster_blocks(fmt.key, heads_per_block, family)
    return (model.kernel_us(base_blocks * num_splits, split_size, heads_per_block, device.sm_count,
                            _resident(fmt.key, heads_per_block, device, family), family, conversion, fmt.key)
            + model.combine_us(num_splits, num_tokens, num_heads, fmt.d_v, device.sm_count))


def split_layout(candidates: int, num_splits: int):
    """(split size, split count) for about ``num_splits`` splits of whole granules."""
    split_size = _round_up(_ceil_div(candidates, num_splits), kernel_tables.SPLIT_GRANULE)
    return split_size, _ceil_div(candidates, split_size)


def staging_format(kv_format: Union[str, KVFormat]) -> Optional[KVFormat]:
    """The ``bf16_*`` format a cache of ``kv_format`` can be staged into without changing a value: the
    formats whose CUDA kernels convert rows to BF16 exactly (``row_conversion`` ``"converted"``: power-of-two,
    UE8M0 and E4M3-scaled FP4 rows) and whose K and V widths a BF16 format has; ``None`` for the others
    (arbitrary FP32 scales, ``dots3_swa``'s width, the ``bf16_*`` formats themselves)."""
    fmt = get_format(kv_format)
    if not fmt.quantized or kernel_tables.row_conversion(fmt.key) != "converted":
        return None
    return next((f for f in FORMATS.values() if not f.quantized and (f.d_qk, f.d_v) == (fmt.d_qk, fmt.d_v)), None)


def _cuda_options(fmt: KVFormat, num_tokens, num_heads, topk, extra_topk, device: DeviceInfo, model: CostModel,
                  impl, staged: Optional[KVFormat] = None, stage_us: float = 0.0):
    """Every (predicted µs, variant, head tile, splits, split size, staged format key) the planner may choose
    from; the costs and the splits count the candidate positions the kernels read
    (:func:`kernel_tables.decode_positions`). With ``staged``, the same choices of that format's kernels
    after a staging pass of ``stage_us`` are added."""
    options = []
    kernels = [(fmt, 0.0)] + ([(staged, stage_us)] if staged is not None else [])
    for kernel_fmt, extra_us in kernels:
        key = None if kernel_fmt is fmt else kernel_fmt.key
        positions = kernel_tables.decode_positions(kernel_fmt.key, topk, extra_topk)
        for heads_per_block in head_tiles(kernel_fmt.key, device):
            if impl in ("auto", "prefill"):
                us = option_us(model, kernel_fmt, num_tokens, num_heads, positions, "prefill", heads_per_block, 1,
                               device)
                options.append((us + extra_us, "prefill", heads_per_block, 1, topk + extra_topk, key))
            if impl in ("auto", "decode"):
                for splits in SPLIT_CHOICES:
                    split_size, splits = split_layout(positions, splits)
                    us = option_us(model, kernel_fmt, num_tokens, num_heads, positions, "decode", heads_per_block,
                                   splits, device)
                    options.append((us + extra_us, "decode", heads_per_block, splits, split_size, key))
    return options


def _plan_cuda(fmt: KVFormat, num_tokens, num_heads, topk, extra_topk, device: DeviceInfo, batch_invariant,
               impl, model: CostModel, calibrated: bool, num_slots: Optional[int] = None,
               staging: str = "auto") -> Plan:
    common = dict(platform="cuda", kv_format=fmt.key, num_tokens=num_tokens,
                  num_heads=num_heads, topk=topk, extra_topk=extra_topk, batch_invariant=batch_invariant,
                  device_name=device.name)
    source = "calibrated" if calibrated else "default"
    if batch_invariant:
        tiles = kernel_tables.HEAD_TILES[fmt.key]
        heads_per_block = next((t for t in tiles if t >= num_heads), tiles[-1])
        split_size = _round_up(BATCH_INVARIANT_SPLIT_SIZE, kernel_tables.SPLIT_GRANULE)
        # Over the whole index rows (a window's tail splits are empty blocks): the layout is the same for
        # every format and T.
        num_splits = _ceil_div(topk + extra_topk, split_size)
        return Plan(variant="decode", heads_per_block=heads_per_block, num_splits=num_splits, split_size=split_size,
                    family=_family(fmt, heads_per_block, split_size, device),
                    workspace_bytes=kernel_tables.workspace_bytes(num_splits, num_tokens, num_heads, fmt.d_v),
                    reason=f"batch_invariant: fixed {split_size}-candidate splits and head tile {heads_per_block}, "
                           f"independent of T", **common)
    # Staging (module docstring): only where it leaves every value as it is and the result independent
    # of T (a batch-invariant plan must not depend on T, and whether staging pays does).
    staged = staging_format(fmt) if num_slots and not extra_topk and staging != "off" else None
    if staged is not None and num_slots * staged.bytes_per_token > STAGE_MAX_BYTES:
        staged = None
    stage_us = model.stage_us(num_slots, fmt, staged) if staged is not None else 0.0
    options = _cuda_options(fmt, num_tokens, num_heads, topk, extra_topk, device, model, impl, staged, stage_us)
    if staged is not None and staging == "on":
        options = [o for o in options if o[5] is not None]
    elif staged is not None:
        # The cost model's own choice stages only onto head tiles the call fills (no padded heads): the
        # BF16 kernels have no Hopper 16-head tile, and the padded 64-head tile over BF16 rows costs more
        # than the model says when a token has one head tile (dsv4_nvfp4 T = 4096 H = 16, predicted 0.90x
        # the unstaged plan: measured 1.12x on an H100).
        options = [o for o in options if o[5] is None or o[2] <= num_heads]
    # Ties (the MMA term is hidden on some GPUs) go to fewer splits, then to the smaller head tile (no
    # wasted rows), then to no staging.
    best = min(options, key=lambda o: (o[0], o[3], o[2], o[5] is not None))
    us, variant, heads_per_block, num_splits, split_size, staged_key = best
    runner_up = sorted((o for o in options if o is not best), key=lambda o: o[0])
    alternative = ""
    if runner_up:
        r = runner_up[0]
        alternative = (f"; next best {r[1]} x{r[3]} splits, head tile {r[2]}"
                       + (f" on a {r[5]} copy" if r[5] else "") + f": {r[0]:.1f} us")
    forced = f"impl={impl!r} requested; " if impl != "auto" else ""
    copy = f" after staging the cache as {staged_key} ({stage_us:.1f} us of it)" if staged_key else ""
    reason = (f"{forced}cost model ({source} constants, {device.sm_count} SMs) predicts {us:.1f} us for "
              f"{variant}" + (f" with {num_splits} splits" if variant == "decode" else "") +
              f" and head tile {heads_per_block}{copy}{alternative}")
    kernel_fmt = get_format(staged_key) if staged_key else fmt
    workspace = kernel_tables.workspace_bytes(num_splits, num_tokens, num_heads, fmt.d_v) if variant == "decode" else 0
    return Plan(variant=variant, heads_per_block=heads_per_block, num_splits=num_splits if variant == "decode" else 1,
                split_size=split_size, workspace_bytes=workspace, reason=reason, predicted_us=us,
                family=_family(kernel_fmt, heads_per_block, split_size if variant == "decode" else None, device),
                staged_format=staged_key, staged_bytes=num_slots * kernel_fmt.bytes_per_token if staged_key else 0,
                **common)


def _family(fmt: KVFormat, heads_per_block: int, split_size, device: DeviceInfo) -> str:
    """The kernel family that runs a plan's (format, head tile, split size) on ``device``."""
    return kernel_tables.kernel_family(fmt.key, heads_per_block, device.arch, device.smem_per_block,
                                       _ffi.hopper_compiled(), split_size)


@functools.lru_cache(maxsize=4096)
def _plan_cached(q_shape, fmt_key, topk, extra_topk, platform, device, batch_invariant, impl, constants,
                 num_slots=None, staging="auto") -> Plan:
    fmt = get_format(fmt_key)
    num_heads = q_shape[-2]
    num_tokens = 1
    for d in q_shape[:-2]:
        num_tokens *= d
    if platform == "cpu":
        return Plan(platform="cpu", family="cpu_reference", variant="reference", kv_format=fmt.key,
                    num_tokens=num_tokens, num_heads=num_heads, topk=topk, extra_topk=extra_topk,
                    heads_per_block=num_heads, num_splits=1, split_size=topk + extra_topk, workspace_bytes=0,
                    batch_invariant=batch_invariant, device_name=device.name,
                    reason="the CPU runs the C++ reference kernel (one pass, no workspace; batch invariant)")
    model = CostModel.from_dict(dict(constants) if constants is not None else None)
    return _plan_cuda(fmt, num_tokens, num_heads, topk, extra_topk, device, batch_invariant, impl, model,
                      constants is not None, num_slots, staging)


def _check_plan_arguments(fmt: KVFormat, q_shape, topk, extra_topk, platform, impl, batch_invariant) -> None:
    """plan()'s arguments against the format and the envelope's rules (validate.RULES)."""
    shape = tuple(q_shape)
    if (len(shape) not in (3, 4) or any(isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 0
                                        for d in shape) or shape[-1] != fmt.d_qk):
        raise ValueError(f"q_shape: expected (T, H, {fmt.d_qk}) or (B, S, H, {fmt.d_qk}) for format {fmt.key}, "
                         f"got {q_shape!r}")
    if impl == "xla":
        raise ValueError("impl: expected 'auto', 'decode' or 'prefill' for planning, got 'xla' (it never plans)")
    # (argument named in the error, rule, the values it reads)
    checks = [("q_shape", "num_heads", dict(num_heads=int(shape[-2]))), ("topk", "topk", dict(topk=topk)),
              ("platform", "platform", dict(platform=platform)), ("impl", "impl", dict(impl=impl)),
              ("impl", "impl_on_platform", dict(impl=impl, platform=platform)),
              ("batch_invariant", "batch_invariant", dict(batch_invariant=batch_invariant, impl=impl))]
    if extra_topk != 0:
        checks += [("extra_topk", "topk", dict(topk=extra_topk)), ("extra_topk", "dual_cache", dict(dual_cache=True))]
    for argument, name, given in checks:
        problem = RULE[name].violation(fmt, given)
        if problem is not None:
            raise ValueError(f"{argument}: unsupported for format {fmt.key}: {problem}")
    if RULE["format_on_platform"].violation(fmt, dict(platform=platform, impl=impl)) is not None:
        raise ValueError(f"kv_format: {fmt.key!r} has no CUDA kernel yet; plan for platform='cpu' or use impl='xla'")


def plan(q_shape, kv_format: Union[str, KVFormat], topk: int, *, extra_topk: int = 0, platform: str,
         device: Optional[DeviceInfo] = None, batch_invariant: bool = False, impl: str = "auto",
         cost_model: Optional[CostModel] = None, num_slots: Optional[int] = None) -> Plan:
    """Plans one ``sparse_mla`` call.

    Args:
      q_shape: the query's shape, ``(T, H, d_qk)`` or ``(B, S, H, d_qk)``, with the format's ``d_qk``.
      kv_format: format key or :class:`~jax_sparse_mla.KVFormat`.
      topk: width of the index rows (candidates per query row).
      extra_topk: width of the extra cache's index rows (``dsv4``/``dsv4_1``); 0 without an extra cache.
      platform: ``"cpu"`` or ``"cuda"``.
      device: the device description; ``None`` uses the local device of that platform or
        :data:`DEFAULT_CUDA_DEVICE`.
      batch_invariant: fix the candidate chunking and combine order independently of T.
      impl: ``"auto"``, ``"decode"`` or ``"prefill"`` (``"xla"`` never reaches the planner).
      cost_model: constants to plan with; ``None`` uses the device's calibration (if any) over the
        model defaults.
      num_slots: the main cache's slot count (``sparse_mla`` passes it). With it a CUDA plan may stage
        the cache as a BF16 copy (``Plan.staged_format``; module docstring, where ``JSMLA_CUDA_STAGING``
        is too); ``None`` plans without staging.

    Returns:
      A memoised :class:`Plan`.

    Raises:
      ValueError: an unknown format or platform, a ``q_shape`` the format does not have, a head count,
        ``topk`` or ``extra_topk`` outside the envelope, or an ``impl`` (with ``batch_invariant``) the
        platform cannot run (the rules of :func:`~jax_sparse_mla.check_supported`); a ``num_slots`` that
        is not a positive int; ``JSMLA_CUDA_STAGING`` set to another value than ``auto``, ``on``, ``off``.
    """
    fmt = get_format(kv_format)
    _check_plan_arguments(fmt, q_shape, topk, extra_topk, platform, impl, batch_invariant)
    if device is None:
        device = device_info(platform)
    if cost_model is not None:
        constants = tuple(sorted((k, _frozen(v)) for k, v in cost_model.to_dict().items()))
    elif platform == "cuda":
        calibrated = calibration_store.device_constants(device.name)
        constants = None if calibrated is None else tuple(sorted((k, _frozen(v)) for k, v in calibrated.items()))
    else:
        constants = None
    if num_slots is not None and (isinstance(num_slots, bool) or not isinstance(num_slots, (int, np.integer))
                                  or num_slots < 1):
        raise ValueError(f"num_slots: expected a positive int or None, got {num_slots!r}")
    return _plan_cached(tuple(int(d) for d in q_shape), fmt.key, int(topk), int(extra_topk), platform, device,
                        bool(batch_invariant), impl, constants, None if num_slots is None else int(num_slots),
                        staging_mode() if platform == "cuda" else "auto")


def clear_cache() -> None:
    """Forgets memoised plans (calibration changes are picked up without it; this is for tests)."""
    _plan_cached.cache_clear()
