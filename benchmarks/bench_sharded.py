"""Weak scaling of a sharded decode step (``sharded_sparse_mla``) over the local devices.

    python benchmarks/bench_sharded.py                       # GPUs: 1, 2, 4, 8 where present
    XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        python benchmarks/bench_sharded.py --platform cpu --tokens_per_rank 1 --pool_bytes 2000000 --topk 64

For n devices the mesh is (ep, tp) = (n / tp, tp) with tp = ``--tensor_parallel`` (1 on one device): H
heads split over the tensor-parallel ranks, ``--tokens_per_rank`` tokens per expert-parallel rank, each of
which owns a cache of ``--pool_bytes`` (per-rank caches, local indices), so the work per device is the
same at every n. Reported per device count: the step's time (the bench.py method: a jitted ``lax.scan``
over rotating index sets, queued calls, median), its ratio to one device, the same step with the last
expert-parallel rank empty (``valid_tokens`` 0), and a check of the compiled program: no collective
(all-gather, all-reduce, reduce-scatter, all-to-all, collective-permute) anywhere, so no cache is gathered.
Each step's output is first compared with the unsharded call of every shard.
"""

from __future__ import annotations

import json
import os

from absl import app, flags, logging

flags.DEFINE_string("platform", "gpu", "Devices to shard over: gpu or cpu.")
flags.DEFINE_list("devices", ["1", "2", "4", "8"], "Device counts to run (those above the local count are skipped).")
flags.DEFINE_list("tokens_per_rank", ["1", "16", "128"], "Tokens per expert-parallel rank.")
flags.DEFINE_integer("heads", 128, "Query heads (split over the tensor-parallel ranks).")
flags.DEFINE_integer("tensor_parallel", 2, "Tensor-parallel ranks (1 on a single device).")
flags.DEFINE_integer("topk", 2048, "Candidates per row.")
flags.DEFINE_integer("pool_bytes", 192 * 1024 * 1024, "Cache bytes per expert-parallel rank.")
flags.DEFINE_integer("steps", 16, "Index sets per timed call.")
flags.DEFINE_integer("repeats", 8, "Timed calls per case; the median is reported.")
flags.DEFINE_string("out_dir", os.path.join(os.path.dirname(__file__), "results"), "Where results go.")
FLAGS = flags.FLAGS

KV_FORMAT = "dsv3_2"
PAGE_SIZE = 64
def mesh_shape(devices: int) -> tuple:
    tensor = min(FLAGS.tensor_parallel, devices)
    if devices % tensor:
        raise ValueError(f"--tensor_parallel={FLAGS.tensor_parallel} does not divide {devices} devices")
    return devices // tensor, tensor


def run(devices, tokens_per_rank, caches, rng):
    """One device count and token count: the row of the results table."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jax_sparse_mla as jsm
    from jax_sparse_mla.sharding import collectives_in
    from jax_sparse_mla.timing import median_step_seconds

    fmt = jsm.get_format(KV_FORMAT)
    sm_scale = fmt.d_qk ** -0.5
    expert, tensor = mesh_shape(devices)
    mesh = jax.sharding.Mesh(np.array(jax.devices(FLAGS.platform)[:devices]).reshape(expert, tensor), ("ep", "tp"))
    cache = jnp.concatenate(caches[:expert])
    slots = caches[0].shape[0] * PAGE_SIZE
    tokens = expert * tokens_per_rank
    q = jnp.asarray(rng.standard_normal((tokens, FLAGS.heads, fmt.d_qk)), jnp.bfloat16)
    index_sets = jnp.asarray(rng.integers(0, slots, (FLAGS.steps, tokens, FLAGS.topk)), jnp.int32)
    attend = jsm.sharded_sparse_mla(mesh, token_axis="ep", head_axis="tp", kv_format=fmt, sm_scale=sm_scale)
    specs = jsm.sparse_mla_specs(token_axis="ep", head_axis="tp")
    put = lambda x, spec: jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))  # noqa: E731
    q, cache = put(q, specs.q), put(cache, specs.kv_cache)
    index_sets = put(index_sets, jax.sharding.PartitionSpec(None, "ep"))

    # Correctness: every shard of the sharded step equals the unsharded call on that shard's operands.
    out, _ = jax.jit(attend)(q, cache, index_sets[0])
    heads_per_rank = FLAGS.heads // tensor
    worst = 0.0
    for e in range(expert):
        rows = slice(e * tokens_per_rank, (e + 1) * tokens_per_rank)
        for t in range(tensor):
            heads = slice(t * heads_per_rank, (t + 1) * heads_per_rank)
            ref, _ = jsm.sparse_mla(np.asarray(q)[rows, heads], caches[e], np.asarray(index_sets[0])[rows],
                                    kv_format=fmt, sm_scale=sm_scale)
            worst = max(worst, float(np.max(np.abs(np.asarray(out, np.float32)[rows, heads] -
                                                   np.asarray(ref, np.float32)))))

    row = {"devices": devices, "mesh": [expert, tensor], "tokens_per_rank": tokens_per_rank, "H": FLAGS.heads,
           "topk": FLAGS.topk, "max_diff_vs_unsharded": worst}
    d_v = fmt.d_v
    block_sums = put(jnp.zeros((expert, tensor), jnp.float32), jax.sharding.PartitionSpec("ep", "tp"))

    def step_sums(ops, idx):
        """Each device's sum of its own block of the output: consumed without any communication."""
        out, _ = attend(ops[0], ops[1], idx, valid_tokens=ops[2])
        blocks = out.reshape(expert, tokens_per_rank, tensor, heads_per_rank, d_v).astype(jnp.float32)
        return jnp.sum(blocks, axis=(1, 3, 4))

    @jax.jit
    def scan_steps(ops, xs, init):
        return jax.lax.scan(lambda carry, x: (carry + step_sums(ops, x), None), init, xs)[0]

    for label, counts in (("full", [tokens_per_rank] * expert), ("last_rank_empty", [tokens_per_rank] * (expert - 1) + [0])):
        valid = put(jnp.asarray(counts, jnp.int32), specs.valid_tokens)
        seconds, _, _ = median_step_seconds(scan_steps, ((q, cache, valid), index_sets, block_sums), FLAGS.steps,
                                            FLAGS.repeats)
        row[f"{label}_us"] = seconds * 1e6
        if label == "full":
            # The op alone, and the timed program with its per-device consumption: no collective in either.
            op_hlo = jax.jit(lambda q, c, i, v: attend(q, c, i, valid_tokens=v)).lower(
                q, cache, index_sets[0], valid).compile().as_text()
            timed_hlo = scan_steps.lower((q, cache, valid), index_sets, block_sums).compile().as_text()
            row["collectives"] = sorted(set(collectives_in(op_hlo)) | set(collectives_in(timed_hlo)))
    return row


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jax_sparse_mla as jsm

    available = len(jax.devices(FLAGS.platform))
    counts = [n for n in map(int, FLAGS.devices) if n <= available]
    fmt = jsm.get_format(KV_FORMAT)
    rng = np.random.default_rng(0)
    pages = -(-FLAGS.pool_bytes // (PAGE_SIZE * fmt.bytes_per_token))
    max_expert = max(mesh_shape(n)[0] for n in counts)
    cpu = jax.devices("cpu")[0]
    caches = []
    for r in range(max_expert):  # one cache per expert-parallel rank, built on the host then placed by the mesh
        kv = jax.random.normal(jax.random.PRNGKey(r), (pages * PAGE_SIZE, fmt.d_qk), jnp.float32)
        caches.append(jax.device_put(jsm.quantize_kv(kv, fmt, page_size=PAGE_SIZE), cpu))
    rows = []
    for tokens_per_rank in map(int, FLAGS.tokens_per_rank):
        for n in counts:
            row = run(n, tokens_per_rank, caches, rng)
            one = next((r for r in rows if r["devices"] == 1 and r["tokens_per_rank"] == tokens_per_rank), row)
            row["ratio_to_one_device"] = row["full_us"] / one["full_us"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    device = jax.devices(FLAGS.platform)[0].device_kind
    lines = [f"Weak scaling on {device} ({FLAGS.platform}): dsv3_2, H={FLAGS.heads} over tensor-parallel ranks, topk="
             f"{FLAGS.topk}, a {FLAGS.pool_bytes / 1e6:.0f} MB cache per expert-parallel rank; µs per step.", "",
             "| devices | mesh (ep, tp) | tokens/rank | µs | vs 1 device | last rank empty µs | collectives | "
             "max diff vs unsharded |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['devices']} | {tuple(r['mesh'])} | {r['tokens_per_rank']} | {r['full_us']:.1f} | "
                     f"{r['ratio_to_one_device']:.2f} | {r['last_rank_empty_us']:.1f} | "
                     f"{', '.join(r['collectives']) or 'none'} | {r['max_diff_vs_unsharded']:.1e} |")
    text = "\n".join(lines) + "\n"
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    suffix = "" if FLAGS.platform == "gpu" else f"_{FLAGS.platform}"
    with open(os.path.join(FLAGS.out_dir, f"bench_sharded{suffix}.json"), "w") as f:
        json.dump({"device": device, "platform": FLAGS.platform, "rows": rows}, f, indent=1)
    with open(os.path.join(FLAGS.out_dir, f"bench_sharded{suffix}.md"), "w") as f:
        f.write(text)
    print(text)
    bad = [r for r in rows if r["collectives"] or r["max_diff_vs_unsharded"] > 0]
    return 1 if bad else 0


if __name__ == "__main__":
    app.run(main)
