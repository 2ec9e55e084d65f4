"""Where one benchmark step's device time goes: the kernels a jitted ``sparse_mla`` step launches.

    # wall time per step for several scan lengths (dispatch amortisation)
    python benchmarks/step_profile.py --tokens 128 --heads 128 --steps 8,32
    # per-kernel device times (boost clocks kept; ncu flushes the caches before every kernel unless
    # --cache-control none is given), then the summary table of the measured call
    ncu --clock-control none --metrics gpu__time_duration.sum --csv \\
        python benchmarks/step_profile.py --tokens 128 --heads 128 --steps 4 --once > kernels.csv
    python benchmarks/step_profile.py --summarize kernels.csv --steps 4

Same cache, query and index distributions as ``bench.py`` (``dsv3_2`` unless ``--format``, 192 MB pool,
page 64, random indices, topk 2048). ``--once`` runs the jitted scan twice (compile, then one measured
call) so a profiler sees exactly one call's kernels last. ``--gradient q`` (or ``cache``, a ``bf16_*``
cache) makes the step ``jax.grad`` of ``sum(out) + sum(finite lse)`` with respect to q (and the cache):
the forward and the backward's kernels, e.g.

    ncu --clock-control none --metrics gpu__time_duration.sum --csv python benchmarks/step_profile.py \
        --format bf16_576 --tokens 1024 --heads 128 --gradient cache --steps 1 --once > backward.csv
"""

from __future__ import annotations

import argparse
import collections
import csv
import statistics
import sys
import time

TOPK = 2048


def summarize(path, steps):
    """Per-kernel device time of the last jitted call in an ncu CSV (gpu__time_duration.sum)."""
    rows = []
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]
    for row in csv.DictReader(lines):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        value = float(row["Metric Value"].replace(",", ""))
        unit = row.get("Metric Unit", "ns")
        scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}.get(unit, 1e-3)
        rows.append((row["Kernel Name"], value * scale))
    # With --once the jitted call runs twice (warm-up, then the measured call) after the setup and
    # compilation kernels, so the profile ends with two identical kernel sequences: the longest tail of
    # length L whose previous L names repeat it is the measured call.
    names = [name for name, _ in rows]
    call = 0
    for length in range(1, len(rows) // 2 + 1):
        if names[-2 * length:-length] == names[-length:]:
            call = length
    if call == 0:
        print("no repeated call found at the end of the profile (run the script with --once)")
        return
    per_name = collections.OrderedDict()
    for name, us in rows[-call:]:
        per_name.setdefault(name[:90], []).append(us)
    print(f"measured call: {call} kernels over {steps} steps")
    print(f"{'kernel':90s} {'launches':>8s} {'median µs':>10s} {'µs per step':>12s}")
    total = 0.0
    for name, values in per_name.items():
        total += sum(values) / steps
        print(f"{name:90s} {len(values):8d} {statistics.median(values):10.1f} {sum(values) / steps:12.1f}")
    print(f"{'all kernels of the call, per step':90s} {'':8s} {'':10s} {total:12.1f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--heads", type=int, default=128)
    parser.add_argument("--impl", default="auto")
    parser.add_argument("--format", default="dsv3_2", help="cache format")
    parser.add_argument("--gradient", choices=("none", "q", "cache"), default="none",
                        help="step = the forward (none), or jax.grad with respect to q (q) or q and the cache")
    parser.add_argument("--steps", default="8,32", help="comma-separated scan lengths")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--once", action="store_true", help="compile, then run one call (for a profiler)")
    parser.add_argument("--summarize", metavar="CSV", help="print the per-kernel table of an ncu CSV and exit")
    args = parser.parse_args()
    step_counts = [int(s) for s in args.steps.split(",")]
    if args.summarize:
        summarize(args.summarize, step_counts[0])
        return 0

    import jax
    import jax.numpy as jnp
    import numpy as np

    import jax_sparse_mla as jsm

    fmt = jsm.get_format(args.format)
    if args.gradient == "cache" and fmt.quantized:
        parser.error(f"--gradient cache needs a bf16_* cache: {fmt.key}'s is a constant")
    page_size = 64
    pages = -(-(192 * 1024 * 1024) // (page_size * fmt.bytes_per_token))
    kv = jax.random.normal(jax.random.PRNGKey(0), (pages * page_size, fmt.d_qk), jnp.float32)
    cache = jax.jit(lambda x: jsm.quantize_kv(x, fmt, page_size=page_size))(kv)
    del kv
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((args.tokens, args.heads, fmt.d_qk)), jnp.bfloat16)
    sm_scale = fmt.d_qk ** -0.5
    plan = jsm.plan(q.shape, fmt, TOPK, platform="cuda" if jax.default_backend() == "gpu" else "cpu",
                    impl=args.impl)
    print(plan.describe(), file=sys.stderr)

    def loss(q, cache, idx):
        out, lse = jsm.sparse_mla(q, cache, idx, kv_format=fmt, sm_scale=sm_scale, impl=args.impl)
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    @jax.jit
    def run(q, cache, xs):
        def step(carry, idx):
            if args.gradient == "none":
                out, _ = jsm.sparse_mla(q, cache, idx, kv_format=fmt, sm_scale=sm_scale, impl=args.impl)
                return carry + jnp.sum(out.astype(jnp.float32)), None
            grads = jax.grad(loss, argnums=(0,) if args.gradient == "q" else (0, 1))(q, cache, idx)
            return carry + sum(jnp.sum(g.astype(jnp.float32)) for g in grads), None

        return jax.lax.scan(step, jnp.zeros((), jnp.float32), xs, unroll=True)[0]

    for steps in step_counts:
        xs = jnp.asarray(rng.integers(0, pages * page_size, (steps, args.tokens, TOPK)), jnp.int32)
        jax.block_until_ready(run(q, cache, xs))
        if args.once:
            jax.block_until_ready(run(q, cache, xs))
            continue
        samples = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            jax.block_until_ready(run(q, cache, xs))
            samples.append((time.perf_counter() - start) / steps * 1e6)
        print(f"{fmt.key} T={args.tokens} H={args.heads} impl={args.impl} gradient={args.gradient} steps={steps}: median {statistics.median(samples):.1f} "
              f"µs/step (min {min(samples):.1f}, max {max(samples):.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
