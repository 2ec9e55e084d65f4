"""Sharding helpers (docs/sharding_and_export.md): values equal the unsharded op bit for bit, no collective
touches the cache.

The multi-device checks need 8 host CPU devices, which must be forced before JAX starts its backend; other
test files start it first in the pytest process, so this file runs itself as a script in a subprocess
(``XLA_FLAGS=--xla_force_host_platform_device_count=8``) and each test asserts on one of its results. The
CPU kernel (and the pure-JAX lowering) computes every (token, head) row on its own, so sharding cannot
change a bit of the result and the comparisons are exact.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_sparse_mla as jsm
from jax_sparse_mla.sharding import SparseMLASpecs, sharded_sparse_mla, sparse_mla_specs
from multi_device import Skip, child_main, run_checks

NUM_DEVICES = 8
COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")


# --------------------------------------------------------------------------------------------------
# Multi-device checks (run in the subprocess)
# --------------------------------------------------------------------------------------------------

def _cache(rng, kv_format, num_pages, page_size):
    d_qk = jsm.get_format(kv_format).d_qk
    kv = rng.standard_normal((num_pages * page_size, d_qk)).astype(np.float32)
    return np.asarray(jsm.quantize_kv(jnp.asarray(kv), kv_format, page_size=page_size))


def _q(rng, shape):
    return np.asarray(jnp.asarray(rng.standard_normal(shape), jnp.bfloat16))


def _local_indices(rng, shape, num_slots):
    """Indices into one cache of ``num_slots``: mostly valid, some -1, negative or past the end."""
    return rng.integers(-3, num_slots + 3, shape).astype(np.int32)


def _globalize(local, rows_per_rank, slots_per_rank):
    """Per-rank indices → indices into the concatenated cache (a local miss must stay a miss)."""
    rank = (np.arange(local.shape[0]) // rows_per_rank).reshape(-1, *([1] * (local.ndim - 1)))
    valid = (local >= 0) & (local < slots_per_rank)
    return np.where(valid, local + rank * slots_per_rank, -1).astype(np.int32)


def _row_mask(valid_tokens, num_rows):
    """True for flattened rows below their own shard's count."""
    valid_tokens = np.asarray(valid_tokens)
    rows_per_shard = num_rows // valid_tokens.size
    row = np.arange(num_rows)
    return row % rows_per_shard < valid_tokens[row // rows_per_shard]


def _masked(out, lse, mask):
    out, lse = np.asarray(out), np.asarray(lse)
    lead = out.shape[:-2]
    mask = mask.reshape(lead)
    return (np.where(mask[..., None, None], out, np.zeros((), out.dtype)),
            np.where(mask[..., None], lse, np.float32(-np.inf)))


def _assert_bitwise(got, want):
    (out, lse), (ref_out, ref_lse) = got, want
    out, lse = np.asarray(out), np.asarray(lse)
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape, (out.shape, ref_out.shape)
    assert out.dtype == ref_out.dtype and lse.dtype == ref_lse.dtype
    np.testing.assert_array_equal(out.view(np.uint16), np.asarray(ref_out).view(np.uint16))
    np.testing.assert_array_equal(lse.view(np.uint32), np.asarray(ref_lse).view(np.uint32))


def _placed(mesh, specs: SparseMLASpecs, arrays: dict) -> dict:
    return {k: jax.device_put(v, NamedSharding(mesh, getattr(specs, k))) for k, v in arrays.items()}


def _run_sharded(mesh, fn, specs, q, kv_cache, indices, **kwargs):
    """Runs ``fn`` jitted on operands laid out by ``specs``; returns the result and the compiled HLO."""
    arrays = _placed(mesh, specs, dict(q=q, kv_cache=kv_cache, indices=indices, **kwargs))
    jitted = jax.jit(lambda a: fn(a.pop("q"), a.pop("kv_cache"), a.pop("indices"), **a))
    hlo = jitted.lower(arrays).compile().as_text()
    return jitted(arrays), hlo


def _assert_local(hlo, local_cache_shape=None, custom_call=True):
    found = [c for c in COLLECTIVES if c in hlo]
    assert not found, f"collectives in the sharded program: {found}"
    assert (jsm._ffi.TARGET in hlo) == custom_call
    if local_cache_shape is not None:
        assert f"u8[{','.join(map(str, local_cache_shape))}]" in hlo, "the kernel does not see the local cache"


def _check_tensor_parallel():
    """Heads (and the sink) split over 8 devices; cache, indices and lengths replicated."""
    rng = np.random.default_rng(1)
    mesh = jax.make_mesh((NUM_DEVICES,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,))
    t, h, topk, page_size, num_pages = 5, 16, 24, 4, 6
    cache = _cache(rng, "dsv3_2", num_pages, page_size)
    q = _q(rng, (t, h, 576))
    indices = _local_indices(rng, (t, topk), num_pages * page_size)
    kwargs = dict(topk_length=rng.integers(0, topk + 1, t).astype(np.int32),
                  attn_sink=rng.standard_normal(h).astype(np.float32), valid_tokens=np.int32(4))
    static = dict(kv_format="dsv3_2", sm_scale=576 ** -0.5)
    fn = sharded_sparse_mla(mesh, head_axis="tp", **static)
    got, hlo = _run_sharded(mesh, fn, sparse_mla_specs(head_axis="tp"), q, cache, indices, **kwargs)
    want = jsm.sparse_mla(jnp.asarray(q), jnp.asarray(cache), jnp.asarray(indices), **static,
                          **{k: jnp.asarray(v) for k, v in kwargs.items()})
    _assert_bitwise(got, want)
    _assert_local(hlo)
    assert got[0].sharding.spec == P(None, "tp")


def _check_data_parallel(impl):
    """Tokens and per-rank dual caches (dsv4) split over 8 devices, empty shards included."""
    rng = np.random.default_rng(2)
    mesh = jax.make_mesh((NUM_DEVICES,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,))
    rows, h, topk, extra_topk = 3, 4, 16, 6
    t = rows * NUM_DEVICES
    pages, page_size, extra_pages, extra_page_size = 2, 2, 3, 4
    cache = _cache(rng, "dsv4", pages * NUM_DEVICES, page_size)
    extra_cache = _cache(rng, "dsv4", extra_pages * NUM_DEVICES, extra_page_size)
    q = _q(rng, (t, h, 512))
    indices = _local_indices(rng, (t, topk), pages * page_size)
    extra_indices = _local_indices(rng, (t, extra_topk), extra_pages * extra_page_size)
    valid_tokens = np.array([3, 0, 1, 2, 0, 3, 3, 1], np.int32)  # shards 1 and 4 are empty
    lengths = dict(topk_length=rng.integers(0, topk + 1, t).astype(np.int32),
                   extra_topk_length=rng.integers(0, extra_topk + 1, t).astype(np.int32))
    static = dict(kv_format="dsv4", sm_scale=512 ** -0.5, impl=impl)
    fn = sharded_sparse_mla(mesh, token_axis="ep", **static)
    got, hlo = _run_sharded(mesh, fn, sparse_mla_specs(token_axis="ep"), q, cache, indices,
                            extra_kv_cache=extra_cache, extra_indices=extra_indices, valid_tokens=valid_tokens,
                            **lengths)
    full = jsm.sparse_mla(
        jnp.asarray(q), jnp.asarray(cache), jnp.asarray(_globalize(indices, rows, pages * page_size)), **static,
        extra_kv_cache=jnp.asarray(extra_cache),
        extra_indices=jnp.asarray(_globalize(extra_indices, rows, extra_pages * extra_page_size)),
        **{k: jnp.asarray(v) for k, v in lengths.items()})
    want = _masked(*full, _row_mask(valid_tokens, t))
    _assert_bitwise(got, want)
    _assert_local(hlo, local_cache_shape=(pages, page_size, 584), custom_call=impl != "xla")
    out, lse = (np.asarray(x) for x in got)
    empty = slice(rows, 2 * rows)  # shard 1
    assert not out[empty].astype(np.float32).any() and np.all(lse[empty] == -np.inf)
    assert np.isfinite(lse[:rows]).any(), "a non-empty shard gave no finite lse: the test data is degenerate"


def _check_data_parallel_replicated_cache():
    """per_rank_cache=False: tokens split, one replicated cache addressed by global indices."""
    rng = np.random.default_rng(3)
    mesh = jax.make_mesh((NUM_DEVICES,), ("dp",), axis_types=(jax.sharding.AxisType.Auto,))
    t, h, topk, page_size, num_pages = 16, 2, 8, 16, 3
    cache = _cache(rng, "glm53_nope", num_pages, page_size)
    q = _q(rng, (t, h, 512))
    indices = _local_indices(rng, (t, topk), num_pages * page_size)
    static = dict(kv_format="glm53_nope", sm_scale=0.05)
    fn = sharded_sparse_mla(mesh, token_axis="dp", per_rank_cache=False, **static)
    got, hlo = _run_sharded(mesh, fn, sparse_mla_specs(token_axis="dp", per_rank_cache=False), q, cache, indices)
    _assert_bitwise(got, jsm.sparse_mla(jnp.asarray(q), jnp.asarray(cache), jnp.asarray(indices), **static))
    _assert_local(hlo)


def _both_case(rng, batch):
    """q [B, S, H, d] over a 4 x 2 (dp, tp) mesh; a 2-D cache with page_size=; sink; an empty shard."""
    seq, h, topk, page_size, pages = 3, 8, 20, 4, 2
    page_bytes = page_size * 656 + 32
    cache = _cache(rng, "dsv3_2", pages * 4, page_size).reshape(pages * 4, page_size * 656)
    cache = np.pad(cache, ((0, 0), (0, page_bytes - cache.shape[1])), constant_values=0xFF)
    return dict(
        q=_q(rng, (batch, seq, h, 576)), kv_cache=cache,
        indices=_local_indices(rng, (batch, seq, topk), pages * page_size),
        topk_length=rng.integers(0, topk + 1, (batch, seq)).astype(np.int32),
        attn_sink=rng.standard_normal(h).astype(np.float32),
        valid_tokens=np.array([3, 0, 2, 1], np.int32) * (batch // 4),
    ), dict(kv_format="dsv3_2", sm_scale=0.07, page_size=page_size), pages * page_size


def _check_both(axis_type):
    """Tokens over ``dp`` (4) and heads over ``tp`` (2) at once, on an Auto or Explicit mesh."""
    rng = np.random.default_rng(4)
    mesh = jax.make_mesh((4, 2), ("dp", "tp"), axis_types=(axis_type, axis_type))
    batch = 8
    arrays, static, slots_per_rank = _both_case(rng, batch)
    fn = sharded_sparse_mla(mesh, token_axis="dp", head_axis="tp", **static)
    specs = sparse_mla_specs(token_axis="dp", head_axis="tp", lead_dims=2)
    got, hlo = _run_sharded(mesh, fn, specs, **arrays)
    full = jsm.sparse_mla(
        jnp.asarray(arrays["q"]), jnp.asarray(arrays["kv_cache"]),
        jnp.asarray(_globalize(arrays["indices"], batch // 4, slots_per_rank)), **static,
        topk_length=jnp.asarray(arrays["topk_length"]), attn_sink=jnp.asarray(arrays["attn_sink"]))
    seq = arrays["q"].shape[1]
    _assert_bitwise(got, _masked(*full, _row_mask(arrays["valid_tokens"], batch * seq)))
    _assert_local(hlo)
    out, lse = (np.asarray(x) for x in got)
    assert not out[2:4].astype(np.float32).any() and np.all(lse[2:4] == -np.inf)  # shard 1 is empty


def _check_zero_tokens():
    """A global T of 0 under both patterns gives empty results."""
    rng = np.random.default_rng(5)
    mesh = jax.make_mesh((4, 2), ("dp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    arrays, static, _ = _both_case(rng, 4)
    arrays = {k: (v[:0] if k in ("q", "indices", "topk_length") else v) for k, v in arrays.items()}
    arrays["q"] = arrays["q"].reshape(0, *arrays["q"].shape[2:])
    arrays["indices"] = arrays["indices"].reshape(0, arrays["indices"].shape[-1])
    arrays["topk_length"] = arrays["topk_length"].reshape(0)
    arrays["valid_tokens"] = np.zeros(4, np.int32)
    fn = sharded_sparse_mla(mesh, token_axis="dp", head_axis="tp", **static)
    (out, lse), hlo = _run_sharded(mesh, fn, sparse_mla_specs(token_axis="dp", head_axis="tp"), **arrays)
    assert out.shape == (0, 8, 512) and out.dtype == jnp.bfloat16
    assert lse.shape == (0, 8) and lse.dtype == jnp.float32
    assert not [c for c in COLLECTIVES if c in hlo]


def _check_unsharded_call_gathers():
    """The cost note of the docs: sparse_mla on sharded global arrays, outside shard_map, gathers them."""
    rng = np.random.default_rng(6)
    mesh = jax.make_mesh((NUM_DEVICES,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,))
    cache = _cache(rng, "dsv3_2", NUM_DEVICES, 4)
    q, indices = _q(rng, (NUM_DEVICES, 2, 576)), _local_indices(rng, (NUM_DEVICES, 4), 4 * NUM_DEVICES)
    placed = [jax.device_put(x, NamedSharding(mesh, P("ep"))) for x in (q, cache, indices)]
    fn = jax.jit(lambda q, c, i: jsm.sparse_mla(q, c, i, kv_format="dsv3_2", sm_scale=0.1))
    assert "all-gather" in fn.lower(*placed).compile().as_text()


def _check_export_sharded():
    """A jitted sharded program exports with its shardings; the deserialised one gives the same bits."""
    try:
        import flatbuffers  # noqa: F401  (jax.export serialisation needs it)
    except ImportError:
        raise Skip("jax.export serialisation needs the 'flatbuffers' package (pip install flatbuffers)")
    from jax_sparse_mla.export import export

    rng = np.random.default_rng(8)
    mesh = jax.make_mesh((4, 2), ("dp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    arrays, static, _ = _both_case(rng, 4)
    specs = sparse_mla_specs(token_axis="dp", head_axis="tp", lead_dims=2)
    names = ("q", "kv_cache", "indices", "topk_length", "attn_sink", "valid_tokens")
    placed = [jax.device_put(arrays[k], NamedSharding(mesh, getattr(specs, k))) for k in names]
    attend = sharded_sparse_mla(mesh, token_axis="dp", head_axis="tp", **static)

    def step(q, kv_cache, indices, topk_length, attn_sink, valid_tokens):
        return attend(q, kv_cache, indices, topk_length=topk_length, attn_sink=attn_sink, valid_tokens=valid_tokens)

    restored = jax.export.deserialize(export(step, *placed).serialize())
    assert restored.nr_devices == NUM_DEVICES
    got = restored.call(*placed)
    _assert_bitwise(got, tuple(np.asarray(x) for x in jax.jit(step)(*placed)))
    assert got[0].sharding.spec == specs.out


CHECKS = {
    "tensor_parallel": _check_tensor_parallel,
    "data_parallel": lambda: _check_data_parallel("auto"),
    "data_parallel_xla": lambda: _check_data_parallel("xla"),
    "data_parallel_replicated_cache": _check_data_parallel_replicated_cache,
    "both_auto_mesh": lambda: _check_both(jax.sharding.AxisType.Auto),
    "both_explicit_mesh": lambda: _check_both(jax.sharding.AxisType.Explicit),
    "zero_tokens": _check_zero_tokens,
    "unsharded_call_gathers": _check_unsharded_call_gathers,
    "export_sharded": _check_export_sharded,
}


# --------------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def multi_device_results(tmp_path_factory):
    """Runs the checks above once, in a subprocess with 8 forced CPU devices."""
    return run_checks(__file__, tmp_path_factory.mktemp("sharding") / "results.json", NUM_DEVICES)


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_multi_device(multi_device_results, name):
    result = multi_device_results[name]
    if result.startswith("skip: "):
        pytest.skip(result[len("skip: "):])
    assert result == "ok", result


def test_specs():
    specs = sparse_mla_specs(token_axis="dp", head_axis="tp")
    assert specs.q == specs.out == specs.lse == P("dp", "tp")
    assert specs.kv_cache == specs.extra_kv_cache == specs.indices == specs.valid_tokens == P("dp")
    assert specs.attn_sink == P("tp")
    batched = sparse_mla_specs(token_axis=("dp", "ep"), head_axis="tp", lead_dims=2)
    assert batched.q == P(("dp", "ep"), None, "tp")
    tensor_parallel = sparse_mla_specs(head_axis="tp")
    assert tensor_parallel.q == P(None, "tp") and tensor_parallel.kv_cache == P() == tensor_parallel.valid_tokens
    assert sparse_mla_specs(token_axis="dp", per_rank_cache=False).kv_cache == P()
    with pytest.raises(ValueError, match="lead_dims"):
        sparse_mla_specs(token_axis="dp", lead_dims=3)


def test_single_device_mesh_runs_in_process():
    """The helper on the pytest process's own devices (one shard): same values as the direct call."""
    rng = np.random.default_rng(7)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("ep",))
    cache, q = _cache(rng, "dsv3_2", 2, 4), _q(rng, (3, 2, 576))
    indices = _local_indices(rng, (3, 8), 8)
    static = dict(kv_format="dsv3_2", sm_scale=0.1)
    fn = jax.jit(sharded_sparse_mla(mesh, token_axis="ep", **static))
    got = fn(q, cache, indices, valid_tokens=np.array([2], np.int32))
    full = jsm.sparse_mla(jnp.asarray(q), jnp.asarray(cache), jnp.asarray(indices), **static,
                          valid_tokens=jnp.int32(2))
    _assert_bitwise(got, tuple(np.asarray(x) for x in full))


MESH = AbstractMesh((4, 2), ("dp", "tp"))
SHAPES = dict(q=((8, 4, 576), jnp.bfloat16), kv_cache=((8, 4, 656), jnp.uint8), indices=((8, 16), jnp.int32))


def _abstract(**overrides):
    shapes = dict(SHAPES, **overrides)
    return {k: jax.ShapeDtypeStruct(*v) for k, v in shapes.items()}


@pytest.mark.parametrize("overrides, kwargs, message", [
    (dict(q=((6, 4, 576), jnp.bfloat16), indices=((6, 16), jnp.int32)), {}, r"^q: the token axis .* 4 shards"),
    (dict(indices=((6, 16), jnp.int32)), {}, r"^indices: the token axis"),
    (dict(q=((8, 3, 576), jnp.bfloat16)), {}, r"^q: the head axis \(dim 1\).* 2 shards of mesh axis 'tp', got 3"),
    (dict(kv_cache=((6, 4, 656), jnp.uint8)), {}, r"^kv_cache: the page axis"),
    ({}, dict(topk_length=((6,), jnp.int32)), r"^topk_length: the token axis"),
    ({}, dict(attn_sink=((3,), jnp.float32)), r"^attn_sink: the head axis"),
    ({}, dict(valid_tokens=((1,), jnp.int32)), r"^valid_tokens: expected int32 \[4\]"),
    ({}, dict(valid_tokens=((), jnp.int32)), r"^valid_tokens: expected int32 \[4\]"),
])
def test_divisibility_errors(overrides, kwargs, message):
    fn = sharded_sparse_mla(MESH, token_axis="dp", head_axis="tp", kv_format="dsv3_2", sm_scale=0.1)
    arrays = _abstract(**overrides)
    extra = {k: jax.ShapeDtypeStruct(*v) for k, v in kwargs.items()}
    with pytest.raises(ValueError, match=message):
        fn(arrays["q"], arrays["kv_cache"], arrays["indices"], **extra)


def test_valid_tokens_dtype_error():
    fn = sharded_sparse_mla(MESH, token_axis="dp", kv_format="dsv3_2", sm_scale=0.1)
    arrays = _abstract()
    with pytest.raises(TypeError, match=r"^valid_tokens: expected int32 \[4\]"):
        fn(arrays["q"], arrays["kv_cache"], arrays["indices"], valid_tokens=jax.ShapeDtypeStruct((4,), jnp.int64))


@pytest.mark.parametrize("kwargs, message", [
    (dict(), "expected at least one mesh axis"),
    (dict(token_axis="x"), r"token_axis: expected axes of the mesh \('dp', 'tp'\), got 'x'"),
    (dict(head_axis="x"), "head_axis: expected axes of the mesh"),
    (dict(token_axis="dp", head_axis="dp"), "each mesh axis may appear once"),
    (dict(token_axis=("dp", "dp")), "each mesh axis may appear once"),
])
def test_axis_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        sharded_sparse_mla(MESH, kv_format="dsv3_2", sm_scale=0.1, **kwargs)


if __name__ == "__main__":
    child_main(CHECKS, sys.argv[1], NUM_DEVICES)
