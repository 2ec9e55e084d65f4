"""Times one decode step of the DeepSeek-V3.2 attention block with the sparse MLA kernels against the same
block with ``impl="xla"`` (the library's pure-JAX gather + einsum path).

    python examples/deepseek_v32/bench_decode.py                               # GPU: DeepSeek-V3.2's dimensions
    python examples/deepseek_v32/bench_decode.py --model tiny --batch 2 --context 40   # CPU: seconds

A step decodes one token for each of ``--batch`` sequences that already hold ``--context`` tokens in the
paged caches (filled with random latent rows and index keys: the step's work does not depend on their
values, and filling them through the layer's prefill would take longer than the benchmark). Reported per
implementation: the whole jitted step (projections, indexer top-k, cache writes, attention, output
projection; caches donated) and the ``sparse_mla`` call alone on the step's operands. Before timing, the
two implementations' outputs of one step are compared.

Timing: a sample queues ``--calls`` steps back to back (each step's donated caches feed the next, as in a
serving loop) and waits for the last, so host dispatch overlaps device work; the median over ``--repeats``
samples after two warm-up steps is reported, in µs per step.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx

import jax_sparse_mla as jsm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attention import Caches, Config, SparseMLA, allocate_pages, jit_step, with_config  # noqa: E402

flags.DEFINE_enum("model", "full", ["full", "tiny"], "full: DeepSeek-V3.2's dimensions (128 heads, 7168 "
                  "hidden, indexer 64 x 128, top-2048); tiny: a few heads and a top-16, for a CPU.")
flags.DEFINE_enum("kv_format", "dsv3_2", ["dsv3_2", "glm_nsa", "bf16_576"], "Latent cache format.")
flags.DEFINE_integer("batch", 64, "Sequences decoded per step (the kernel's T).")
flags.DEFINE_integer("context", 4096, "Tokens already cached per sequence.")
flags.DEFINE_integer("page_size", 64, "Tokens per cache page.")
flags.DEFINE_integer("calls", 8, "Steps queued back to back per timing sample.")
flags.DEFINE_integer("repeats", 10, "Timing samples; the median is reported.")
flags.DEFINE_string("json", "", "Also write the results to this JSON file.")
FLAGS = flags.FLAGS

TINY = dict(hidden_size=64, num_heads=4, q_lora_rank=32, qk_nope_head_dim=16, v_head_dim=16, index_num_heads=4,
            index_head_dim=80, index_topk=16)
# Outputs of the two implementations agree to bf16 rounding of the 512-lane attention output.
MAX_RELATIVE_L2 = 2e-2


def build_config(model: str, kv_format: str, page_size: int) -> Config:
    dims = TINY if model == "tiny" else {}
    return Config(**dims, kv_format=kv_format, page_size=page_size, dtype=jnp.bfloat16, impl="auto")


def random_caches(config: Config, num_pages: int, seed: int) -> Caches:
    """Caches whose every slot holds a standard-normal latent row (kv_norm's scale) and index key."""
    latent_key, index_key = jax.random.split(jax.random.key(seed))
    num_slots = num_pages * config.page_size

    @jax.jit
    def fill(latent_key, index_key):
        rows = jax.random.normal(latent_key, (num_slots, config.latent_dim), jnp.float32)
        latent = jsm.quantize_kv(rows, config.kv_format, page_size=config.page_size)
        keys = jax.random.normal(index_key, (num_pages, config.page_size, config.index_head_dim), jnp.bfloat16)
        return Caches(latent, keys)

    return fill(latent_key, index_key)


def copy_caches(caches: Caches) -> Caches:
    return jax.tree.map(jnp.copy, caches)


def median_us(run, state, calls: int, repeats: int):
    """Median µs per call of ``state = run(state)`` over ``repeats`` samples of ``calls`` queued calls."""
    for _ in range(2):
        state = jax.block_until_ready(run(state))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            state = run(state)
        jax.block_until_ready(state)
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples)


def benchmark(model: str = "full", kv_format: str = "dsv3_2", batch: int = 64, context: int = 4096,
              page_size: int = 64, calls: int = 8, repeats: int = 10, seed: int = 0) -> dict:
    """Runs the comparison and returns its results (see the module docstring)."""
    config = build_config(model, kv_format, page_size)
    pages_per_seq = -(-(context + 1) // page_size)
    num_pages = batch * pages_per_seq
    block = SparseMLA(config, rngs=nnx.Rngs(seed))
    blocks = {"auto": block, "xla": with_config(block, impl="xla")}  # the same parameters
    page_table = allocate_pages([context + 1] * batch, page_size, pages_per_seq, num_pages, seed=seed)
    caches = random_caches(config, num_pages, seed)
    x = jax.random.normal(jax.random.key(seed + 1), (batch, 1, config.hidden_size), config.dtype)
    positions = jnp.full((batch, 1), context, jnp.int32)

    steps = {impl: jit_step(block) for impl, block in blocks.items()}
    outputs = {impl: np.asarray(step(copy_caches(caches), x, positions, page_table)[0], np.float32)
               for impl, step in steps.items()}
    relative_l2 = float(np.linalg.norm(outputs["auto"] - outputs["xla"]) / np.linalg.norm(outputs["xla"]))
    if not relative_l2 <= MAX_RELATIVE_L2:
        raise AssertionError(f"impl='auto' and impl='xla' disagree: relative L2 {relative_l2:.3g} > {MAX_RELATIVE_L2}")

    q, indices, _ = nnx.jit(lambda block, caches: block.prepare(x, positions, caches, page_table))(
        blocks["auto"], caches)
    results = {"model": model, "kv_format": kv_format, "batch": batch, "context": context, "page_size": page_size,
               "num_heads": config.num_heads, "index_topk": config.index_topk, "backend": jax.default_backend(),
               "device": str(jax.devices()[0].device_kind), "relative_l2_auto_vs_xla": relative_l2}
    for impl, step in steps.items():
        results[f"step_us_{impl}"] = median_us(lambda c, step=step: step(c, x, positions, page_table)[1],
                                               copy_caches(caches), calls, repeats)
        attend = jax.jit(functools.partial(jsm.sparse_mla, kv_format=kv_format, sm_scale=config.softmax_scale,
                                           impl=impl))
        # Calls on the same operands: the previous output is only what the timer waits on.
        results[f"attention_us_{impl}"] = median_us(lambda _, attend=attend: attend(q, caches.latent, indices)[0],
                                                    None, calls, repeats)
    return results


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    results = benchmark(FLAGS.model, FLAGS.kv_format, FLAGS.batch, FLAGS.context, FLAGS.page_size, FLAGS.calls,
                        FLAGS.repeats)
    print(f"{results['model']} model, {results['kv_format']}, {results['batch']} sequences x {results['context']} "
          f"cached tokens, {results['num_heads']} heads, top-{results['index_topk']}, on {results['device']}")
    print(f"outputs: relative L2 difference auto vs xla = {results['relative_l2_auto_vs_xla']:.2e}")
    print(f"{'':24}{'auto (kernels)':>16}{'xla':>12}{'speed-up':>10}")
    for what, key in (("decode step (layer)", "step_us"), ("sparse_mla call", "attention_us")):
        auto, xla = results[f"{key}_auto"], results[f"{key}_xla"]
        print(f"{what + ' µs':24}{auto:16.1f}{xla:12.1f}{xla / auto:9.2f}x")
    if FLAGS.json:
        with open(FLAGS.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    app.run(main)
