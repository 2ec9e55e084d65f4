"""Command line: ``python -m jax_sparse_mla demo`` and ``python -m jax_sparse_mla calibrate``.

``demo`` builds a small FP8 cache, runs a decode-shaped and a prefill-shaped call on the default JAX
backend, checks each against the pure-JAX reference and prints which kernel ran, the shape, the time
and the errors. ``calibrate`` measures the local GPU once and stores the planner's cost-model constants
(:mod:`jax_sparse_mla.calibration`).

Bad usage (an unknown command, a bad flag value) prints one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from . import api, calibration, calibration_store, planner, validate
from ._ffi import cuda_available
from .formats import FORMATS, get_format, quantize_kv

PROG = "python -m jax_sparse_mla"
COMMANDS = {
    "demo": "run a decode- and a prefill-shaped call, check them against the pure-JAX reference, time them",
    "calibrate": "measure the local CUDA GPU once and store the planner's constants",
}
#: The demo's shapes: (kind, tokens).
DEMO_SHAPES = (("decode", 4), ("prefill", 64))
DEMO_PAGE_SIZE = 64
#: What runs a plan, by ``Plan.family``.
KERNEL_NAMES = {"cpu_reference": "C++ CPU kernel", "portable": "CUDA portable", "hopper": "CUDA Hopper"}


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line (argparse prints the whole usage block first)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: {message} (see --help)\n")


def _int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an int >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an int >= {low}, got {value}")
        return value
    return parse


def _list_of(parse_item, what: str):
    def parse(text: str) -> list:
        items = [item for item in text.split(",") if item]
        if not items:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {what}, got {text!r}")
        return [parse_item(item) for item in items]
    return parse


def _format_key(text: str) -> str:
    if text not in FORMATS:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(sorted(FORMATS))}, got {text!r}")
    return text


def parser() -> argparse.ArgumentParser:
    top = _Parser(prog=PROG, description="Token-sparse MLA attention over paged FP8 KV caches for JAX.",
                  epilog=f"Run '{PROG} COMMAND --help' for the flags of a command.")
    commands = top.add_subparsers(dest="command", title="commands")
    demo = commands.add_parser(
        "demo", help=COMMANDS["demo"],
        description="Builds a cache of random rows, runs a decode-shaped (T = 4) and a prefill-shaped (T = 64) "
                    "call on the default JAX backend (the C++ CPU kernel without a GPU, the CUDA kernels where "
                    "they are built), checks each against impl='xla' and prints the kernel that ran, the shape, "
                    "the median time and the errors. Exits 1 when a check fails.")
    demo.add_argument("--kv_format", type=_format_key, default="dsv3_2",
                      help=f"cache format, one of {', '.join(sorted(FORMATS))} (default: %(default)s)")
    demo.add_argument("--num_heads", type=_int_at_least(1), default=16, help="query heads (default: %(default)s)")
    demo.add_argument("--topk", type=_int_at_least(1), default=512,
                      help="candidates per query row (default: %(default)s)")
    demo.add_argument("--pool_tokens", type=_int_at_least(1), default=16384,
                      help="tokens in the cache (default: %(default)s)")
    demo.add_argument("--repeats", type=_int_at_least(1), default=5,
                      help="timed calls per shape; the median is printed (default: %(default)s)")
    calibrate = commands.add_parser(
        "calibrate", help=COMMANDS["calibrate"],
        description="Times the planner's choices on the local CUDA GPU (a few minutes), fits the cost model's "
                    "constants and stores them in the calibration file, keyed by device name. Needs a CUDA GPU "
                    "and the CUDA extension.")
    calibrate.add_argument("--formats", type=_list_of(_format_key, "format keys"),
                           default=list(calibration.CALIBRATION_FORMATS),
                           help="comma-separated formats to measure (default: "
                                + ",".join(calibration.CALIBRATION_FORMATS) + ": one of each row conversion)")
    calibrate.add_argument("--heads", type=_list_of(_int_at_least(1), "head counts"), default=[16, 64, 128],
                           help="comma-separated head counts (default: 16,64,128)")
    calibrate.add_argument("--topks", type=_list_of(_int_at_least(1), "index row widths"), default=[2048],
                           help="comma-separated index row widths (default: 2048)")
    calibrate.add_argument("--force", action="store_true",
                           help="re-measure a device that already has constants")
    return top


def _time_call(fn, *args, repeats):
    jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


def kernel_name(plan) -> str:
    """What runs a plan, e.g. ``C++ CPU kernel`` or ``CUDA Hopper, decode (8 splits)``."""
    name = KERNEL_NAMES[plan.family]
    if plan.platform == "cpu":
        return name
    splits = f" ({plan.num_splits} splits)" if plan.variant == "decode" else ""
    return f"{name}, {plan.variant}{splits}"


def demo(args) -> int:
    fmt = get_format(args.kv_format)
    rng = np.random.default_rng(0)
    kv = jnp.asarray(rng.standard_normal((args.pool_tokens, fmt.d_qk), np.float32))
    cache = quantize_kv(kv, fmt, page_size=DEMO_PAGE_SIZE)
    num_slots = cache.shape[0] * DEMO_PAGE_SIZE
    sm_scale = 1.0 / np.sqrt(fmt.d_qk)
    backend = jax.default_backend()
    platform = "cuda" if backend == "gpu" else "cpu"
    rows = []
    failures = 0
    for kind, tokens in DEMO_SHAPES:
        q = jnp.asarray(rng.standard_normal((tokens, args.num_heads, fmt.d_qk)), jnp.bfloat16)
        indices = jnp.asarray(rng.integers(0, num_slots, (tokens, args.topk)), jnp.int32)

        def run(q, cache, indices, impl):
            return api.sparse_mla(q, cache, indices, kv_format=fmt, sm_scale=sm_scale, impl=impl)

        fast = jax.jit(lambda q, c, i: run(q, c, i, "auto"))
        reference = jax.jit(lambda q, c, i: run(q, c, i, "xla"))
        seconds = _time_call(fast, q, cache, indices, repeats=args.repeats)
        out, lse = fast(q, cache, indices)
        ref_out, ref_lse = reference(q, cache, indices)
        err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref_out.astype(jnp.float32))))
        lse_err = float(jnp.max(jnp.abs(lse - ref_lse)))
        scale = max(1.0, float(jnp.max(jnp.abs(ref_out.astype(jnp.float32)))))
        ok = err <= 2e-2 * scale and lse_err <= 1e-3
        failures += not ok
        plan = planner.plan(q.shape, fmt, args.topk, platform=platform)
        rows.append((backend, kernel_name(plan), f"{kind} T={tokens} H={args.num_heads} topk={args.topk}",
                     f"{seconds * 1e3:.2f} ms", f"{err:.2e}", f"{lse_err:.2e}", "ok" if ok else "FAIL"))

    header = ("backend", "kernel", "shape", "time", "max|out err|", "max|lse err|", "check")
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    print(f"jax_sparse_mla demo: format {fmt.key}, cache {num_slots} tokens x {fmt.bytes_per_token} B, "
          f"CUDA kernels {'loaded' if cuda_available() else 'not available'}")
    for row in [header] + rows:
        print("  ".join(str(v).ljust(w) for v, w in zip(row, widths)).rstrip())
    return 1 if failures else 0


def _progress_bar(done: int, total: int, label: str) -> None:
    width = 30
    filled = width * done // max(total, 1)
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label[:60]:<60}")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def calibrate(args) -> int:
    # The GPU first: without one, no build of the extension helps.
    if jax.default_backend() != "gpu":
        print(f"{PROG} calibrate: measures a CUDA GPU, but JAX's default backend is {jax.default_backend()!r} "
              f"(JAX sees no GPU)", file=sys.stderr)
        return 1
    try:
        constants = calibration.calibrate(formats=args.formats, heads=args.heads, topks=args.topks,
                                          force=args.force, progress=_progress_bar)
    except RuntimeError as error:
        print(f"{PROG} calibrate: {error}", file=sys.stderr)
        return 1
    print(f"calibration file: {calibration_store.calibration_path()}")
    print(json.dumps(constants, indent=1, sort_keys=True))
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    commands = ", ".join(COMMANDS)
    # argparse would print its usage block before a line about the choice; one line is enough.
    if not argv:
        print(f"{PROG}: expected a command ({commands}; see --help)", file=sys.stderr)
        return 2
    if not argv[0].startswith("-") and argv[0] not in COMMANDS:
        print(f"{PROG}: unknown command {argv[0]!r} (commands: {commands})", file=sys.stderr)
        return 2
    args = parser().parse_args(argv)
    if args.command is None:  # only flags, no command
        print(f"{PROG}: expected a command ({commands}; see --help)", file=sys.stderr)
        return 2
    if args.command == "demo":
        problems = validate.violations(args.kv_format, num_heads=args.num_heads, topk=args.topk)
        if problems:
            print(f"{PROG} demo: unsupported flags for format {args.kv_format}: {'; '.join(problems)}",
                  file=sys.stderr)
            return 2
        try:
            return demo(args)
        except ValueError as error:  # the backend cannot run the call (e.g. a GPU without the CUDA kernels)
            print(f"{PROG} demo: {error}", file=sys.stderr)
            return 1
    return calibrate(args)


if __name__ == "__main__":
    sys.exit(main())
