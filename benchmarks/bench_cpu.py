"""CPU benchmark: the C++ CPU kernel (the default lowering on a CPU backend) against ``impl="xla"`` (the
pure-JAX gather + einsum lowering) in the same run, with a correctness check of one against the other.

    python benchmarks/bench_cpu.py                                  # every case below
    python benchmarks/bench_cpu.py --cases dsv3_2:16:128:2048       # format:T:H:topk

Method: each case builds a cache of ``--pool_tokens`` random tokens (larger than the last-level cache)
and draws random candidate indices over all of it; both lowerings are jitted with the cache as an
argument, called twice to warm up, then timed over ``--repeats`` calls (each waited for with
``block_until_ready``); the median is reported. FLOPs are counted as ``2·T·H·topk·(d_qk + d_v)``.
Before timing, the kernel's output is checked against ``impl="xla"`` with the library's accuracy
contract (max |out - ref| <= 2e-2·max(1, max |ref|), relative L2 <= 1e-2, |lse - ref| <= 1e-3).
The machine's load average is recorded before and after the run, since other processes on the
same cores disturb the numbers.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time

from absl import app, flags, logging

flags.DEFINE_list("cases", [], "Run only these cases, as format:T:H:topk (default: all of CASES).")
flags.DEFINE_integer("repeats", 5, "Timed calls per lowering and case; the median is reported.")
flags.DEFINE_integer("pool_tokens", 65536, "Tokens in each benchmark cache.")
flags.DEFINE_string("out_dir", os.path.join(os.path.dirname(__file__), "results"), "Where results go.")
flags.DEFINE_string("tag", "", "Suffix of the result file names.")
FLAGS = flags.FLAGS

#: (format, T, H, topk): the decode and prefill shapes of the DeepSeek-V3.2 format, then one case per
#: other format family (inline with arbitrary scales, footer pages, unquantized rows, sliding window).
CASES = (
    ("dsv3_2", 1, 128, 2048),
    ("dsv3_2", 16, 128, 2048),
    ("dsv3_2", 128, 128, 512),
    ("dsv3_2", 64, 16, 2048),
    ("dsv3_2", 1, 16, 2048),
    ("dsv3_2", 256, 128, 2048),
    ("glm_nsa", 16, 128, 2048),
    ("dsv4", 16, 128, 2048),
    ("bf16_576", 16, 128, 2048),
    ("dots3_swa", 16, 128, 512),
)

PAGE_SIZE = 64


def median_call_seconds(fn, args, repeats):
    """Median and fastest wall seconds of one call of the jitted ``fn(*args)`` after two warm-up calls."""
    import jax

    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append(time.perf_counter() - start)
    return statistics.median(samples), min(samples)


def accuracy(out, lse, ref_out, ref_lse):
    """The library's accuracy contract of ``(out, lse)`` against ``(ref_out, ref_lse)`` (numpy arrays)."""
    import numpy as np

    out = out.astype(np.float64)
    ref = ref_out.astype(np.float64)
    err = float(np.max(np.abs(out - ref)))
    bound = 2e-2 * max(1.0, float(np.max(np.abs(ref))))
    rel_l2 = float(np.linalg.norm(out - ref) / max(float(np.linalg.norm(ref)), 1e-30))
    finite = np.isfinite(ref_lse)
    lse_err = float(np.max(np.abs(lse[finite] - ref_lse[finite]))) if finite.any() else 0.0
    same_inf = bool(np.array_equal(np.isfinite(lse), finite))
    ok = err <= bound and rel_l2 <= 1e-2 and lse_err <= 1e-3 and same_inf and bool(np.all(np.isfinite(out)))
    return ok, err, rel_l2, lse_err


def build_cache(jsm, kv_format, pool_tokens, seed):
    import jax
    import jax.numpy as jnp

    fmt = jsm.get_format(kv_format)
    kv = jax.random.normal(jax.random.PRNGKey(seed), (pool_tokens, fmt.d_qk), jnp.float32)
    return jax.jit(lambda x: jsm.quantize_kv(x, fmt, page_size=PAGE_SIZE))(kv)


def run_case(jsm, cache, kv_format, tokens, heads, topk, rng):
    import jax
    import jax.numpy as jnp
    import numpy as np

    fmt = jsm.get_format(kv_format)
    sm_scale = fmt.d_qk ** -0.5
    num_slots = cache.shape[0] * PAGE_SIZE
    q = jnp.asarray(rng.standard_normal((tokens, heads, fmt.d_qk)), jnp.bfloat16)
    indices = jnp.asarray(rng.integers(0, num_slots, (tokens, topk)), jnp.int32)

    def lowering(impl):
        return jax.jit(lambda q, cache, indices: jsm.sparse_mla(q, cache, indices, kv_format=fmt,
                                                                sm_scale=sm_scale, impl=impl))

    kernel, xla = lowering("auto"), lowering("xla")
    out, lse = (np.asarray(x) for x in kernel(q, cache, indices))
    ref_out, ref_lse = (np.asarray(x) for x in xla(q, cache, indices))
    ok, err, rel_l2, lse_err = accuracy(out, lse, ref_out, ref_lse)
    kernel_s, kernel_min_s = median_call_seconds(kernel, (q, cache, indices), FLAGS.repeats)
    xla_s, xla_min_s = median_call_seconds(xla, (q, cache, indices), FLAGS.repeats)
    flops = 2.0 * tokens * heads * topk * (fmt.d_qk + fmt.d_v)
    return {
        "format": kv_format, "T": tokens, "H": heads, "topk": topk, "kernel_ms": kernel_s * 1e3,
        "kernel_min_ms": kernel_min_s * 1e3, "xla_ms": xla_s * 1e3, "xla_min_ms": xla_min_s * 1e3,
        "speedup": xla_s / kernel_s, "kernel_gflops": flops / kernel_s / 1e9, "xla_gflops": flops / xla_s / 1e9,
        "check": "ok" if ok else "FAIL", "max_err": err, "rel_l2": rel_l2, "lse_err": lse_err,
    }


def machine_description():
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{model}, {cores} cores usable"


def write_results(rows, machine, load_before, load_after):
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    suffix = f"_{FLAGS.tag}" if FLAGS.tag else ""
    threads = os.environ.get("JAX_SPARSE_MLA_CPU_THREADS", "all usable cores")
    isa = os.environ.get("JAX_SPARSE_MLA_CPU_ISA", "the best the CPU supports")
    with open(os.path.join(FLAGS.out_dir, f"bench_cpu{suffix}.json"), "w") as f:
        json.dump({"machine": machine, "threads": threads, "instruction_set": isa, "repeats": FLAGS.repeats,
                   "pool_tokens": FLAGS.pool_tokens, "load_average_before": load_before,
                   "load_average_after": load_after, "rows": rows}, f, indent=1)
    lines = [f"Machine: {machine}; kernel threads: {threads}; instruction set: {isa}. Median wall time of one "
             f"jitted call ({FLAGS.repeats} calls after 2 warm-up calls), cache of {FLAGS.pool_tokens} tokens, "
             f"random indices. Load average (1/5/15 min) before: {' '.join(f'{x:.2f}' for x in load_before)}, "
             f"after: {' '.join(f'{x:.2f}' for x in load_after)}.", "",
             "| format | T | H | topk | kernel ms | GFLOP/s | `impl=\"xla\"` ms | GFLOP/s | speed-up | check |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['format']} | {r['T']} | {r['H']} | {r['topk']} | {r['kernel_ms']:.2f} | "
                     f"{r['kernel_gflops']:.0f} | {r['xla_ms']:.2f} | {r['xla_gflops']:.0f} | "
                     f"{r['speedup']:.2f}× | {r['check']} |")
    table = "\n".join(lines) + "\n"
    with open(os.path.join(FLAGS.out_dir, f"bench_cpu{suffix}.md"), "w") as f:
        f.write(table)
    return table


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    import jax
    import numpy as np

    jax.config.update("jax_platforms", "cpu")
    import jax_sparse_mla as jsm

    cases = ([(f, int(t), int(h), int(k)) for f, t, h, k in (c.split(":") for c in FLAGS.cases)]
             if FLAGS.cases else list(CASES))
    machine = machine_description()
    load_before = os.getloadavg()
    rng = np.random.default_rng(0)
    caches = {}
    rows = []
    for kv_format, tokens, heads, topk in cases:
        if kv_format not in caches:
            caches[kv_format] = build_cache(jsm, kv_format, FLAGS.pool_tokens, seed=len(caches))
        rows.append(run_case(jsm, caches[kv_format], kv_format, tokens, heads, topk, rng))
        print(json.dumps(rows[-1]), flush=True)
    print(write_results(rows, machine, load_before, os.getloadavg()))
    return 0 if all(r["check"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    app.run(main)
