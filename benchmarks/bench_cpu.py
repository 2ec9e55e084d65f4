"""CPU benchmark: the C++ CPU kernel (the default lowering on a CPU backend) against ``impl="xla"`` (the
pure-JAX gather + einsum lowering) in the same run, with a correctness check of one against the other.

    python benchmarks/bench_cpu.py                                  # every case below
    python benchmarks/bench_cpu.py --cases dsv3_2:16:128:2048       # format:T:H:topk

Method: each case builds a cache of ``--pool_tokens`` random tokens (larger than the last-level cache)
and draws random candidate indices over all of it; both lowerings are jitted with the cache as an
argument. A round calls one lowering for ``--warmup_seconds`` to warm up, then times ``--repeats`` calls
(each waited for with ``block_until_ready``) and takes their median; ``--rounds`` rounds alternate the
two lowerings, and each lowering's lowest round median is reported (the other processes on a shared
machine then spoil single rounds, not the comparison). FLOPs are counted as ``2·T·H·topk·(d_qk + d_v)``.
Before timing, the kernel's output is checked against ``impl="xla"`` with the library's accuracy
contract (max |out - ref| <= 2e-2·max(1, max |ref|), relative L2 <= 1e-2, |lse - ref| <= 1e-3).
The machine's load average is recorded before and after the run and before each case (the table's
"load" column: the 1-minute average, which counts the benchmark itself), since other processes on the
same cores disturb the numbers.
"""

from __future__ import annotations

import itertools
import json
import os
import platform
import statistics
import time

from absl import app, flags, logging

flags.DEFINE_list("cases", [], "Run only these cases, as format:T:H:topk (default: all of CASES).")
flags.DEFINE_integer("repeats", 7, "Timed calls per round; a round reports their median.")
flags.DEFINE_integer("rounds", 3, "Timing rounds per case, alternating the two lowerings; the lowest round "
                     "median of each lowering is reported.")
flags.DEFINE_float("warmup_seconds", 0.5, "Warm-up time per lowering and case before the timed calls.")
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
    """Median and fastest wall seconds of one call of the jitted ``fn(*args)``, after warm-up calls for at
    least ``--warmup_seconds`` (at least two calls: compilation, first-use costs, the cores' clocks)."""
    import jax

    started = time.perf_counter()
    for call in itertools.count():
        jax.block_until_ready(fn(*args))
        if call >= 1 and time.perf_counter() - started >= FLAGS.warmup_seconds:
            break
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
    # Rounds alternate the two lowerings; each reports its lowest round median, so that a burst of
    # other load on the machine spoils a round rather than the result.
    kernel_rounds, xla_rounds = [], []
    for _ in range(FLAGS.rounds):
        kernel_rounds.append(median_call_seconds(kernel, (q, cache, indices), FLAGS.repeats))
        xla_rounds.append(median_call_seconds(xla, (q, cache, indices), FLAGS.repeats))
    kernel_s = min(median for median, _ in kernel_rounds)
    xla_s = min(median for median, _ in xla_rounds)
    flops = 2.0 * tokens * heads * topk * (fmt.d_qk + fmt.d_v)
    return {
        "format": kv_format, "T": tokens, "H": heads, "topk": topk, "kernel_ms": kernel_s * 1e3,
        "kernel_round_medians_ms": [m * 1e3 for m, _ in kernel_rounds],
        "kernel_min_ms": min(fastest for _, fastest in kernel_rounds) * 1e3, "xla_ms": xla_s * 1e3,
        "xla_round_medians_ms": [m * 1e3 for m, _ in xla_rounds],
        "xla_min_ms": min(fastest for _, fastest in xla_rounds) * 1e3,
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
    flags = set()
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))
    except OSError:
        pass
    simd = " ".join(flag for flag in ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "amx_bf16") if flag in flags)
    return f"{model}, {cores} usable cores" + (f" ({simd})" if simd else "")


def write_results(rows, machine, load_before, load_after):
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    suffix = f"_{FLAGS.tag}" if FLAGS.tag else ""
    threads = os.environ.get("JSMLA_CPU_THREADS", "automatic (up to every usable core)")
    isa = os.environ.get("JSMLA_CPU_ISA", "the best the CPU supports")
    with open(os.path.join(FLAGS.out_dir, f"bench_cpu{suffix}.json"), "w") as f:
        json.dump({"machine": machine, "threads": threads, "instruction_set": isa, "repeats": FLAGS.repeats,
                   "rounds": FLAGS.rounds, "warmup_seconds": FLAGS.warmup_seconds,
                   "pool_tokens": FLAGS.pool_tokens, "load_average_before": load_before,
                   "load_average_after": load_after, "rows": rows}, f, indent=1)
    lines = [f"Machine: {machine}; kernel threads: {threads}; instruction set: {isa}. Wall time of one jitted "
             f"call: the lowest of {FLAGS.rounds} round medians ({FLAGS.repeats} calls after "
             f"{FLAGS.warmup_seconds:g} s of warm-up calls; rounds alternate the lowerings), cache of "
             f"{FLAGS.pool_tokens} tokens, random indices. Load average (1/5/15 min) before: "
             f"{' '.join(f'{x:.2f}' for x in load_before)}, after: {' '.join(f'{x:.2f}' for x in load_after)}.", "",
             "| format | T | H | topk | kernel ms | GFLOP/s | `impl=\"xla\"` ms | GFLOP/s | speed-up | check | load |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['format']} | {r['T']} | {r['H']} | {r['topk']} | {r['kernel_ms']:.2f} | "
                     f"{r['kernel_gflops']:.0f} | {r['xla_ms']:.2f} | {r['xla_gflops']:.0f} | "
                     f"{r['speedup']:.2f}× | {r['check']} | {r['load_1min_before']:.2f} |")
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
        load = os.getloadavg()[0]
        rows.append(run_case(jsm, caches[kv_format], kv_format, tokens, heads, topk, rng))
        rows[-1]["load_1min_before"] = load
        print(json.dumps(rows[-1]), flush=True)
    print(write_results(rows, machine, load_before, os.getloadavg()))
    return 0 if all(r["check"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    app.run(main)
