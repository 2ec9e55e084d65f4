"""Benchmark harness (method: docs/performance.md): device time per call, TFLOP/s, gathered GB/s, and the speed-up
over a frozen pure-JAX gather + einsum baseline measured in the same run.

    python benchmarks/bench.py --out_dir benchmarks/results            # the full grid (GPU)
    python benchmarks/bench.py --grid smoke                            # a few shapes

Method: one jitted function runs the op over ``--steps`` stacked index sets with ``lax.scan`` (unrolled,
so the loop adds no host round trip per step; every output is consumed); a sample queues four such
calls back to back (``jax_sparse_mla.timing.CALLS_PER_SAMPLE``) and waits for the last with
``block_until_ready`` (dispatch is asynchronous, so the host's per-call overhead overlaps the device
work and is not counted), divided by the step count;
the median of ``--repeats`` samples after a warm-up is reported. The cache is several times the
L2 (>= 170 MB) and every step uses a different random index set. Before timing, each case's first rows
are checked against the C++ CPU kernel with the accuracy contract (docs/semantics.md).
"""

from __future__ import annotations

import json
import os
import time

from absl import app, flags, logging

flags.DEFINE_enum("grid", "full", ["full", "smoke", "compare"],
                  "Which shapes to run (compare: the shapes of the FlashMLA side-by-side, with --formats dsv3_2).")
flags.DEFINE_list("formats", ["dsv3_2", "dsv4"], "Formats of the decode grid.")
flags.DEFINE_integer("steps", 8, "Index sets per timed call (lax.scan length).")
flags.DEFINE_integer("small_steps", 32, "Index sets per timed call for T <= 16, where one step is short enough "
                     "that the call's dispatch would otherwise weigh on the per-step time.")
flags.DEFINE_integer("repeats", 10, "Timed calls per case; the median is reported.")
flags.DEFINE_integer("pool_bytes", 192 * 1024 * 1024, "Cache size in bytes (>= 170 MB).")
flags.DEFINE_string("out_dir", os.path.join(os.path.dirname(__file__), "results"), "Where results go.")
flags.DEFINE_string("tag", "", "Suffix of the result file names.")
flags.DEFINE_list("cases", [], "Run only these decode cases, as format:T:H (default: the whole grid).")
flags.DEFINE_list("prefill_tokens", [], "Prefill token counts (default: the grid's).")
flags.DEFINE_bool("empty_shard", True, "Also time a padded shard (valid_tokens = 0) and the harness floor.")
flags.DEFINE_bool("prefill", True, "Run the prefill cases.")
flags.DEFINE_enum("flashmla", "auto", ["auto", "on", "off"],
                  "Time DeepSeek's FlashMLA beside us on the same dsv3_2 cache bytes and indices (decode; prefill on "
                  "the dequantized BF16 cache): auto when the flash_mla package imports, on = fail without it.")
flags.DEFINE_list("prefill_formats", ["dsv3_2", "dsv4", "bf16_576"],
                  "Cache formats of the prefill cases (bf16_576: the dsv3_2 cache dequantized).")
flags.DEFINE_bool("staging_ab", True, "Where the planner stages a case's cache as a BF16 copy, also time the case "
                  "with staging off (JSMLA_CUDA_STAGING=off) in the same run.")
flags.DEFINE_integer("baseline_chunk_tokens", 1024,
                     "Above this many tokens the baseline runs over sequential chunks of this size (lax.map): "
                     "whole, its T = 4096 program asks for an 84 GiB allocation, more than an H200 holds.")
FLAGS = flags.FLAGS

TOPK = 2048


# The side-by-side with FlashMLA (docs/performance.md): the small-batch rows (T <= 32) and the tile-pace
# rows (T >= 64, H = 128 and 64; H = 16, which FlashMLA runs padded to 64 heads), then prefill T = 4096.
COMPARE_DECODE = [(1, 128), (16, 128), (32, 128), (64, 128), (128, 128), (128, 64),
                  (1, 16), (16, 16), (32, 16), (128, 16)]


def decode_grid(grid):
    if grid == "smoke":
        return [(1, 128), (128, 128), (64, 16)]
    if grid == "compare":
        return list(COMPARE_DECODE)
    return [(t, h) for h in (16, 64, 128) for t in (1, 16, 64, 128, 1024)]


def prefill_grid(grid):
    return {"smoke": [(1024, 128)], "compare": [(4096, 128)]}.get(grid, [(1024, 128), (4096, 128)])


# ------------------------------------------------------------------------------------------------
# The frozen baseline: plain gather + dequantize + einsum in JAX, bf16 compute. Kept here, unchanged,
# so speed-ups stay comparable across versions of the library (impl="xla" may change).
# ------------------------------------------------------------------------------------------------

def baseline_attention(q, cache_rows, indices, sm_scale, kv_format):
    """q [T,H,d] bf16; cache_rows uint8 [num_slots, 656] (dsv3_2) or a footer cache; indices [T,K]."""
    import jax
    import jax.numpy as jnp

    if kv_format == "dsv3_2":
        rows = cache_rows[jnp.maximum(indices, 0)]
        nope = jax.lax.bitcast_convert_type(rows[..., :512], jnp.float8_e4m3fn).astype(jnp.float32)
        scales = jax.lax.bitcast_convert_type(rows[..., 512:528].reshape(*rows.shape[:-1], 4, 4), jnp.float32)
        nope = (nope.reshape(*rows.shape[:-1], 4, 128) * scales[..., None]).reshape(*rows.shape[:-1], 512)
        rope = jax.lax.bitcast_convert_type(rows[..., 528:656].reshape(*rows.shape[:-1], 64, 2), jnp.bfloat16)
        k = jnp.concatenate([nope.astype(jnp.bfloat16), rope], axis=-1)
        v = k[..., :512]
    elif kv_format == "dsv4":
        data, scale_rows = cache_rows  # [num_slots, 576], [num_slots, 8]
        idx = jnp.maximum(indices, 0)
        rows, srows = data[idx], scale_rows[idx]
        nope = jax.lax.bitcast_convert_type(rows[..., :448], jnp.float8_e4m3fn).astype(jnp.float32)
        scales = jax.lax.bitcast_convert_type(srows[..., :7].astype(jnp.uint32) << 23, jnp.float32)
        nope = (nope.reshape(*rows.shape[:-1], 7, 64) * scales[..., None]).reshape(*rows.shape[:-1], 448)
        rope = jax.lax.bitcast_convert_type(rows[..., 448:576].reshape(*rows.shape[:-1], 64, 2), jnp.bfloat16)
        k = jnp.concatenate([nope.astype(jnp.bfloat16), rope], axis=-1)
        v = k
    else:
        k, v, indices = generic_baseline_rows(cache_rows, indices, kv_format)
    scores = jnp.einsum("thd,tkd->thk", q, k, preferred_element_type=jnp.float32) * sm_scale
    scores = jnp.where((indices >= 0)[:, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("thk,tkd->thd", probs.astype(jnp.bfloat16), v, preferred_element_type=jnp.float32)


def generic_baseline_rows(cache_rows, indices, kv_format):
    """K and V rows of the other formats, dequantized in JAX from the format's byte layout (inline FP32
    scales, or footer UE8M0 / E4M3 scales over FP8 or FP4 lanes), and the indices past the format's
    candidate window masked. Added beside the two frozen formats above, which it leaves unchanged."""
    import jax
    import jax.numpy as jnp

    import jax_sparse_mla as jsm

    f = jsm.get_format(kv_format)
    if f.max_candidates:
        indices = jnp.where(jnp.arange(indices.shape[-1]) < f.max_candidates, indices, -1)
    idx = jnp.maximum(indices, 0)
    if f.layout.name == "INLINE":
        rows = cache_rows[idx]
        scale_bytes = rows[..., f.scale_offset:f.scale_offset + 4 * f.num_groups].reshape(*rows.shape[:-1], -1, 4)
        scales = jax.lax.bitcast_convert_type(scale_bytes, jnp.float32)
    else:
        data, scale_rows = cache_rows
        rows, srows = data[idx], scale_rows[idx][..., :f.num_groups]
        if f.scale_kind.name == "UE8M0":
            scales = jax.lax.bitcast_convert_type(srows.astype(jnp.uint32) << 23, jnp.float32)
        else:  # E4M3
            scales = jax.lax.bitcast_convert_type(srows, jnp.float8_e4m3fn).astype(jnp.float32)
    packed = rows[..., :f.quant_bytes]
    if f.quant_bits == 4:
        e2m1 = jnp.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], jnp.float32)
        nibbles = jnp.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], f.quant_dim)
        quant = e2m1[nibbles]
    else:
        quant = jax.lax.bitcast_convert_type(packed, jnp.float8_e4m3fn).astype(jnp.float32)
    quant = (quant.reshape(*rows.shape[:-1], f.num_groups, f.group_size) * scales[..., None]).reshape(
        *rows.shape[:-1], f.quant_dim)
    parts = [quant.astype(jnp.bfloat16)]
    if f.bf16_dim:
        bf16_bytes = rows[..., f.bf16_offset:f.bf16_offset + 2 * f.bf16_dim].reshape(*rows.shape[:-1], f.bf16_dim, 2)
        parts.append(jax.lax.bitcast_convert_type(bf16_bytes, jnp.bfloat16))
    k = jnp.concatenate(parts, axis=-1)
    return k, k[..., :f.d_v], indices


def baseline_in_chunks(q, cache_rows, indices, sm_scale, kv_format, chunk_tokens):
    """The frozen baseline over sequential chunks of ``chunk_tokens`` tokens (``lax.map``), so that its
    intermediates stay the size of one chunk; every token's result is the baseline's own. Used above
    ``chunk_tokens`` tokens, whose whole-batch program would not fit in device memory."""
    import jax

    tokens = q.shape[0]
    if tokens <= chunk_tokens:
        return baseline_attention(q, cache_rows, indices, sm_scale, kv_format)
    if tokens % chunk_tokens:
        raise ValueError(f"{tokens} tokens do not split into chunks of {chunk_tokens}")
    chunks = tokens // chunk_tokens
    out = jax.lax.map(
        lambda part: baseline_attention(part[0], cache_rows, part[1], sm_scale, kv_format),
        (q.reshape(chunks, chunk_tokens, *q.shape[1:]), indices.reshape(chunks, chunk_tokens, *indices.shape[1:])))
    return out.reshape(tokens, *out.shape[2:])


def baseline_view(cache, kv_format, page_size):
    """The baseline's own view of the cache bytes: [slots, row bytes] for inline rows, (data rows, scale
    rows) for page footers; None for bf16 caches (no baseline)."""
    import jax_sparse_mla as jsm

    f = jsm.get_format(kv_format)
    if f.layout.name == "INLINE":
        return cache.reshape(-1, f.data_row_bytes)
    if f.layout.name != "FOOTER":
        return None
    pages = cache.reshape(cache.shape[0], -1)
    data = pages[:, : page_size * f.data_row_bytes].reshape(-1, f.data_row_bytes)
    scales = pages[:, page_size * f.data_row_bytes:].reshape(-1, f.scale_row_bytes)
    return data, scales


# ------------------------------------------------------------------------------------------------

def accuracy(out, lse, ref_out, ref_lse):
    import jax.numpy as jnp

    out = out.astype(jnp.float32)
    ref = ref_out.astype(jnp.float32)
    err = float(jnp.max(jnp.abs(out - ref)))
    scale = max(1.0, float(jnp.max(jnp.abs(ref))))
    rel_l2 = float(jnp.linalg.norm(out - ref) / max(float(jnp.linalg.norm(ref)), 1e-30))
    lse_err = float(jnp.max(jnp.abs(lse - ref_lse)))
    ok = err <= 2e-2 * scale and rel_l2 <= 1e-2 and lse_err <= 1e-3 and bool(jnp.all(jnp.isfinite(out)))
    return ok, err, rel_l2, lse_err


_host_caches = {}


def cache_on_cpu(cache, cpu):
    """A host copy of a benchmark cache (made once per cache)."""
    import jax

    key = id(cache)
    if key not in _host_caches:
        _host_caches[key] = jax.device_put(cache, cpu)
    return _host_caches[key]


def flashmla_columns(anchor, impl, kv_format, q, cache, kv_bf16, indices, sm_scale, out, lse):
    """FlashMLA's time on the case's bytes and indices and its difference from our output (index set 0),
    or {} where FlashMLA has no kernel for the case."""
    import numpy as np

    from jax_sparse_mla.timing import CALLS_PER_SAMPLE

    if anchor is None or q.shape[-1] != 576 or indices.shape[-1] % 64:
        return {}
    if impl == "prefill":
        if indices.shape[-1] % 128 or q.shape[1] not in (64, 128):
            return {}
        us, fm_out, fm_lse = anchor.prefill(q, kv_bf16, indices, sm_scale, FLAGS.repeats, CALLS_PER_SAMPLE)
    else:
        if kv_format != "dsv3_2" or q.shape[1] > 128:
            return {}
        us, fm_out, fm_lse = anchor.decode(q, cache, indices, sm_scale, FLAGS.repeats, CALLS_PER_SAMPLE)
    ours = np.asarray(out.astype(np.float32))
    diff = np.abs(ours - fm_out)
    finite = np.isfinite(fm_lse)
    return {"flashmla_us": us,
            "flashmla_max_diff": float(diff.max() / max(float(np.abs(fm_out).max()), 1e-30)),
            "flashmla_rel_l2": float(np.linalg.norm(ours - fm_out) / max(float(np.linalg.norm(fm_out)), 1e-30)),
            "flashmla_lse_diff": float(np.abs(np.asarray(lse)[finite] - fm_lse[finite]).max()) if finite.any() else 0.0}


def run_case(jsm, cache, view, kv_format, page_size, num_slots, tokens, heads, impl, rng, with_baseline,
             anchor=None, kv_bf16=None):
    import jax
    import jax.numpy as jnp

    from jax_sparse_mla.timing import time_scan

    fmt = jsm.get_format(kv_format)
    sm_scale = fmt.d_qk ** -0.5
    steps = FLAGS.small_steps if tokens <= 16 else FLAGS.steps
    q = jnp.asarray(rng.standard_normal((tokens, heads, fmt.d_qk)), jnp.bfloat16)
    indices = jnp.asarray(rng.integers(0, num_slots, (steps, tokens, TOPK)), jnp.int32)

    def op(operands, idx):
        q, cache = operands
        return jsm.sparse_mla(q, cache, idx, kv_format=fmt, sm_scale=sm_scale, impl=impl)

    # Correctness in the same run: the first rows against the C++ CPU kernel (itself checked against a
    # float64 oracle in the test suite), on the host so no GPU compile or autotuning is added per case.
    check_rows = min(tokens, 16)
    out, lse = jax.jit(op)((q, cache), indices[0])
    cpu = jax.devices("cpu")[0]
    ref_out, ref_lse = jax.jit(lambda q, c, i: jsm.sparse_mla(q, c, i, kv_format=fmt, sm_scale=sm_scale))(
        *jax.device_put((q[:check_rows], cache_on_cpu(cache, cpu), indices[0, :check_rows]), cpu))
    ok, err, rel_l2, lse_err = accuracy(jax.device_put(out[:check_rows], cpu), jax.device_put(lse[:check_rows], cpu),
                                        ref_out, ref_lse)

    seconds, fastest, slowest = time_scan(lambda ops, idx: jnp.sum(op(ops, idx)[0].astype(jnp.float32)), (q, cache),
                                           indices, FLAGS.repeats)
    base_seconds = None
    if with_baseline:
        base_seconds, _, _ = time_scan(
            lambda ops, idx: jnp.sum(baseline_in_chunks(ops[0], ops[1], idx, sm_scale, kv_format,
                                                        FLAGS.baseline_chunk_tokens)), (q, view),
            indices, max(3, FLAGS.repeats // 2))
    attended = min(TOPK, fmt.max_candidates) if fmt.max_candidates else TOPK  # dots3_swa: its window
    flops = 2.0 * tokens * heads * attended * (fmt.d_qk + fmt.d_v)
    gathered = tokens * attended * fmt.bytes_per_token
    on_gpu = jax.default_backend() == "gpu"
    plan = jsm.plan(q.shape, fmt, TOPK, platform="cuda" if on_gpu else "cpu", impl=impl,
                    num_slots=num_slots if on_gpu else None)
    anchor_columns = flashmla_columns(anchor, impl, kv_format, q, cache, kv_bf16, indices, sm_scale, out, lse)
    if anchor_columns:
        anchor_columns["vs_flashmla"] = seconds * 1e6 / anchor_columns["flashmla_us"]
    return {
        **anchor_columns,
        "format": kv_format, "T": tokens, "H": heads, "topk": TOPK, "impl": impl, "variant": plan.variant,
        "num_splits": plan.num_splits, "staged": plan.staged_format, "us": seconds * 1e6, "us_min": fastest * 1e6, "us_max": slowest * 1e6,
        "tflops": flops / seconds / 1e12, "gbps": gathered / seconds / 1e9,
        "baseline_us": None if base_seconds is None else base_seconds * 1e6,
        "speedup": None if base_seconds is None else base_seconds / seconds,
        "check": "ok" if ok else "FAIL", "max_err": err, "rel_l2": rel_l2, "lse_err": lse_err, "steps": steps,
    }


EMPTY_SHARD_SHAPES = ((128, 128), (16, 128))  # (T, H): a prefill plan and a decode plan


def empty_shard_rows(jsm, cache_entry, rng):
    """Cost of a padded expert-parallel shard: the same call with valid_tokens = T and = 0, for a prefill
    and a decode plan, with two harness floors per shape."""
    rows = []
    for tokens, heads in EMPTY_SHARD_SHAPES:
        rows.extend(_empty_shard_shape(jsm, cache_entry, rng, tokens, heads))
    return rows


def _empty_shard_shape(jsm, cache_entry, rng, tokens, heads):
    import jax
    import jax.numpy as jnp

    from jax_sparse_mla.timing import time_scan

    cache, _, num_slots = cache_entry
    fmt = jsm.get_format("dsv3_2")
    q = jnp.asarray(rng.standard_normal((tokens, heads, fmt.d_qk)), jnp.bfloat16)
    # The empty shard and the floor are short steps: time them over as many steps as small-T cases.
    short_steps = max(FLAGS.steps, FLAGS.small_steps)
    all_indices = jnp.asarray(rng.integers(0, num_slots, (short_steps, tokens, TOPK)), jnp.int32)
    plan = jsm.plan(q.shape, fmt, TOPK, platform="cuda")
    rows = []

    def row(impl, variant, seconds, fastest, slowest, ok, steps, num_splits=0):
        rows.append({"format": "dsv3_2", "T": tokens, "H": heads, "topk": TOPK, "impl": impl, "variant": variant,
                     "num_splits": num_splits, "us": seconds * 1e6, "us_min": fastest * 1e6,
                     "us_max": slowest * 1e6, "tflops": 0.0, "gbps": 0.0, "baseline_us": None, "speedup": None,
                     "check": "ok" if ok else "FAIL", "max_err": 0.0, "rel_l2": 0.0, "lse_err": 0.0,
                     "steps": int(steps)})
        print(json.dumps(rows[-1]), flush=True)

    for valid in (tokens, 0):
        vt = jnp.int32(valid)
        indices = all_indices[:FLAGS.steps] if valid else all_indices

        def op(operands, idx):
            q, cache, vt = operands
            return jsm.sparse_mla(q, cache, idx, kv_format=fmt, sm_scale=fmt.d_qk ** -0.5, valid_tokens=vt)

        out, lse = jax.jit(op)((q, cache, vt), indices[0])
        ok = bool(jnp.all(jnp.isfinite(out.astype(jnp.float32))))
        if valid == 0:
            ok = ok and bool(jnp.all(out == 0)) and bool(jnp.all(lse == -jnp.inf))
        timing = time_scan(lambda ops, idx: jnp.sum(op(ops, idx)[0].astype(jnp.float32)), (q, cache, vt), indices,
                           FLAGS.repeats)
        row(f"valid_tokens={valid}", plan.variant, *timing, ok, indices.shape[0], plan.num_splits)
    # Harness floors: the same scan where the op only produces an output-sized array (zeros but one element
    # per row that depends on the step's indices) that the step then sums. XLA may fuse the zeros into the
    # sum (nothing written: "fused"); behind an optimization barrier the array is written and read back
    # ("materialised"), which is what any kernel that writes the output pays.
    out_shape = (tokens, heads, fmt.d_v)

    def floor_op(idx):
        return jnp.zeros(out_shape, jnp.bfloat16).at[:, 0, 0].set(idx[:, 0].astype(jnp.bfloat16))

    for name, wrap in (("fused", lambda x: x), ("materialised", jax.lax.optimization_barrier)):
        timing = time_scan(lambda ops, idx: jnp.sum(wrap(floor_op(idx)).astype(jnp.float32)), (), all_indices,
                           FLAGS.repeats)
        row("floor", f"harness floor, {name} (an output-sized array, summed)", *timing, True, all_indices.shape[0])
    return rows


def write_results(rows, device):
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    suffix = f"_{FLAGS.tag}" if FLAGS.tag else ""
    with open(os.path.join(FLAGS.out_dir, f"bench{suffix}.json"), "w") as f:
        json.dump({"device": device, "steps": FLAGS.steps, "repeats": FLAGS.repeats,
                   "pool_bytes": FLAGS.pool_bytes, "rows": rows}, f, indent=1)
    step_counts = sorted({r.get("steps", FLAGS.steps) for r in rows}) or [FLAGS.steps]
    from jax_sparse_mla.timing import CALLS_PER_SAMPLE

    anchored = any("flashmla_us" in r for r in rows)
    lines = [f"Device: {device}. Median device time per call (lax.scan over "
             f"{' or '.join(map(str, step_counts))} index sets, {CALLS_PER_SAMPLE} calls queued per sample, "
             f"{FLAGS.repeats} samples), topk={TOPK}, cache {FLAGS.pool_bytes / 1e6:.0f} MB, random indices."
             + (f" Baseline above {FLAGS.baseline_chunk_tokens} tokens: over sequential chunks of that many."
                if any(r.get("T", 0) > FLAGS.baseline_chunk_tokens for r in rows) else "")
             + (" FlashMLA: a CUDA graph of one call per index set on the same bytes, each call's output "
                f"summed like a scan step's, replayed {CALLS_PER_SAMPLE} times per sample (prefill on the "
                "dequantized BF16 cache; H < 64 padded to 64 heads); diff = max |ours - FlashMLA| / max |FlashMLA|." if anchored else ""), "",
             "| format | kernel | T | H | µs | TFLOP/s | GB/s | baseline µs | speed-up | "
             + ("FlashMLA µs | ours / FlashMLA | diff | " if anchored else "") + "check |",
             "|---|---|---|---|---|---|---|---|---|" + ("---|---|---|" if anchored else "") + "---|"]
    for r in rows:
        base = "—" if r["baseline_us"] is None else f"{r['baseline_us']:.1f}"
        speed = "—" if r["speedup"] is None else f"{r['speedup']:.2f}×"
        anchor = ""
        if anchored:
            anchor = ("— | — | — | " if "flashmla_us" not in r else
                      f"{r['flashmla_us']:.1f} | {r['vs_flashmla']:.2f} | {r['flashmla_max_diff']:.1e} | ")
        kernel = r["variant"] + (f" ({r['num_splits']} splits)" if r["variant"] == "decode" else "")
        if r.get("staged"):
            kernel += f" on a {r['staged']} copy"
        elif r.get("staging") == "off":
            kernel += ", staging off"
        if r["impl"].startswith("valid_tokens"):
            kernel += f", {r['impl']}"
        elif r["impl"] == "floor":
            kernel = r["variant"]
        lines.append(f"| {r['format']} | {kernel} | {r['T']} | {r['H']} | {r['us']:.1f} | {r['tflops']:.0f} | "
                     f"{r['gbps']:.0f} | {base} | {speed} | {anchor}{r['check']} |")
    table = "\n".join(lines) + "\n"
    with open(os.path.join(FLAGS.out_dir, f"bench{suffix}.md"), "w") as f:
        f.write(table)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logging.warning("matplotlib missing: no plot")
        return table
    if len(rows) < 2:
        return table
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for kv_format in sorted({r["format"] for r in rows}):
        for heads in sorted({r["H"] for r in rows if r["format"] == kv_format}):
            sel = [r for r in rows if r["format"] == kv_format and r["H"] == heads and r["impl"] == "auto"]
            if len(sel) < 2:
                continue
            xs = [r["T"] for r in sel]
            axes[0].plot(xs, [r["tflops"] for r in sel], marker="o", label=f"{kv_format} H={heads}")
            axes[1].plot(xs, [r["speedup"] or 0 for r in sel], marker="o", label=f"{kv_format} H={heads}")
    for ax, title in zip(axes, ("TFLOP/s", "speed-up over pure-JAX baseline")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens T")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"jax_sparse_mla sparse MLA, topk={TOPK}, {device}")
    fig.tight_layout()
    fig.savefig(os.path.join(FLAGS.out_dir, f"bench{suffix}.png"), dpi=110)
    plt.close(fig)
    return table


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jax_sparse_mla as jsm

    device = jax.devices()[0].device_kind
    rng = np.random.default_rng(0)
    page_size = 64
    rows = []
    caches = {}
    needed = {c.split(":")[0] for c in FLAGS.cases} if FLAGS.cases else set(FLAGS.formats)
    if FLAGS.prefill:
        needed |= {f for f in FLAGS.prefill_formats if f != "bf16_576"}
    for kv_format in sorted(needed | {"dsv3_2"}):
        fmt = jsm.get_format(kv_format)
        pages = -(-FLAGS.pool_bytes // (page_size * fmt.bytes_per_token))
        key = jax.random.PRNGKey(len(caches))
        kv = jax.random.normal(key, (pages * page_size, fmt.d_qk), jnp.float32)
        cache = jax.jit(lambda x, f=fmt: jsm.quantize_kv(x, f, page_size=page_size))(kv)
        del kv
        caches[kv_format] = (cache, baseline_view(cache, kv_format, page_size), pages * page_size)
    if FLAGS.cases:
        decode_cases = [(f, int(t), int(h)) for f, t, h in (c.split(":") for c in FLAGS.cases)]
    else:
        decode_cases = [(f, t, h) for f in FLAGS.formats for t, h in decode_grid(FLAGS.grid)]
    prefill_cases = ([(int(t), 128) for t in FLAGS.prefill_tokens] if FLAGS.prefill_tokens
                     else prefill_grid(FLAGS.grid)) if FLAGS.prefill else []
    prefill_impl = "prefill" if jsm.cuda_available() else "auto"
    anchor = None
    if FLAGS.flashmla != "off":
        import flashmla_anchor

        reason = flashmla_anchor.import_error()
        if reason is None:
            anchor = flashmla_anchor
        elif FLAGS.flashmla == "on":
            raise SystemExit(f"--flashmla=on, but FlashMLA does not import: {reason}")
        else:
            print(f"FlashMLA not available ({reason}): no FlashMLA columns", flush=True)
    kv_bf16 = None
    if prefill_cases and (anchor is not None or "bf16_576" in FLAGS.prefill_formats):
        # The dsv3_2 cache dequantized: FlashMLA's prefill input and our bf16_576 prefill cache.
        kv_bf16 = jax.jit(lambda c: jsm.dequantize_kv(c, "dsv3_2")[0].astype(jnp.bfloat16))(caches["dsv3_2"][0])
        caches["bf16_576"] = (kv_bf16, None, kv_bf16.shape[0])
    work = [(f, t, h, "auto", True) for f, t, h in decode_cases]
    work += [(f, t, h, prefill_impl, f != "bf16_576") for f in FLAGS.prefill_formats for t, h in prefill_cases]
    for kv_format, tokens, heads, impl, with_baseline in work:
        cache, view, num_slots = caches[kv_format]
        started = time.perf_counter()
        rows.append(run_case(jsm, cache, view, kv_format, page_size, num_slots, tokens, heads, impl, rng,
                             with_baseline, anchor=anchor, kv_bf16=kv_bf16))
        rows[-1]["wall_s"] = time.perf_counter() - started
        print(json.dumps(rows[-1]), flush=True)
        if rows[-1]["staged"] and FLAGS.staging_ab:
            # The same case on the format's own kernels, in the same run (the setting is read at trace time).
            before = os.environ.get(jsm.planner.STAGING_ENV)
            os.environ[jsm.planner.STAGING_ENV] = "off"
            try:
                rows.append(dict(run_case(jsm, cache, view, kv_format, page_size, num_slots, tokens, heads, impl,
                                          rng, False, anchor=None, kv_bf16=kv_bf16), staging="off"))
            finally:
                if before is None:
                    del os.environ[jsm.planner.STAGING_ENV]
                else:
                    os.environ[jsm.planner.STAGING_ENV] = before
            rows[-1]["vs_staged"] = rows[-1]["us"] / rows[-2]["us"]
            print(json.dumps(rows[-1]), flush=True)
        write_results(rows, device)  # a run cut short still leaves its table
    if FLAGS.empty_shard:
        rows.extend(empty_shard_rows(jsm, caches["dsv3_2"], rng))
    print(write_results(rows, device))
    return 0 if all(r["check"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    app.run(main)
