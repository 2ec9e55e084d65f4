"""The reverse-mode derivative of :func:`~jax_sparse_mla.sparse_mla` (docs/semantics.md, differentiation).

``api.py`` wraps the flattened op in a ``jax.custom_vjp``: its forward rule checks what is differentiated
(:func:`check_differentiable`) and keeps the operands, ``out`` and ``lse`` as residuals (:class:`Residuals`;
no attention weights: the backward recomputes them); its backward rule is :func:`vjp`:

- ``impl="xla"``: XLA's autodiff of the pure-JAX lowering, recomputed from the operands;
- the FFI kernels (``impl="auto"``): the C++ CPU backward kernel, and on CUDA the CUDA backward kernel
  (``_ffi.call_backward``, with its workspace), with a ``jax.vmap`` rule that folds the batch into rows as
  the forward's does.

Gradients exist for ``q`` (every format), ``attn_sink`` and the cache of a ``bf16_*`` format. A quantized
cache is a constant; integer operands (indices, lengths, ``valid_tokens``) have no gradient.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from . import _ffi, kernel_tables
from .formats import quantize_query_fp8

__all__ = ["Residuals", "check_differentiable", "typed_as_varying", "vjp", "without_second_derivative"]

# Operands with one row per query row, which the vmap rule folds (the caches and the sink are shared).
_ROW_OPERANDS = ("q", "indices", "topk_length", "extra_indices", "extra_topk_length")


@dataclasses.dataclass(frozen=True)
class Residuals:
    """What the forward rule keeps for the backward: the op's operands, its ``out`` and ``lse`` and (static)
    the names of the operands being differentiated."""

    arrays: dict
    out: jax.Array
    lse: jax.Array
    wrt: tuple


jax.tree_util.register_dataclass(Residuals, data_fields=["arrays", "out", "lse"], meta_fields=["wrt"])


def check_differentiable(problem, wrt) -> None:
    """Raises ``NotImplementedError`` naming the first operand in ``wrt`` that has no gradient."""
    for name, fmt in (("kv_cache", problem.fmt), ("extra_kv_cache", problem.extra_fmt)):
        if name in wrt and fmt.quantized:
            raise NotImplementedError(
                f"{name}: a {fmt.key} cache is quantized and has no gradient (only bf16_576 and bf16_512 caches "
                f"are differentiable); wrap it in jax.lax.stop_gradient, or pass its uint8 bytes")
    if "q" in wrt and problem.precision == "fp8":
        raise NotImplementedError(
            "precision: 'fp8' computes with the FP8-quantized query, whose derivative in q is zero almost "
            "everywhere, so q has no gradient there; differentiate q with precision='bf16' (the sink and a bf16 "
            "cache do have gradients with 'fp8')")


def vjp(problem, residuals: Residuals, d_out, d_lse, *, forward: Callable) -> dict:
    """The cotangents of the op's operands (None for every operand not in ``residuals.wrt``).

    Args:
      problem: the flattened call's :class:`~jax_sparse_mla.validate.Problem`.
      residuals: the forward rule's :class:`Residuals`.
      d_out: cotangent of ``out`` (bfloat16 ``[T, H, d_v]``) or a ``SymbolicZero``.
      d_lse: cotangent of ``lse`` (float32 ``[T, H]``) or a ``SymbolicZero``.
      forward: the op's lowering, ``arrays -> (out, lse)``; ``impl="xla"`` differentiates it.
    """
    d_out = None if isinstance(d_out, SymbolicZero) else d_out
    d_lse = None if isinstance(d_lse, SymbolicZero) else d_lse
    if d_out is None and d_lse is None:
        return {name: None for name in residuals.arrays}
    if problem.impl == "xla":
        gradients = _reference_vjp(forward, residuals.arrays, residuals.wrt, d_out, d_lse)
    else:
        arrays = residuals.arrays
        if problem.precision == "fp8":  # the query the forward computed with (q itself has no gradient then)
            arrays = dict(arrays, q=quantize_query_fp8(arrays["q"]))
        gradients = _kernel_vjp(problem, residuals.wrt, 1)(arrays, residuals.out, residuals.lse, d_out, d_lse)
        gradients = {name: (g if name == "q" else g[0]) for name, g in gradients.items()}  # the one group
    return {name: (_typed_like(gradients[name], x) if name in gradients else None)
            for name, x in residuals.arrays.items()}


def without_second_derivative(attend: Callable) -> Callable:
    """``attend`` for the forward rule: a second derivative would differentiate it (its lse feeds the
    backward), which raises a ``NotImplementedError`` saying so rather than JAX's error about the custom
    call inside."""

    @jax.custom_jvp
    def guarded(arrays):
        return attend(arrays)

    @guarded.defjvp
    def _no_second_derivative(primals, tangents):
        raise NotImplementedError("sparse_mla has no second derivative: differentiating jax.grad/jax.vjp of a "
                                  "function through sparse_mla (e.g. jax.hessian) is not supported")

    return guarded


def _axes(axes) -> tuple:
    return tuple(sorted(axes, key=str))


def _varying(x) -> frozenset:
    """The mesh axes ``x`` varies over inside ``jax.shard_map`` (none outside it)."""
    return jax.typeof(x).mat.varying


def _typed_like(gradient, primal):
    """The gradient with its primal's varying mesh axes (inside ``jax.shard_map``): summed over the axes the
    primal does not vary over (a replicated operand's gradient adds every shard's part), marked varying
    over those the primal varies over. Outside ``shard_map`` nothing varies and this is the identity."""
    have, want = _varying(gradient), _varying(primal)
    if extra := _axes(have - want):
        gradient = jax.lax.psum(gradient.astype(jnp.float32), extra).astype(gradient.dtype)
    if missing := _axes(want - have):
        gradient = jax.lax.pcast(gradient, missing, to="varying")
    return gradient


def _reference_vjp(forward, arrays, wrt, d_out, d_lse):
    def differentiated(wrt_arrays):
        return forward({**arrays, **wrt_arrays})

    (out, lse), pullback = jax.vjp(differentiated, {name: arrays[name] for name in wrt})
    (gradients,) = pullback((jnp.zeros_like(out) if d_out is None else d_out,
                             jnp.zeros_like(lse) if d_lse is None else d_lse))
    return gradients


def _kernel_vjp(problem, wrt, groups: int):
    """The kernel backward ``(arrays, out, lse, d_out, d_lse) -> {name: gradient}``, the shared operands'
    gradients with a leading axis of ``groups`` (one per ``T / groups`` consecutive rows), with a vmap rule
    that folds the batch into rows (one kernel call for the whole batch)."""

    @jax.custom_batching.custom_vmap
    def op(arrays, out, lse, d_out, d_lse):
        return _lower_kernel_backward(problem, wrt, groups, arrays, out, lse, d_out, d_lse)

    @op.def_vmap
    def _fold_batch(axis_size, in_batched, arrays, out, lse, d_out, d_lse):
        arrays_batched, out_batched, lse_batched, d_out_batched, d_lse_batched = in_batched
        batch, t = axis_size, problem.num_tokens
        rows = batch * t

        def fold(x, batched):
            if x is None:
                return None
            if not batched:
                x = jnp.broadcast_to(x, (batch, *x.shape))
            return x.reshape(rows, *x.shape[2:])

        # The caches and the sink are never batched here: the forward's vmap rule rejects that. valid_tokens
        # is left out: that rule gave the padding rows of every element lse = -inf, which the kernel skips.
        folded = {name: (fold(x, arrays_batched[name]) if name in _ROW_OPERANDS else x)
                  for name, x in arrays.items() if name != "valid_tokens"}
        inner = dataclasses.replace(problem, lead_shape=(rows,), num_tokens=rows)
        # Each element keeps its own gradients of the shared operands: a gradient group per element.
        gradients = _kernel_vjp(inner, wrt, batch * groups)(folded, fold(out, out_batched), fold(lse, lse_batched),
                                                            fold(d_out, d_out_batched), fold(d_lse, d_lse_batched))
        per_element = {name: g.reshape(batch, *((t, *g.shape[1:]) if name == "q" else (groups, *g.shape[1:])))
                       for name, g in gradients.items()}
        return per_element, {name: True for name in per_element}

    return op


def _lower_kernel_backward(problem, wrt, groups, arrays, out, lse, d_out, d_lse):
    kernel_wrt = tuple(name for name in ("q", "kv_cache", "attn_sink") if name in wrt)
    # The CUDA cache gradient's chunk of tokens, planned here (both handlers take it; the CPU one ignores it).
    chunk_tokens = kernel_tables.backward_chunk_tokens(problem.num_tokens, problem.num_heads, problem.topk,
                                                       problem.fmt.d_qk)

    def cpu(arrays, out, lse, d_out, d_lse):
        return _ffi.call_backward(problem, arrays, out, lse, d_out, d_lse, wrt=kernel_wrt, groups=groups,
                                  chunk_tokens=chunk_tokens)

    def cuda(arrays, out, lse, d_out, d_lse):
        layout = problem.layout
        workspace = kernel_tables.backward_workspace_bytes(
            problem.num_tokens, problem.num_heads, problem.topk, groups, layout.num_pages * layout.page_size,
            "kv_cache" in kernel_wrt, problem.fmt.d_qk, chunk_tokens)
        return _ffi.call_backward(problem, arrays, out, lse, d_out, d_lse, wrt=kernel_wrt, groups=groups,
                                  chunk_tokens=chunk_tokens, workspace_bytes=workspace)

    # Only the branch of the platform being lowered for is emitted: a CPU program never sees the CUDA one.
    gradients = jax.lax.platform_dependent(arrays, out, lse, d_out, d_lse, cpu=cpu, cuda=cuda)
    return typed_as_varying(gradients, (arrays, out, lse, d_out, d_lse))


def typed_as_varying(results, operands):
    """``results`` typed as varying over every mesh axis that some leaf of ``operands`` varies over.

    Inside ``jax.shard_map`` a custom call's results are typed as varying over no mesh axis, although
    they depend on operands that vary: typed so, ``jax.grad`` of the ``shard_map`` would treat them (the
    lse kept for the backward, too) as equal on every shard. Outside ``shard_map`` this is the identity.
    """
    varying = frozenset().union(*map(_varying, jax.tree_util.tree_leaves(operands)))

    def cast(x):
        missing = _axes(varying - _varying(x))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree_util.tree_map(cast, results)
