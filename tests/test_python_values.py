"""Operands given as Python numbers, lists or NumPy arrays where a JAX array is expected: accepted as the
documented dtype, or a TypeError that names the argument (never an AttributeError from inside)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sparse_mla as jsm

T, H, TOPK = 4, 2, 3
INDICES = [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, -1]]


@pytest.fixture(scope="module")
def operands():
    rng = np.random.default_rng(0)
    cache = jsm.quantize_kv(jnp.asarray(rng.standard_normal((64, 576), np.float32)), "dsv3_2", page_size=16)
    q = jnp.asarray(rng.standard_normal((T, H, 576)), jnp.bfloat16)
    return q, cache


def _op(q, cache, indices=INDICES, **kwargs):
    return jsm.sparse_mla(q, cache, indices, kv_format="dsv3_2", sm_scale=0.1, **kwargs)


def _assert_same(a, b):
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x.astype(jnp.float32)), np.asarray(y.astype(jnp.float32)))


@pytest.mark.parametrize("name,python,array", [
    ("valid_tokens", 2, jnp.int32(2)),
    ("valid_tokens", [3], jnp.array([3], jnp.int32)),
    ("topk_length", [1, 2, 3, 0], jnp.array([1, 2, 3, 0], jnp.int32)),
    ("topk_length", (3, 3, 3, 3), jnp.full((T,), 3, jnp.int32)),
    ("attn_sink", [0.5, -1], jnp.array([0.5, -1.0], jnp.float32)),
], ids=["valid_tokens_int", "valid_tokens_list", "topk_length_list", "topk_length_tuple", "attn_sink_list"])
def test_python_values_act_as_arrays_of_the_documented_dtype(operands, name, python, array):
    q, cache = operands
    _assert_same(_op(q, cache, **{name: python}), _op(q, cache, **{name: array}))


def test_python_and_numpy_indices(operands):
    q, cache = operands
    expected = _op(q, cache, jnp.array(INDICES, jnp.int32))
    _assert_same(_op(q, cache, INDICES), expected)
    _assert_same(_op(q, cache, np.array(INDICES, np.int32)), expected)
    _assert_same(jax.jit(lambda q, c: _op(q, c, INDICES, topk_length=[3, 3, 3, 2], valid_tokens=4))(q, cache),
                 _op(q, cache, INDICES, topk_length=jnp.array([3, 3, 3, 2], jnp.int32)))


def test_numpy_operands_keep_their_dtype_rule(operands):
    q, cache = operands
    with pytest.raises(TypeError, match=r"^indices: expected int32 .* got int64 \[4, 3\]"):
        _op(q, cache, np.array(INDICES, np.int64))
    with pytest.raises(TypeError, match="^valid_tokens: expected int32"):
        _op(q, cache, np.array(INDICES, np.int32), valid_tokens=np.int64(2))


@pytest.mark.parametrize("kwargs,error,match", [
    ({"valid_tokens": 2.0}, TypeError, "^valid_tokens: expected Python integers"),
    ({"valid_tokens": True}, TypeError, "^valid_tokens: expected an array, a Python number"),
    ({"valid_tokens": "2"}, TypeError, "^valid_tokens: expected an array, a Python number"),
    ({"valid_tokens": 2 ** 40}, ValueError, "^valid_tokens: expected int32 values"),
    ({"topk_length": [1, 2, [3], 4]}, TypeError, "^topk_length: expected a rectangular list"),
    ({"topk_length": [1, 2, 3]}, ValueError, r"^topk_length: expected int32 \[T\] with T=4"),
    ({"attn_sink": ["a", "b"]}, TypeError, "^attn_sink: expected Python numbers"),
    ({"indices": [[0.5, 1, 2]] * T}, TypeError, "^indices: expected Python integers"),
], ids=["float_count", "bool_count", "str_count", "int64_count", "ragged", "short", "str_sink", "float_indices"])
def test_bad_python_values_name_the_argument(operands, kwargs, error, match):
    q, cache = operands
    indices = kwargs.pop("indices", INDICES)
    with pytest.raises(error, match=match):
        _op(q, cache, indices, **kwargs)


@pytest.mark.parametrize("name", ["q", "kv_cache"])
def test_lists_for_q_or_the_cache_are_a_type_error(operands, name):
    q, cache = operands
    args = {"q": q, "kv_cache": cache}
    args[name] = np.asarray(args[name]).tolist()
    with pytest.raises(TypeError, match=f"^{name}: expected an array, got list"):
        jsm.sparse_mla(args["q"], args["kv_cache"], INDICES, kv_format="dsv3_2", sm_scale=0.1)


def test_merge_attention_states_names_a_non_array_argument():
    out = jnp.zeros((2, 3, 8), jnp.bfloat16)
    lse = jnp.zeros((2, 3), jnp.float32)
    with pytest.raises(TypeError, match="^lse_b: expected an array, got list"):
        jsm.merge_attention_states(out, lse, out, [[0.0] * 3] * 2)
    merged, _ = jsm.merge_attention_states(np.asarray(out), np.asarray(lse), out, lse)
    assert merged.shape == out.shape
