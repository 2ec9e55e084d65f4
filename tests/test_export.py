"""``jax.export`` of programs that call ``sparse_mla`` (docs/sharding_and_export.md): round trips, T = 0,
other platforms."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sparse_mla as jsm
from jax_sparse_mla import _ffi, planner, validate
from jax_sparse_mla.export import disabled_checks, export

STATIC = dict(kv_format="dsv3_2", sm_scale=576 ** -0.5)
NO_SERIALIZER = "jax.export serialisation needs the 'flatbuffers' package (pip install flatbuffers)"


def _inputs(num_tokens=5, num_heads=4, topk=12, page_size=4, num_pages=6, seed=0):
    rng = np.random.default_rng(seed)
    kv = jnp.asarray(rng.standard_normal((num_pages * page_size, 576)), jnp.float32)
    cache = jsm.quantize_kv(kv, "dsv3_2", page_size=page_size)
    q = jnp.asarray(rng.standard_normal((num_tokens, num_heads, 576)), jnp.bfloat16)
    indices = jnp.asarray(rng.integers(-2, num_pages * page_size + 2, (num_tokens, topk)), jnp.int32)
    topk_length = jnp.asarray(rng.integers(0, topk + 1, num_tokens), jnp.int32)
    attn_sink = jnp.asarray(rng.standard_normal(num_heads), jnp.float32)
    return q, cache, indices, topk_length, attn_sink


def attention(q, kv_cache, indices, topk_length, attn_sink):
    valid_tokens = jnp.int32(max(q.shape[0] - 1, 0))
    return jsm.sparse_mla(q, kv_cache, indices, topk_length=topk_length, attn_sink=attn_sink,
                          valid_tokens=valid_tokens, **STATIC)


def _assert_bitwise(got, want):
    for x, y in zip(got, want):
        x, y = np.asarray(x), np.asarray(y)
        assert x.shape == y.shape and x.dtype == y.dtype
        np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8))


def _variants(exported) -> list:
    """The ``variant`` plan attribute of every sparse_mla custom call in the exported module."""
    return [int(v) for v in re.findall(r"variant = (\d+) : i32", exported.mlir_module())]


def test_disabled_checks_cover_every_registered_target():
    checks = disabled_checks()
    assert checks == [jax.export.DisabledSafetyCheck.custom_call(t) for t in (_ffi.TARGET, _ffi.BACKWARD_TARGET)]
    assert set(_ffi._cpu_ext.registrations()) == {_ffi.TARGET, _ffi.BACKWARD_TARGET}


def test_export_without_disabled_checks_fails_clearly():
    with pytest.raises(ValueError, match="custom calls whose targets have no compatibility guarantees") as error:
        jax.export.export(jax.jit(attention))(*_inputs())
    assert _ffi.TARGET in str(error.value)


def test_round_trip_matches_direct_call():
    pytest.importorskip("flatbuffers", reason=NO_SERIALIZER)
    args = _inputs()
    exported = jax.export.export(jax.jit(attention), disabled_checks=disabled_checks())(*args)
    assert exported.platforms == ("cpu",)
    restored = jax.export.deserialize(exported.serialize())
    _assert_bitwise(restored.call(*args), jax.jit(attention)(*args))
    out, lse = restored.call(*args)
    assert not np.asarray(out[-1]).astype(np.float32).any() and np.all(np.asarray(lse[-1]) == -np.inf)


def test_export_helper_keeps_static_arguments_of_a_jitted_function():
    pytest.importorskip("flatbuffers", reason=NO_SERIALIZER)
    args = _inputs(seed=1)

    @jax.jit
    def scaled(q, kv_cache, indices):
        return jsm.sparse_mla(q, kv_cache, indices, kv_format="dsv3_2", sm_scale=0.03)

    restored = jax.export.deserialize(export(scaled, *args[:3]).serialize())
    _assert_bitwise(restored.call(*args[:3]), scaled(*args[:3]))
    plain = export(lambda q, c, i: jsm.sparse_mla(q, c, i, kv_format="dsv3_2", sm_scale=0.03), *args[:3])
    _assert_bitwise(plain.call(*args[:3]), scaled(*args[:3]))


def test_zero_tokens_export():
    pytest.importorskip("flatbuffers", reason=NO_SERIALIZER)
    q, cache, indices, topk_length, attn_sink = _inputs(num_tokens=0)
    exported = export(attention, q, cache, indices, topk_length, attn_sink)
    out, lse = jax.export.deserialize(exported.serialize()).call(q, cache, indices, topk_length, attn_sink)
    assert out.shape == (0, 4, 512) and out.dtype == jnp.bfloat16
    assert lse.shape == (0, 4) and lse.dtype == jnp.float32


def test_export_for_cpu_and_cuda_runs_on_cpu():
    """A two-platform program exported here runs its CPU branch here, identically to the direct call."""
    pytest.importorskip("flatbuffers", reason=NO_SERIALIZER)
    args = _inputs(seed=2)
    exported = export(attention, *args, platforms=("cpu", "cuda"))
    assert exported.platforms == ("cpu", "cuda")
    _assert_bitwise(jax.export.deserialize(exported.serialize()).call(*args), jax.jit(attention)(*args))


def test_export_for_cuda_from_a_cpu_host_bakes_a_cuda_plan():
    """Exporting for CUDA needs no GPU and no CUDA extension: the CUDA branch is only emitted, never run,
    and is planned for the planner's default CUDA device."""
    args = _inputs(seed=3)
    exported = export(attention, *args, platforms=("cuda",))
    assert exported.platforms == ("cuda",)
    assert f"stablehlo.custom_call @{_ffi.TARGET}" in exported.mlir_module()
    cuda_variants = {planner.VARIANT_IDS["decode"], planner.VARIANT_IDS["prefill"]}
    assert _variants(exported) and set(_variants(exported)) <= cuda_variants, _variants(exported)
    both = export(attention, *args, platforms=("cpu", "cuda"))
    assert sorted(_variants(both))[0] == planner.VARIANT_IDS["reference"]
    assert set(sorted(_variants(both))[1:]) <= cuda_variants


def test_cuda_only_export_refuses_to_run_on_cpu():
    args = _inputs(seed=4)
    exported = export(attention, *args, platforms=("cuda",))
    with pytest.raises(ValueError, match="cuda"):
        exported.call(*args)


def test_handler_rechecks_a_plan_baked_for_another_platform():
    """What the export docs promise: a plan that does not fit the device that runs it is an error from
    the handler, not a launch (here a CUDA plan reaching the CPU handler)."""
    q, cache, indices, _, _ = _inputs(seed=5)
    problem = validate.normalize(q, cache, indices, **STATIC)
    cuda_plan = planner.plan(q.shape, "dsv3_2", problem.topk, platform="cuda", device=planner.DEFAULT_CUDA_DEVICE)
    call = jax.jit(lambda q, c, i: _ffi.call(cuda_plan, problem, q, c, i, None, None, None, None, None,
                                             jnp.int32(q.shape[0])))
    with pytest.raises(jax.errors.JaxRuntimeError, match="variant"):
        jax.block_until_ready(call(q, cache, indices))
