"""Forward and forward+backward of ``sparse_mla``: the FFI kernels (``impl="auto"``: the C++ kernels on the
CPU, the CUDA kernels on a GPU) against XLA's autodiff of the pure-JAX lowering (``impl="xla"``), in the
same run.

    python benchmarks/bench_backward.py                                  # the default shape, both formats
    python benchmarks/bench_backward.py --tokens 4 --heads 4 --topk 16 --cache_tokens 256 --repeats 1
    python benchmarks/bench_backward.py --formats bf16_576 --tokens 1024,4096 --heads 128 --topk 2048 \
        --cache_tokens 65536 --cache_gradient both                      # the H200 rows

Per format and T: one jitted call of the forward, and one of ``jax.value_and_grad`` of ``sum(out * w) +
sum(lse)`` with respect to q, the sink and (a ``bf16_*`` cache, ``--cache_gradient``) the cache, for each
implementation; the median of ``--repeats`` calls after two warm-up calls. Where XLA's implementation
does not fit in the device's memory its times are reported as such ("OOM"); with ``--notime_xla`` they are
"not timed" (XLA then runs only on the sub-problem below, for A/B runs of the kernels), and with
``--xla_max_tokens N`` on the rows of more than N tokens. The results files are rewritten after every row,
so a run cut short keeps the rows it finished. Each row also reports the
largest difference between the two implementations' gradients, relative to the largest gradient, on the
row's first ``--check_tokens`` tokens (both implementations run on that sub-problem in the same run:
XLA's autodiff needs far more memory than the kernels at large T; docs/semantics.md bounds each against
float64), and TFLOP/s of the matrix products computed:
forward 2·T·H·topk·(d_qk + d_v); backward (recomputed S, dP, d_q) 2·T·H·topk·(2·d_qk + d_v), plus
2·T·H·topk·(d_qk + d_v) for the cache's gradient. Results go to ``--out_dir``/bench_backward.{json,md}.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time

from absl import app, flags

flags.DEFINE_list("formats", ["bf16_576", "dsv3_2"], "Cache formats (a bf16_* format adds the cache's gradient).")
flags.DEFINE_list("tokens", ["64"], "Query rows T (one row of results each).")
flags.DEFINE_integer("heads", 16, "Query heads H.")
flags.DEFINE_integer("topk", 256, "Candidates per row.")
flags.DEFINE_integer("cache_tokens", 8192, "Cache slots.")
flags.DEFINE_bool("time_xla", True, "Time XLA's implementation at the row's T (without: XLA runs only on the "
                  "--check_tokens sub-problem the gradients are compared on; for A/B runs of the kernels).")
flags.DEFINE_integer("xla_max_tokens", 0, "Time XLA's implementation only on rows with at most this many "
                     "tokens (0: every row; above it the XLA columns read \"not timed\", and XLA runs only on the "
                     "--check_tokens sub-problem): XLA's autodiff of the reference needs more than an H200's memory "
                     "at T = 4096, H = 128, topk 2048, and finding that out takes minutes of compilation.")
flags.DEFINE_integer("check_tokens", 256, "Tokens of the sub-problem on which the gradients are compared.")
flags.DEFINE_integer("repeats", 5, "Timed calls per case; the median is reported.")
flags.DEFINE_enum("cache_gradient", "yes", ["yes", "no", "both"],
                  "With a bf16_* cache: differentiate the cache too (yes), not (no), or a row of each (both).")
flags.DEFINE_list("side_by_side", [], "name=path/bench_backward.json,...: print these runs' rows side by side "
                  "(forward+backward times relative to the first run's) and exit.")
flags.DEFINE_string("out_dir", os.path.join(os.path.dirname(__file__), "results"), "Where results go.")
FLAGS = flags.FLAGS

PAGE_SIZE = 64
IMPLS = ("auto", "xla")
NOT_TIMED = "not timed"  # a time not measured (--notime_xla); None: out of memory


def run_format(kv_format, t, cache_gradient, rng):
    """The results row of one format, T and choice of gradients: times per implementation, TFLOP/s and the
    gradients' difference."""
    import jax
    import jax.numpy as jnp

    import jax_sparse_mla as jsm
    from jax_sparse_mla.timing import median_step_seconds

    fmt = jsm.get_format(kv_format)
    h = FLAGS.heads
    kv = jnp.asarray(rng.standard_normal((FLAGS.cache_tokens, fmt.d_qk)), jnp.float32)
    operands = {
        "q": jnp.asarray(rng.standard_normal((t, h, fmt.d_qk)), jnp.bfloat16),
        "kv_cache": jsm.quantize_kv(kv, fmt, page_size=PAGE_SIZE),
        "attn_sink": jnp.asarray(rng.standard_normal(h), jnp.float32),
    }
    indices = jnp.asarray(rng.integers(0, FLAGS.cache_tokens, (t, FLAGS.topk)), jnp.int32)
    weights = jnp.asarray(rng.standard_normal((t, h, fmt.d_v)), jnp.float32)
    wrt = ("q", "attn_sink") + (("kv_cache",) if cache_gradient and not fmt.quantized else ())
    row = {"format": kv_format, "tokens": t, "heads": h, "topk": FLAGS.topk, "gradients": list(wrt)}
    gradients = {}
    check = min(t, FLAGS.check_tokens)
    for impl in IMPLS:
        def attend(operands, indices, impl=impl):
            return jsm.sparse_mla(operands["q"], operands["kv_cache"], indices, kv_format=fmt,
                                  sm_scale=fmt.d_qk ** -0.5, attn_sink=operands["attn_sink"], impl=impl)

        def loss(differentiated, operands, indices, attend=attend):
            out, lse = attend({**operands, **differentiated}, indices)
            return (out.astype(jnp.float32) * weights[: out.shape[0]]).sum() + lse.sum()

        forward = jax.jit(attend)
        forward_backward = jax.jit(jax.value_and_grad(loss))
        differentiated = {name: operands[name] for name in wrt}
        rest = {name: x for name, x in operands.items() if name not in wrt}
        started = time.perf_counter()

        def progress(stage, impl=impl, started=started):  # on stderr as it happens: a run cut short still says
            print(f"{kv_format} T={t} {'+'.join(wrt)} {impl}: {stage} after {time.perf_counter() - started:.1f} s",
                  file=sys.stderr, flush=True)

        if impl == "xla" and (not FLAGS.time_xla or 0 < FLAGS.xla_max_tokens < t):
            row[f"{impl}_forward_ms"] = row[f"{impl}_forward_backward_ms"] = NOT_TIMED
        else:
            try:
                row[f"{impl}_forward_ms"] = 1e3 * median_step_seconds(forward, (operands, indices), 1, FLAGS.repeats,
                                                                      1)[0]
                progress("forward timed")
                row[f"{impl}_forward_backward_ms"] = 1e3 * median_step_seconds(
                    forward_backward, (differentiated, rest, indices), 1, FLAGS.repeats, 1)[0]
                progress(f"forward {row[f'{impl}_forward_ms']:.2f} ms, forward+backward "
                         f"{row[f'{impl}_forward_backward_ms']:.2f} ms")
            except jax.errors.JaxRuntimeError as error:
                if impl == "auto" or "RESOURCE_EXHAUSTED" not in str(error):
                    raise
                row[f"{impl}_forward_ms"] = row[f"{impl}_forward_backward_ms"] = None  # XLA's needs exceed the device
                progress("out of memory")
        sliced = {name: x[:check] if name == "q" else x for name, x in differentiated.items()}
        gradients[impl] = jax.block_until_ready(forward_backward(sliced, rest, indices[:check])[1])
        progress(f"gradients of the first {check} tokens")
    timed = {impl: isinstance(row[f"{impl}_forward_backward_ms"], float) for impl in IMPLS}
    row["speedup"] = (row["xla_forward_backward_ms"] / row["auto_forward_backward_ms"] if timed["xla"]
                      else row["xla_forward_backward_ms"])
    products = 2.0 * t * h * FLAGS.topk
    forward_flops = products * (fmt.d_qk + fmt.d_v)
    backward_flops = products * (2 * fmt.d_qk + fmt.d_v + (fmt.d_qk + fmt.d_v if "kv_cache" in wrt else 0))
    for impl in IMPLS:
        if not timed[impl]:  # None (out of memory) or NOT_TIMED
            row[f"{impl}_forward_tflops"] = row[f"{impl}_forward_backward_tflops"] = row[f"{impl}_forward_ms"]
            continue
        row[f"{impl}_forward_tflops"] = forward_flops / row[f"{impl}_forward_ms"] * 1e-9
        row[f"{impl}_forward_backward_tflops"] = (forward_flops + backward_flops) / row[f"{impl}_forward_backward_ms"] * 1e-9
    row["check_tokens"] = check
    kernel, xla = ({name: g.astype(jnp.float32) for name, g in gradients[impl].items()} for impl in IMPLS)
    row["max_gradient_difference"] = {
        name: float(jnp.abs(kernel[name] - xla[name]).max() / jnp.abs(xla[name]).max()) for name in wrt}
    return row


def markdown(rows) -> str:
    lines = ["| format | T | H | topk | gradients | kernel fwd ms | xla fwd ms | kernel fwd+bwd ms | xla fwd+bwd ms "
             "| speed-up (fwd+bwd) | kernel TFLOP/s (fwd+bwd) | xla TFLOP/s (fwd+bwd) "
             "| max gradient difference (first tokens) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def number(value, spec, suffix=""):
        if value is None:
            return "OOM"
        return value if isinstance(value, str) else f"{value:{spec}}{suffix}"

    for r in rows:
        difference = ", ".join(f"{k} {v:.1e}" for k, v in r["max_gradient_difference"].items())
        lines.append(f"| {r['format']} | {r['tokens']} | {r['heads']} | {r['topk']} | {', '.join(r['gradients'])} "
                     f"| {r['auto_forward_ms']:.2f} | {number(r['xla_forward_ms'], '.2f')} "
                     f"| {r['auto_forward_backward_ms']:.2f} | {number(r['xla_forward_backward_ms'], '.2f')} "
                     f"| {number(r['speedup'], '.2f', 'x')} | {r['auto_forward_backward_tflops']:.1f} "
                     f"| {number(r['xla_forward_backward_tflops'], '.1f')} | {difference} ({r['check_tokens']}) |")
    return "\n".join(lines) + "\n"


def side_by_side(runs) -> str:
    """The rows of several runs (``[(name, rows)]``) side by side: per (format, T, H, topk, gradients) of the
    first run, each run's forward+backward ms, its ratio to the first run's, and its gradients' largest
    difference against XLA's."""
    def key(r):
        return r["format"], r["tokens"], r["heads"], r["topk"], tuple(r["gradients"])

    names = [name for name, _ in runs]
    lines = ["| format | T | H | topk | gradients | " + " | ".join(f"{n} fwd+bwd ms (ratio)" for n in names)
             + " | " + " | ".join(f"{n} max gradient difference" for n in names) + " |",
             "|---|---|---|---|---|" + "---|" * (2 * len(names))]
    by_run = [{key(r): r for r in rows} for _, rows in runs]
    for k, first in by_run[0].items():
        times, differences = [], []
        for rows in by_run:
            r = rows.get(k)
            if r is None:
                times.append("missing")
                differences.append("")
                continue
            times.append(f"{r['auto_forward_backward_ms']:.2f} "
                         f"({r['auto_forward_backward_ms'] / first['auto_forward_backward_ms']:.2f})")
            differences.append(", ".join(f"{n} {v:.1e}" for n, v in r["max_gradient_difference"].items()))
        lines.append(f"| {k[0]} | {k[1]} | {k[2]} | {k[3]} | {', '.join(k[4])} | " + " | ".join(times) + " | "
                     + " | ".join(differences) + " |")
    return "\n".join(lines) + "\n"


def main(argv):
    del argv
    if FLAGS.side_by_side:
        runs = []
        for item in FLAGS.side_by_side:
            name, path = item.split("=", 1)
            with open(path) as f:
                runs.append((name, json.load(f)["rows"]))
        print(side_by_side(runs))
        return
    import numpy as np

    import jax

    import jax_sparse_mla as jsm

    rng = np.random.default_rng(0)
    choices = {"yes": (True,), "no": (False,), "both": (False, True)}[FLAGS.cache_gradient]
    device = jax.devices()[0]
    rows = []
    text = write_results(rows, device)
    for kv_format in FLAGS.formats:
        quantized = jsm.get_format(kv_format).quantized
        for t in (int(x) for x in FLAGS.tokens):
            for cache_gradient in (choices[:1] if quantized else choices):
                rows.append(run_format(kv_format, t, cache_gradient, rng))
                print(markdown(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
                text = write_results(rows, device)  # after every row: a run cut short keeps what it finished
    print(text)


def write_results(rows, device) -> str:
    """Writes ``rows`` to ``--out_dir``/bench_backward.{json,md} (replacing them); returns the markdown."""
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    if device.platform == "cpu":
        machine = f"CPU ({platform.machine()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end)"
    else:
        machine = f"{device.device_kind} ({device.platform})"
    with open(os.path.join(FLAGS.out_dir, "bench_backward.json"), "w") as f:
        json.dump({"machine": machine, "rows": rows}, f, indent=1)
    text = f"{machine}; times are medians of {FLAGS.repeats} jitted calls.\n\n" + markdown(rows)
    with open(os.path.join(FLAGS.out_dir, "bench_backward.md"), "w") as f:
        f.write(text)
    return text


if __name__ == "__main__":
    app.run(main)
