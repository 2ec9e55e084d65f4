"""examples/deepseek_v32: the paged sparse DeepSeek-V3.2 block against its dense version, its conventions,
the decode benchmark's CPU path and the expert-parallel example.

Dimensions are small (4 heads, a top-16 indexer, two sequences of a few dozen tokens) except the latent row,
which the cache formats fix at 512 + 64 lanes. The scripts run in subprocesses: the expert-parallel one
needs 8 host devices, which must be forced before JAX starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_sparse_mla as jsm

EXAMPLE_DIR = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, "examples", "deepseek_v32"))
sys.path.insert(0, EXAMPLE_DIR)

import attention  # noqa: E402
import dense_attention  # noqa: E402

TINY = dict(hidden_size=64, num_heads=4, q_lora_rank=32, qk_nope_head_dim=16, v_head_dim=16, index_num_heads=4,
            index_head_dim=80, index_topk=16, page_size=8)
PROMPT_LENGTHS = np.array([29, 13], np.int32)  # two sequences, padded to one prefill of PROMPT_TOKENS
PROMPT_TOKENS = 32
DECODE_STEPS = 4
MAX_PAGES_PER_SEQ = 5
NUM_PAGES = 12

# (max |out - ref| / max(1, max |ref|), relative L2) against the dense layer on unquantized latent rows, and
# for FP8 caches against the dense layer on the rows read back from the cache. bf16_576 differs from the
# dense float32 layer by bf16 rounding of q, the cache rows and the 512-lane output; dsv3_2 adds FP8 rounding
# of the 512 nope lanes (3 mantissa bits).
TOLERANCES = {"bf16_576": {"unquantized": (1e-2, 1e-2)},
              "dsv3_2": {"unquantized": (5e-2, 5e-2), "dequantized": (1e-2, 1e-2)}}


def _run(args, **kwargs):
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, **kwargs)
    assert proc.returncode == 0, f"{args[0]} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.fixture(scope="module")
def base_block():
    return attention.SparseMLA(attention.Config(**TINY, kv_format="dsv3_2"), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def inputs():
    """Prompts, decode-step inputs, the same tokens as whole sequences, and a shuffled page table."""
    rng = np.random.default_rng(14)
    batch, hidden = len(PROMPT_LENGTHS), TINY["hidden_size"]
    prompts = rng.standard_normal((batch, PROMPT_TOKENS, hidden)).astype(np.float32)
    steps = rng.standard_normal((DECODE_STEPS, batch, hidden)).astype(np.float32)
    total = PROMPT_LENGTHS + DECODE_STEPS
    sequences = np.zeros((batch, PROMPT_TOKENS + DECODE_STEPS, hidden), np.float32)
    for b, n in enumerate(PROMPT_LENGTHS):
        sequences[b, :n] = prompts[b, :n]
        sequences[b, n:n + DECODE_STEPS] = steps[:, b]
    page_table = attention.allocate_pages(total, TINY["page_size"], MAX_PAGES_PER_SEQ, NUM_PAGES, seed=3)
    return dict(prompts=jnp.asarray(prompts), steps=jnp.asarray(steps), sequences=jnp.asarray(sequences),
                total=total, page_table=page_table)


@pytest.fixture(scope="module")
def dense_layer(base_block, inputs):
    """The dense layer's outputs on the unquantized latent rows (the cache format plays no part in it)."""
    return np.asarray(nnx.jit(dense_attention.dense_attention)(base_block, inputs["sequences"], inputs["total"]))


@pytest.fixture(scope="module")
def layer_run(base_block, inputs, dense_layer, request):
    """Prefill + decode with the paged sparse layer, the dense layer's outputs and the final caches."""
    kv_format = request.param
    block = attention.with_config(base_block, kv_format=kv_format)
    step = attention.jit_step(block)
    caches = attention.init_caches(block.config, NUM_PAGES)
    prefilled, caches = attention.prefill(step, caches, inputs["prompts"], PROMPT_LENGTHS, inputs["page_table"])
    decoded, caches = attention.decode_loop(step, caches, inputs["steps"], PROMPT_LENGTHS, inputs["page_table"])
    got = np.zeros(inputs["sequences"].shape, np.float32)
    for b, n in enumerate(PROMPT_LENGTHS):
        got[b, :n] = prefilled[b, :n]
        got[b, n:n + DECODE_STEPS] = decoded[:, b]
    want = {"unquantized": dense_layer}
    if jsm.get_format(kv_format).quantized:
        k, _ = jsm.dequantize_kv(caches.latent, kv_format)
        length = inputs["sequences"].shape[1]
        positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (len(PROMPT_LENGTHS), length))
        slots = attention.cache_slots(inputs["page_table"], positions, block.config.page_size)
        rows = jnp.where(slots[..., None] >= 0, k[jnp.maximum(slots, 0)], 0.0)
        want["dequantized"] = np.asarray(nnx.jit(dense_attention.dense_attention)(
            block, inputs["sequences"], inputs["total"], rows))
    return dict(block=block, got=got, want=want, prefilled=np.asarray(prefilled), caches=caches)


@pytest.mark.parametrize("layer_run", list(TOLERANCES), indirect=True)
def test_layer_matches_dense_layer(layer_run):
    kv_format = layer_run["block"].config.kv_format
    got = layer_run["got"]
    for reference, (max_error, l2_error) in TOLERANCES[kv_format].items():
        want = layer_run["want"][reference]
        assert np.abs(got - want).max() <= max_error * max(1.0, np.abs(want).max()), reference
        assert np.linalg.norm(got - want) <= l2_error * np.linalg.norm(want), reference


@pytest.mark.parametrize("layer_run", ["dsv3_2"], indirect=True)
def test_fp8_error_is_the_cache_quantization(layer_run):
    """Against the dense layer on the cache's own rows the error is several times smaller than against the
    unquantized rows: what remains is the quantization of the cache, not the paging, indexing or absorption."""
    got, want = layer_run["got"], layer_run["want"]
    error = {name: np.linalg.norm(got - ref) / np.linalg.norm(ref) for name, ref in want.items()}
    assert error["dequantized"] * 4 < error["unquantized"], error


@pytest.mark.parametrize("layer_run", ["bf16_576"], indirect=True)
def test_prefill_padding_rows_are_zero(layer_run):
    for b, n in enumerate(PROMPT_LENGTHS):
        assert np.all(layer_run["prefilled"][b, n:] == 0)


@pytest.mark.parametrize("layer_run", ["dsv3_2"], indirect=True)
def test_writes_go_through_the_page_table(layer_run, inputs):
    """Pages no sequence owns stay all zero; each owned page holds exactly its sequence's written slots."""
    latent = np.asarray(layer_run["caches"].latent)
    table = np.asarray(inputs["page_table"])
    page_size = TINY["page_size"]
    written = np.zeros(NUM_PAGES * page_size, bool)
    for b, n in enumerate(inputs["total"]):
        positions = np.arange(n)
        written[table[b, positions // page_size] * page_size + positions % page_size] = True
    row_is_nonzero = latent.reshape(NUM_PAGES * page_size, -1).any(axis=-1)
    np.testing.assert_array_equal(row_is_nonzero, written)


def test_indexer_picks_the_dense_top_k(base_block, inputs):
    """The paged indexer's slots for the prompts are the dense indexer's top-k positions through the page table;
    a query at position p gets min(p + 1, index_topk) picks and -1 for the rest."""
    block = base_block
    positions = jnp.where(jnp.arange(PROMPT_TOKENS)[None, :] < PROMPT_LENGTHS[:, None],
                          jnp.arange(PROMPT_TOKENS)[None, :], -1).astype(jnp.int32)
    caches = attention.init_caches(block.config, NUM_PAGES)
    _, indices, _ = nnx.jit(lambda block, caches: block.prepare(inputs["prompts"], positions, caches,
                                                                 inputs["page_table"]))(block, caches)
    indices = np.asarray(indices)
    mask = np.asarray(nnx.jit(dense_attention.index_mask)(block, inputs["prompts"], PROMPT_LENGTHS))
    table = np.asarray(inputs["page_table"])
    page_size, topk = TINY["page_size"], TINY["index_topk"]
    for b, n in enumerate(PROMPT_LENGTHS):
        for p in range(n):
            picked = np.flatnonzero(mask[b, p])
            slots = table[b, picked // page_size] * page_size + picked % page_size
            assert sorted(indices[b, p][indices[b, p] >= 0]) == sorted(slots), (b, p)
            assert np.sum(indices[b, p] == -1) == topk - min(p + 1, topk), (b, p)
        assert np.all(indices[b, n:] == -1)


def test_decode_step_donates_its_caches(base_block, inputs):
    step = attention.jit_step(base_block)
    caches = attention.init_caches(base_block.config, NUM_PAGES)
    _, new_caches = step(caches, inputs["steps"][0][:, None], jnp.zeros((2, 1), jnp.int32), inputs["page_table"])
    assert caches.latent.is_deleted() and caches.index_keys.is_deleted()
    assert not new_caches.latent.is_deleted()


def test_cache_slots_follow_the_page_table():
    table = jnp.asarray([[5, 2, -1], [0, 7, 1]], jnp.int32)
    positions = jnp.asarray([[0, 3, 4, 9, -1, 12], [4, 5, 11, 12, 3, 99]], jnp.int32)
    slots = attention.cache_slots(table, positions, page_size=4)
    # seq 0: pages 5, 2 (position 9 is on its unallocated third page); seq 1: pages 0, 7, 1 (99 is past them).
    np.testing.assert_array_equal(slots, [[20, 23, 8, -1, -1, -1], [28, 29, 7, -1, 3, -1]])


def test_softmax_scale_of_deepseek_v32():
    """192 ** -0.5 times YaRN's mscale squared (rope_factor 40), not 576 ** -0.5."""
    config = attention.Config()
    assert config.qk_head_dim == 192
    assert config.softmax_scale == pytest.approx(192 ** -0.5 * (1 + 0.1 * np.log(40.0)) ** 2, rel=1e-12)
    assert config.softmax_scale == pytest.approx(0.13524, abs=1e-5)
    assert attention.Config(rope_factor=1.0).softmax_scale == pytest.approx(192 ** -0.5)


def test_rope_layout_must_match_between_query_and_key():
    """Rotary scores depend on relative position only when q and k use the same pair layout."""
    rng = np.random.default_rng(0)
    freqs = attention.rope_frequencies(attention.Config())
    q, k = (jnp.asarray(rng.standard_normal((1, 64)), jnp.float32) for _ in range(2))

    def score(q_layout, k_layout, q_position, k_position):
        rq = attention.rope(q, jnp.asarray([q_position]), freqs, interleaved=q_layout)
        rk = attention.rope(k, jnp.asarray([k_position]), freqs, interleaved=k_layout)
        return float(jnp.sum(rq * rk))

    for layout in (True, False):
        assert score(layout, layout, 7, 3) == pytest.approx(score(layout, layout, 1007, 1003), rel=1e-4)
    assert score(True, False, 7, 3) != pytest.approx(score(True, False, 1007, 1003), rel=1e-2)


def test_latent_row_is_normed_nope_then_roped_rope(base_block):
    """[kv_a_layernorm(c_kv) ++ rope(k_pe)]: the 512 nope lanes have unit RMS (the norm's scale starts at 1) and
    the 64 rope lanes are the projection's k_pe rotated pair by pair (interleaved), which keeps each pair's norm."""
    block = base_block
    x = jnp.asarray(np.random.default_rng(1).standard_normal((1, 3, TINY["hidden_size"])), jnp.float32)
    positions = jnp.asarray([[0, 5, 40]], jnp.int32)
    rows = np.asarray(block.latent_rows(x, positions))
    np.testing.assert_allclose(np.sqrt(np.mean(rows[..., :512] ** 2, axis=-1)), 1.0, rtol=1e-3)
    k_pe = np.asarray(block.wkv_a(x))[..., 512:]
    np.testing.assert_allclose(rows[0, 0, 512:], k_pe[0, 0], rtol=1e-5, atol=1e-6)  # position 0: no rotation
    pair_norms = lambda v: np.hypot(v[..., 0::2], v[..., 1::2])  # noqa: E731
    np.testing.assert_allclose(pair_norms(rows[..., 512:]), pair_norms(k_pe), rtol=1e-4, atol=1e-6)
    assert not np.allclose(rows[0, 2, 512:], k_pe[0, 2], atol=1e-3)


def test_config_rejects_a_format_of_another_width():
    with pytest.raises(ValueError, match="kv_format"):
        attention.Config(kv_format="dsv4")


def test_bench_decode_runs_on_cpu(tmp_path):
    out = tmp_path / "bench.json"
    stdout = _run([os.path.join(EXAMPLE_DIR, "bench_decode.py"), "--model", "tiny", "--batch", "2", "--context", "20",
                   "--page_size", "8", "--calls", "2", "--repeats", "1", "--json", str(out)])
    results = json.loads(out.read_text())
    assert results["batch"] == 2 and results["num_heads"] == TINY["num_heads"]
    assert results["relative_l2_auto_vs_xla"] < 2e-2
    for key in ("step_us_auto", "step_us_xla", "attention_us_auto", "attention_us_xla"):
        assert results[key] > 0, key
    assert "decode step (layer)" in stdout


def test_expert_parallel_example():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    stdout = _run([os.path.join(EXAMPLE_DIR, "expert_parallel.py")], env=env)
    assert "rank 5: 0 sequence(s), valid_tokens 0" in stdout
    assert "matches the unsharded one on every rank" in stdout
