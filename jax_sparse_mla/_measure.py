"""On-device measurements behind :func:`jax_sparse_mla.calibration.calibrate`.

Times forced plans of the CUDA kernels (PERF.md method: a ``lax.scan`` over rotating index sets in
one jitted call, median of several calls) and fits :class:`jax_sparse_mla.planner.CostModel`:

- per head tile h, single-block prefill launches over two candidate counts give the per-candidate
  slope ``dequant_ns + h * mma_ns_per_head`` and the per-block intercept; two head tiles separate
  the two terms;
- one and two blocks per SM of the small tile give the throughput gain of co-resident blocks;
- a decode launch with many splits, against the same work unsplit, gives the combine's bandwidth.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from . import _ffi, cuda_config, planner, validate
from .formats import get_format, quantize_kv

_STEPS = 8
_REPEATS = 7
_POOL_BYTES = 192 * 1024 * 1024


def time_plan(plan, problem, q, cache, indices_sets) -> float:
    """Median µs per call of one forced plan (indices_sets: int32 [steps, T, topk])."""

    @jax.jit
    def run(q, cache, indices_sets):
        def step(carry, indices):
            out, _ = _ffi.call(plan, problem, q, cache, indices, None, None, None, None, None,
                               jnp.int32(problem.num_tokens))
            return carry + jnp.sum(out[:, :1, :8].astype(jnp.float32)), None

        total, _ = jax.lax.scan(step, jnp.zeros((), jnp.float32), indices_sets, unroll=True)
        return total

    jax.block_until_ready(run(q, cache, indices_sets))
    samples = []
    for _ in range(_REPEATS):
        start = time.perf_counter()
        jax.block_until_ready(run(q, cache, indices_sets))
        samples.append((time.perf_counter() - start) / indices_sets.shape[0] * 1e6)
    return statistics.median(samples)


def forced_plan(problem, variant: str, heads_per_block: int, num_splits: int = 1):
    """A CUDA plan with the given choices (bypassing the cost model)."""
    base = planner.plan((problem.num_tokens, problem.num_heads, problem.fmt.d_qk), problem.fmt, problem.topk,
                        platform="cuda", impl="prefill")
    candidates = problem.topk
    granule = cuda_config.SPLIT_GRANULE
    split_size = -(-(-(-candidates // num_splits)) // granule) * granule
    num_splits = -(-candidates // split_size)
    workspace = (cuda_config.workspace_bytes(num_splits, problem.num_tokens, problem.num_heads, problem.fmt.d_v)
                 if variant == "decode" else 0)
    return dataclasses.replace(base, variant=variant, heads_per_block=heads_per_block, num_splits=num_splits,
                               split_size=split_size if variant == "decode" else candidates,
                               workspace_bytes=workspace, reason="forced", predicted_us=None)


class _Bench:
    """A random cache several times the L2 and helpers to time shapes on it."""

    def __init__(self, kv_format: str, seed: int = 0):
        self.fmt = get_format(kv_format)
        page_size = 64
        pages = -(-_POOL_BYTES // (page_size * self.fmt.bytes_per_token))
        kv = jax.random.normal(jax.random.PRNGKey(seed), (pages * page_size, self.fmt.d_qk), jnp.float32)
        self.cache = jax.jit(lambda x: quantize_kv(x, self.fmt, page_size=page_size))(kv)
        self.num_slots = pages * page_size
        self.rng = np.random.default_rng(seed)

    def time(self, tokens: int, heads: int, topk: int, variant: str, heads_per_block: int, num_splits: int = 1):
        q = jnp.asarray(self.rng.standard_normal((tokens, heads, self.fmt.d_qk)), jnp.bfloat16)
        indices = jnp.asarray(self.rng.integers(0, self.num_slots, (_STEPS, tokens, topk)), jnp.int32)
        problem = validate.normalize(q, self.cache, indices[0], kv_format=self.fmt, sm_scale=self.fmt.d_qk ** -0.5)
        plan = forced_plan(problem, variant, heads_per_block, num_splits)
        return time_plan(plan, problem, q, self.cache, indices)


def measure_cost_model(device, *, formats, heads, topks, progress: Optional[Callable] = None) -> dict:
    """Fits the cost model on the local device; returns its constants as a dict."""
    del heads  # the fit uses the instantiated head tiles; the argument keeps the CLI's grid explicit
    fits = []
    topk = max(topks)
    steps_total = len(formats) * 6
    done = 0

    def tick(label):
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, steps_total, label)

    for kv_format in formats:
        bench = _Bench(kv_format)
        tiles = cuda_config.HEAD_TILES[kv_format]
        small, large = tiles[0], tiles[-1]
        slopes, intercepts = {}, {}
        for tile in (small, large):
            long_us = bench.time(1, tile, topk, "prefill", tile)
            tick(f"{kv_format} 1 block x {topk} candidates, head tile {tile}")
            short_us = bench.time(1, tile, topk // 4, "prefill", tile)
            tick(f"{kv_format} 1 block x {topk // 4} candidates, head tile {tile}")
            slopes[tile] = max((long_us - short_us) / (0.75 * topk), 1e-6) * 1e3  # ns per candidate
            intercepts[tile] = max(short_us - slopes[tile] * (topk // 4) / 1e3, 0.0)
        mma_ns = max((slopes[large] - slopes[small]) / (large - small), 0.0)
        dequant_ns = max(slopes[small] - small * mma_ns, 0.0)
        block_us = statistics.mean(intercepts.values())
        # Co-residency: one block per SM, then two per SM of the small tile (which fits twice).
        one_us = bench.time(device.sm_count, small, topk, "prefill", small)
        two_us = bench.time(2 * device.sm_count, small, topk, "prefill", small)
        tick(f"{kv_format} {2 * device.sm_count} small-tile blocks (co-residency)")
        gain = min(max(2.0 * one_us / max(two_us, 1e-6), 1.0), 2.0)
        splits = 16
        split_us = bench.time(8, large, topk, "decode", large, splits)
        tick(f"{kv_format} decode {splits} splits (combine)")
        fits.append(dict(dequant_ns=dequant_ns, mma_ns_per_head=mma_ns, block_us=block_us, co_residency_gain=gain,
                         split_us=split_us))
    model = planner.CostModel()
    constants = dict(
        launch_us=model.launch_us,
        block_us=statistics.mean(f["block_us"] for f in fits),
        dequant_ns=statistics.mean(f["dequant_ns"] for f in fits),
        mma_ns_per_head=statistics.mean(f["mma_ns_per_head"] for f in fits),
        co_residency_gain=statistics.mean(f["co_residency_gain"] for f in fits),
    )
    # The combine's share of the split measurement: what the model leaves unexplained by the kernel.
    fitted = planner.CostModel.from_dict(constants)
    last = fits[-1]
    fmt = get_format(formats[-1])
    large = cuda_config.HEAD_TILES[formats[-1]][-1]
    split_size = -(-topk // 16)
    kernel_only = fitted.kernel_us(8 * 16, split_size, large, device.sm_count,
                                   planner.resident_blocks(formats[-1], large, device))
    moved = 16 * 8 * large * (fmt.d_v + 1) * 4 + 8 * large * (2 * fmt.d_v + 4)
    combine_share = max(last["split_us"] - kernel_only - fitted.launch_us, 1.0)
    constants["combine_gbps"] = min(max(moved / combine_share / 1e3, 100.0), 4000.0)
    return constants
