"""GPU soak: many launches of the CUDA kernels over random formats, shapes and data, under a watchdog.

Each configuration draws a format the CUDA kernels serve, T, H, topk, page size, for a dual-cache
format an extra cache (in any format allowed beside it) or none, a sink or none, a plan variant and
whether a stageable cache is staged as a BF16 copy (``JSMLA_CUDA_STAGING`` ``on``, or the planner's own
choice), and compiles one jitted step. Every launch of that step
draws fresh data on the GPU (indices with every kind of invalid slot, row lengths, extra lengths,
valid_tokens in [0, T], sink values), so the plan's code paths see varied masks without a recompile
(the caches are not poisoned here, since fresh indices reach every slot: the test tiers check that
masked slots are never read).
Every ``--check_every``-th launch is compared with the CPU kernel on the same bytes (both must meet
the accuracy contract of docs/semantics.md; their difference is checked against twice its bounds,
the ±inf lse positions and the zero padding rows exactly). A watchdog ends the run with exit code 3
when no launch completes for ``--hang_seconds`` (a hung barrier fails the soak rather than stalling
it). Exit code 0: every launch finished and every check passed.

    python3 tests/gpu/soak.py --launches 20000 --out /tmp/soak.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import cases  # noqa: E402
import oracle  # noqa: E402

import jax_sparse_mla as jsm  # noqa: E402
from jax_sparse_mla import planner, validate  # noqa: E402

TOKENS = (1, 2, 3, 5, 8, 16, 33, 64, 128)
HEADS = (1, 7, 16, 20, 32, 64, 100, 128)
TOPKS = (1, 16, 40, 64, 100, 512, 2048)
PAGE_SIZES = (1, 2, 16, 64)
IMPLS = ("auto", "decode", "prefill")


class Watchdog:
    """Ends the process (exit 3) when ``beat`` has not been called for ``seconds``."""

    def __init__(self, seconds: float, describe):
        self.seconds, self.describe, self.last = seconds, describe, time.monotonic()
        threading.Thread(target=self._watch, daemon=True).start()

    def beat(self):
        self.last = time.monotonic()

    def _watch(self):
        while True:
            time.sleep(1.0)
            if time.monotonic() - self.last > self.seconds:
                print(f"HANG: no launch finished for {self.seconds:.0f} s during {self.describe()}", flush=True)
                os._exit(3)


def kernel_label(plan) -> str:
    """The kernel tile a plan runs on: family and head tile, a Hopper tile's cluster (the lane-sliced
    tiles), and the BF16 copy it reads when staged (the tile is then that format's)."""
    clusters = (planner._cluster_blocks(plan.staged_format or plan.kv_format, plan.heads_per_block, plan.family)
                if plan.family in ("hopper", "portable") else 1)
    return (f"{plan.family} h{plan.heads_per_block}" + (f" cluster of {clusters}" if clusters > 1 else "")
            + (f" {plan.staged_format}" if plan.staged_format else ""))


def gpu_formats():
    """The formats whose plans compile for the CUDA backend (every format with CUDA kernels)."""
    served = []
    for key in jsm.FORMATS:
        fmt = jsm.get_format(key)
        try:
            jsm.plan((1, 16, fmt.d_qk), fmt, 16, platform="cuda")
        except (ValueError, NotImplementedError):
            continue
        served.append(key)
    return served


def draw_config(rng, formats, impls=IMPLS):
    key = str(rng.choice(formats))
    tokens, heads, topk = int(rng.choice(TOKENS)), int(rng.choice(HEADS)), int(rng.choice(TOPKS))
    multiple = oracle.min_3d_page_multiple(key)
    page = -(-int(rng.choice(PAGE_SIZES)) // multiple) * multiple
    dual = jsm.get_format(key).dual_cache and rng.random() < 0.5
    # The extra cache's format: any allowed for the main one (a format without a dual cache gets its own).
    extra_key = str(rng.choice(validate.extra_formats(key) or (key,)))
    return dict(key=key, tokens=tokens, heads=heads, topk=topk, page_size=page,
                cache_tokens=int(rng.integers(max(2 * page, 40), max(4 * page, 600))),
                extra_topk=int(rng.choice((1, 5, 64, 130))) if dual else 0, extra_key=extra_key,
                sink=bool(rng.random() < 0.5), impl=str(rng.choice(impls)),
                staging=str(rng.choice(("auto", "on"))))


def build_step(config, case):
    """jit(step)(key, q, cache, extra_cache) -> (out, lse, data): fresh data drawn on the device."""
    tokens, topk, extra_topk = config["tokens"], config["topk"], config["extra_topk"]
    num_slots = case.main.num_slots
    extra_slots = case.extra.num_slots if case.extra is not None else 0
    static = dict(kv_format=config["key"], sm_scale=case.sm_scale)
    if extra_topk:
        static["extra_kv_format"] = config["extra_key"]

    def draw(key):
        k = jax.random.split(key, 8)

        def slots(k_slot, k_bad, k_kind, shape, n):
            good = jax.random.randint(k_slot, shape, 0, n, jnp.int32)
            kinds = jnp.array([-1, -7, cases.INT32_MIN, n, n + 3, cases.INT32_MAX], jnp.int32)
            bad = kinds[jax.random.randint(k_kind, shape, 0, kinds.shape[0])]
            return jnp.where(jax.random.uniform(k_bad, shape) < 0.2, bad, good)

        data = dict(indices=slots(k[0], k[1], k[2], (tokens, topk), num_slots),
                    topk_length=jax.random.randint(k[3], (tokens,), -2, topk + 3, jnp.int32),
                    valid_tokens=jax.random.randint(k[4], (), 0, tokens + 1, jnp.int32))
        if config["sink"]:
            data["attn_sink"] = 2.0 * jax.random.normal(k[5], (config["heads"],), jnp.float32)
        if extra_topk:
            data["extra_indices"] = slots(k[6], k[1], k[2], (tokens, extra_topk), extra_slots)
            data["extra_topk_length"] = jax.random.randint(k[7], (tokens,), -1, extra_topk + 2, jnp.int32)
        return data

    def attend(q, cache, extra_cache, data, impl="auto"):
        data = dict(data)
        indices = data.pop("indices")
        if extra_cache is not None:
            data["extra_kv_cache"] = extra_cache
        return jsm.sparse_mla(q, cache, indices, impl=impl, **static, **data)

    @jax.jit
    def step(key, q, cache, extra_cache):
        data = draw(key)
        out, lse = attend(q, cache, extra_cache, data, config["impl"])
        return out, lse, data

    # The CPU side plans for the CPU kernel (impl="auto"; decode/prefill name CUDA kernels).
    return step, jax.jit(attend)


def check_against_cpu(attend, q, cache, extra_cache, data, out, lse):
    cpu = jax.devices("cpu")[0]
    put = lambda x: None if x is None else jax.device_put(np.asarray(x), cpu)  # noqa: E731
    data_cpu = {k: put(v) for k, v in data.items()}
    ref_out, ref_lse = attend(put(q), put(cache), put(extra_cache), data_cpu)
    oracle.check_accuracy(np.asarray(out), np.asarray(lse), np.asarray(ref_out).astype(np.float64),
                          np.asarray(ref_lse).astype(np.float64), out_tol=4e-2, l2_tol=2e-2, lse_tol=2e-3)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=20000)
    parser.add_argument("--configs", type=int, default=60, help="random configurations (one compile each)")
    parser.add_argument("--check_every", type=int, default=100)
    parser.add_argument("--hang_seconds", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write a JSON summary here")
    parser.add_argument("--cpu_dry_run", action="store_true",
                        help="run the soak's machinery on the CPU kernel (a test of this script, not of the GPU)")
    args = parser.parse_args(argv)
    if not args.cpu_dry_run and (jax.default_backend() != "gpu" or not jsm.cuda_available()):
        print("soak: needs a GPU and the CUDA extension")
        return 2
    rng = np.random.default_rng(args.seed)
    formats = gpu_formats()
    impls = ("auto",) if args.cpu_dry_run else IMPLS
    current = {"what": "start"}
    watchdog = Watchdog(args.hang_seconds, lambda: json.dumps(current))
    per_config = -(-args.launches // args.configs)
    launches = checks = 0
    failures, variants, kernels = [], {}, {}
    start = time.monotonic()
    for c in range(args.configs):
        config = draw_config(rng, formats, impls)
        extra_multiple = oracle.min_3d_page_multiple(config["extra_key"])
        extra = (dict(page_size=-(-2 // extra_multiple) * extra_multiple, cache_tokens=97, topk=config["extra_topk"],
                      kv_format=config["extra_key"]) if config["extra_topk"] else None)
        case = cases.make_case(rng, config["key"], num_tokens=config["tokens"], num_heads=config["heads"],
                               topk=config["topk"], page_size=config["page_size"],
                               cache_tokens=config["cache_tokens"], extra=extra, poison=False)
        # Read when the step is traced (its first launch below) and by the plan.
        os.environ[planner.STAGING_ENV] = config["staging"]
        step, attend = build_step(config, case)
        q, cache = jnp.asarray(case.q), jnp.asarray(case.main.array)
        extra_cache = jnp.asarray(case.extra.array) if case.extra is not None else None
        plan = jsm.plan(case.q.shape, jsm.get_format(config["key"]), config["topk"],
                        extra_topk=config["extra_topk"], platform="cuda", impl=config["impl"],
                        num_slots=case.main.num_slots)
        variants[plan.variant] = variants.get(plan.variant, 0) + 1
        kernel = kernel_label(plan)
        kernels[kernel] = kernels.get(kernel, 0) + 1
        base_key = jax.random.PRNGKey(args.seed * 100003 + c)
        for i in range(per_config):
            current = {"config": c, "launch": i, **config, "variant": plan.variant}
            out, lse, data = step(jax.random.fold_in(base_key, i), q, cache, extra_cache)
            launches += 1
            if launches % args.check_every == 0:
                checks += 1
                try:
                    check_against_cpu(attend, q, cache, extra_cache, data, out, lse)
                except AssertionError as error:
                    failures.append({**current, "error": str(error)})
                    print("MISMATCH", json.dumps(failures[-1], default=str), flush=True)
            if i % 16 == 15 or i == per_config - 1:
                out.block_until_ready()
                watchdog.beat()
        print(f"config {c:3d} {config['key']:10s} T={config['tokens']:3d} H={config['heads']:3d} "
              f"topk={config['topk']:4d} page={config['page_size']:2d} extra={config['extra_topk']:3d} "
              f"{config['extra_key'] if config['extra_topk'] else '':10s} "
              f"sink={int(config['sink'])} {plan.variant:7s} {kernel:21s} launches={launches}", flush=True)
        if launches >= args.launches:
            break
    summary = dict(launches=launches, checks=checks, failures=len(failures), configs=c + 1, variants=variants,
                   kernels=kernels, formats=formats, seconds=round(time.monotonic() - start, 1), first_failures=failures[:5])
    print("soak:", json.dumps(summary, default=str), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1, default=str)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
