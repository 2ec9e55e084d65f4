"""Expert-parallel decode of the DeepSeek-V3.2 attention block on 8 devices, one of them without sequences.

In expert-parallel serving the attention runs data parallel: each rank holds its own sequences, its own
paged caches and its own page table, so its indices address its local cache. This script runs one decode
step of :class:`attention.SparseMLA` over 8 ranks in one jitted program:

1. ``prepare`` per rank under ``jax.shard_map`` (cache writes, indexer, absorbed queries: all local);
2. the attention with ``jax_sparse_mla.sharded_sparse_mla(mesh, token_axis="ep")``: no collective, the
   ranks' caches are one global array concatenated on the page axis and ``valid_tokens`` holds one count
   per rank. Rank 2 serves one sequence of two (its second row is padding) and rank 5 none at all: with
   ``valid_tokens = 0`` its kernel launches exit at once (out = 0, lse = -inf), and the executable is
   the same whichever ranks are idle;
3. ``project_out``, data parallel like the rest.

It then checks every rank against the same step run unsharded on that rank's own arrays (outputs and
cache bytes) and prints one line per rank.

    python examples/deepseek_v32/expert_parallel.py

On a machine with fewer than 8 accelerators it forces 8 host CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=8``, set below before JAX starts) and runs there.
"""

from __future__ import annotations

import os
import sys

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_sparse_mla as jsm  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attention import Config, SparseMLA, allocate_pages, init_caches, jit_step, prefill  # noqa: E402

RANKS = 8
SEQS_PER_RANK = 2
PAGES_PER_RANK = 8
MAX_PAGES_PER_SEQ = 4
# Sequences each rank serves: rank 2 one (its second row is padding), rank 5 none (an empty shard).
ACTIVE_SEQS = [2, 2, 1, 2, 2, 0, 2, 2]
CONFIG = Config(hidden_size=64, num_heads=4, q_lora_rank=32, qk_nope_head_dim=16, v_head_dim=16, index_num_heads=4,
                index_head_dim=80, index_topk=16, page_size=8, kv_format="dsv3_2")


def devices():
    """8 devices of the default backend, or the 8 forced host CPU devices when it has fewer."""
    for platform in (None, "cpu"):
        found = jax.devices(platform)
        if len(found) >= RANKS:
            return found[:RANKS]
    raise SystemExit(f"needs {RANKS} devices; run with XLA_FLAGS=--xla_force_host_platform_device_count={RANKS}")


def build_ranks(block, rng):
    """Per rank: caches after prefilling its sequences' prompts, its page table and its decode inputs."""
    ranks = []
    step = jit_step(block)
    for r in range(RANKS):
        active = ACTIVE_SEQS[r]
        lengths = np.zeros(SEQS_PER_RANK, np.int32)
        lengths[:active] = rng.integers(5, 25, active)
        table = np.full((SEQS_PER_RANK, MAX_PAGES_PER_SEQ), -1, np.int32)
        if active:
            table[:active] = allocate_pages(lengths[:active] + 1, CONFIG.page_size, MAX_PAGES_PER_SEQ,
                                            PAGES_PER_RANK, seed=r)
        table = jnp.asarray(table)
        caches = init_caches(CONFIG, PAGES_PER_RANK)
        prompts = jnp.asarray(rng.standard_normal((SEQS_PER_RANK, 24, CONFIG.hidden_size)), jnp.float32)
        _, caches = prefill(step, caches, prompts, lengths, table)
        x = jnp.asarray(rng.standard_normal((SEQS_PER_RANK, 1, CONFIG.hidden_size)), jnp.float32)
        # The next token of each active sequence sits at position = its length; padding rows at -1.
        positions = jnp.asarray(np.where(np.arange(SEQS_PER_RANK) < active, lengths, -1)[:, None], jnp.int32)
        ranks.append(dict(caches=caches, table=table, x=x, positions=positions))
    return ranks


def sharded_decode_step(block, mesh):
    """One decode step over all ranks: global arrays in, global arrays out; caches donated."""
    graphdef, state = nnx.split(block)
    rows = P("ep")
    attend = jsm.sharded_sparse_mla(mesh, token_axis="ep", kv_format=CONFIG.kv_format,
                                    sm_scale=CONFIG.softmax_scale, impl=CONFIG.impl)

    def prepare_local(state, x, positions, caches, page_table):
        return nnx.merge(graphdef, state).prepare(x, positions, caches, page_table)

    prepare = jax.shard_map(prepare_local, mesh=mesh, in_specs=(P(), rows, rows, rows, rows),
                            out_specs=(rows, rows, rows))

    def step(state, caches, x, positions, page_table, valid_tokens):
        q, indices, caches = prepare(state, x, positions, caches, page_table)
        out, lse = attend(q, caches.latent, indices, valid_tokens=valid_tokens)
        return nnx.merge(graphdef, state).project_out(out), lse, caches

    run = jax.jit(step, donate_argnums=1)
    return lambda *args: run(state, *args)


def main():
    mesh = jax.sharding.Mesh(np.asarray(devices()), ("ep",), axis_types=(jax.sharding.AxisType.Auto,))
    block = SparseMLA(CONFIG, rngs=nnx.Rngs(0))
    ranks = build_ranks(block, np.random.default_rng(0))

    # Unsharded: each rank's step on its own arrays (copies: the step donates its caches).
    step = jit_step(block)
    expected = [step(jax.tree.map(jnp.copy, r["caches"]), r["x"], r["positions"], r["table"]) for r in ranks]

    def stack(get):
        return jax.tree.map(lambda *xs: jax.device_put(jnp.concatenate(xs), NamedSharding(mesh, P("ep"))),
                            *[get(r) for r in ranks])

    valid_tokens = jax.device_put(jnp.asarray(ACTIVE_SEQS, jnp.int32), NamedSharding(mesh, P("ep")))
    y, lse, caches = sharded_decode_step(block, mesh)(stack(lambda r: r["caches"]), stack(lambda r: r["x"]),
                                                      stack(lambda r: r["positions"]), stack(lambda r: r["table"]),
                                                      valid_tokens)

    y, lse = np.asarray(y), np.asarray(lse)
    latent = np.asarray(caches.latent).reshape(RANKS, PAGES_PER_RANK, *caches.latent.shape[1:])
    index_keys = np.asarray(caches.index_keys).reshape(RANKS, PAGES_PER_RANK, *caches.index_keys.shape[1:])
    print(f"{RANKS} ranks on {mesh.devices.flat[0].platform}, {CONFIG.kv_format}, sequences per rank {ACTIVE_SEQS}")
    failures = []
    for r, (want_y, want_caches) in enumerate(expected):
        rows = slice(r * SEQS_PER_RANK, (r + 1) * SEQS_PER_RANK)
        active = ACTIVE_SEQS[r]
        error = float(np.abs(y[rows] - np.asarray(want_y)).max())
        scale = max(1.0, float(np.abs(np.asarray(want_y)).max()))
        same_caches = (np.array_equal(latent[r], np.asarray(want_caches.latent))
                       and np.array_equal(index_keys[r], np.asarray(want_caches.index_keys)))
        padding_rows_empty = bool(np.all(y[rows][active:] == 0) and np.all(lse[rows][active:] == -np.inf))
        ok = error <= 1e-5 * scale and same_caches and padding_rows_empty
        padding = "" if active == SEQS_PER_RANK else (
            f", padding rows {'out 0, lse -inf' if padding_rows_empty else 'NOT EMPTY'}")
        print(f"rank {r}: {active} sequence(s), valid_tokens {ACTIVE_SEQS[r]}, max |sharded - unsharded| "
              f"{error:.1e}, caches {'identical' if same_caches else 'DIFFER'}{padding}")
        if not ok:
            failures.append(r)
    if failures:
        raise SystemExit(f"ranks {failures} differ from the unsharded step")
    print("sharded decode step matches the unsharded one on every rank")


if __name__ == "__main__":
    main()
