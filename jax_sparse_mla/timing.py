"""Device timing shared by calibration and the benchmarks (``benchmarks/``).

Method: one jitted function runs a step over ``steps`` stacked inputs with ``lax.scan`` (unrolled, every
output consumed); a sample queues :data:`CALLS_PER_SAMPLE` such calls back to back and waits for the
last, so the host's per-call dispatch overlaps the device work of the calls before it and is not
counted; the median over samples, divided by the step count, is the time per step. Inputs should rotate
(a different index set per step) over a cache several times the L2 (:class:`RandomCache`).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Union

import jax
import jax.numpy as jnp
import numpy as np

from .formats import KVFormat, get_format, quantize_kv

__all__ = ["CALLS_PER_SAMPLE", "median_step_seconds", "time_scan", "RandomCache"]

#: Calls queued back to back per timing sample (see median_step_seconds).
CALLS_PER_SAMPLE = 4


def median_step_seconds(run: Callable, args: tuple, steps: int, repeats: int, calls: int = CALLS_PER_SAMPLE):
    """(median, min, max) seconds per scan step of the jitted ``run(*args)`` (a ``lax.scan`` of
    ``steps`` steps).

    Each sample queues ``calls`` calls back to back and then waits for the last one: dispatch is
    asynchronous, so the host's per-call overhead overlaps the device work of the calls before it and
    the sample measures the device's time for ``calls * steps`` steps (plus one dispatch latency).
    Two warm-up calls come first (compilation, first-use costs)."""
    jax.block_until_ready(run(*args))
    jax.block_until_ready(run(*args))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        results = [run(*args) for _ in range(calls)]
        jax.block_until_ready(results)
        samples.append((time.perf_counter() - start) / (calls * steps))
    return statistics.median(samples), min(samples), max(samples)


def time_scan(body: Callable, operands, xs, repeats: int):
    """(median, min, max) seconds per step of ``body(operands, x)`` (a float32 scalar) scanned over
    ``xs`` (leading axis = steps), timed with :func:`median_step_seconds`.

    ``operands`` (the cache, q, ...) are arguments of the jitted function, never closed over: a
    closed-over array would be baked into the executable as a constant."""

    @jax.jit
    def run(operands, xs):
        def step(carry, x):
            return carry + body(operands, x), None

        total, _ = jax.lax.scan(step, jnp.zeros((), jnp.float32), xs, unroll=True)
        return total

    steps = jax.tree_util.tree_leaves(xs)[0].shape[0]
    return median_step_seconds(run, (operands, xs), steps, repeats)


class RandomCache:
    """A cache of random rows of one format, several times the L2 (page size 64), with random inputs.

    Attributes:
      fmt: the format. cache: the quantized cache. num_slots: its token slots. rng: a NumPy generator.
    """

    def __init__(self, kv_format: Union[str, KVFormat], pool_bytes: int = 192 * 1024 * 1024, seed: int = 0,
                 page_size: int = 64):
        self.fmt = get_format(kv_format)
        pages = -(-pool_bytes // (page_size * self.fmt.bytes_per_token))
        kv = jax.random.normal(jax.random.PRNGKey(seed), (pages * page_size, self.fmt.d_qk), jnp.float32)
        self.cache = jax.jit(lambda x: quantize_kv(x, self.fmt, page_size=page_size))(kv)
        self.num_slots = pages * page_size
        self.rng = np.random.default_rng(seed)

    def query(self, tokens: int, heads: int) -> jax.Array:
        """Random bfloat16 queries ``[tokens, heads, d_qk]``."""
        return jnp.asarray(self.rng.standard_normal((tokens, heads, self.fmt.d_qk)), jnp.bfloat16)

    def index_sets(self, steps: int, tokens: int, topk: int) -> jax.Array:
        """``steps`` random index sets ``int32 [steps, tokens, topk]`` over the whole cache."""
        return jnp.asarray(self.rng.integers(0, self.num_slots, (steps, tokens, topk)), jnp.int32)
