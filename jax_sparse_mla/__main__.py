"""Command line: ``python -m jax_sparse_mla {demo,calibrate}``.

``demo`` builds a small DeepSeek-V3.2-shaped FP8 cache, runs decode- and prefill-shaped calls on the
default JAX backend (the C++ CPU kernel without a GPU, the CUDA kernels where they are built), checks
each against the pure-JAX reference and prints a table of platform, shape, time and max error.

``calibrate [--formats dsv3_2,dsv4] [--heads 16,64,128] [--topks 2048] [--force]`` measures the local
GPU once and stores the planner's cost-model constants (see :mod:`jax_sparse_mla.calibration`).
"""

from __future__ import annotations

import sys
import time

from absl import app, flags, logging

_COMMANDS = ("demo", "calibrate")

flags.DEFINE_string("kv_format", "dsv3_2", "KV-cache format of the demo.")
flags.DEFINE_integer("num_heads", 16, "demo: query heads.")
flags.DEFINE_integer("topk", 512, "Candidates per query row.")
flags.DEFINE_integer("pool_tokens", 16384, "Tokens in the demo cache.")
flags.DEFINE_integer("repeats", 5, "Timed calls per shape (the median is printed).")
flags.DEFINE_list("formats", ["dsv3_2"], "calibrate: formats to measure.")
flags.DEFINE_list("heads", ["16", "64", "128"], "calibrate: head counts to measure.")
flags.DEFINE_list("topks", ["2048"], "calibrate: index row widths to measure.")
flags.DEFINE_bool("force", False, "calibrate: re-measure even if the device has constants.")
FLAGS = flags.FLAGS


def _time_call(fn, *args, repeats):
    import jax

    jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


def demo() -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jax_sparse_mla as jsm

    fmt = jsm.get_format(FLAGS.kv_format)
    rng = np.random.default_rng(0)
    page_size = 64
    kv = jnp.asarray(rng.standard_normal((FLAGS.pool_tokens, fmt.d_qk), np.float32))
    cache = jsm.quantize_kv(kv, fmt, page_size=page_size)
    num_slots = cache.shape[0] * page_size
    sm_scale = 1.0 / np.sqrt(fmt.d_qk)
    platform = jax.default_backend()
    rows = []
    failures = 0
    for label, tokens in (("decode", 4), ("prefill", 64)):
        q = jnp.asarray(rng.standard_normal((tokens, FLAGS.num_heads, fmt.d_qk)), jnp.bfloat16)
        indices = jnp.asarray(rng.integers(0, num_slots, (tokens, FLAGS.topk)), jnp.int32)

        def run(q, cache, indices, impl):
            return jsm.sparse_mla(q, cache, indices, kv_format=fmt, sm_scale=sm_scale, impl=impl)

        fast = jax.jit(lambda q, c, i: run(q, c, i, "auto"))
        reference = jax.jit(lambda q, c, i: run(q, c, i, "xla"))
        seconds = _time_call(fast, q, cache, indices, repeats=FLAGS.repeats)
        out, lse = fast(q, cache, indices)
        ref_out, ref_lse = reference(q, cache, indices)
        err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref_out.astype(jnp.float32))))
        lse_err = float(jnp.max(jnp.abs(lse - ref_lse)))
        scale = max(1.0, float(jnp.max(jnp.abs(ref_out.astype(jnp.float32)))))
        ok = err <= 2e-2 * scale and lse_err <= 1e-3
        failures += not ok
        plan = jsm.plan(q.shape, fmt, FLAGS.topk, platform="cuda" if platform == "gpu" else "cpu")
        rows.append((platform, plan.variant, f"T={tokens} H={FLAGS.num_heads} topk={FLAGS.topk}",
                     f"{seconds * 1e3:.2f} ms", f"{err:.2e}", f"{lse_err:.2e}", "ok" if ok else "FAIL"))

    header = ("platform", "kernel", "shape", "time", "max|out err|", "max|lse err|", "check")
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    print(f"jax_sparse_mla demo: format {fmt.key}, cache {num_slots} tokens x {fmt.bytes_per_token} B, "
          f"CUDA kernels {'built' if jsm.cuda_available() else 'not built'}")
    for row in [header] + rows:
        print("  ".join(str(v).ljust(w) for v, w in zip(row, widths)))
    return 1 if failures else 0


def _progress_bar(done: int, total: int, label: str) -> None:
    width = 30
    filled = width * done // max(total, 1)
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label[:60]:<60}")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def calibrate() -> int:
    import json

    from jax_sparse_mla import calibration, calibration_store

    try:
        constants = calibration.calibrate(formats=FLAGS.formats, heads=[int(h) for h in FLAGS.heads],
                                          topks=[int(k) for k in FLAGS.topks], force=FLAGS.force,
                                          progress=_progress_bar)
    except RuntimeError as error:
        print(f"calibrate: {error}", file=sys.stderr)
        return 1
    print(f"calibration file: {calibration_store.calibration_path()}")
    print(json.dumps(constants, indent=1, sort_keys=True))
    return 0


def main(argv):
    logging.set_verbosity(logging.WARNING)
    if len(argv) != 2 or argv[1] not in _COMMANDS:
        raise app.UsageError(f"usage: python -m jax_sparse_mla {{{'|'.join(_COMMANDS)}}} [--flags]")
    return demo() if argv[1] == "demo" else calibrate()


if __name__ == "__main__":
    app.run(main)
