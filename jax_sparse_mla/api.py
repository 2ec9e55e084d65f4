"""The public operations: :func:`sparse_mla` and :func:`merge_attention_states`."""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import jax
import jax.numpy as jnp

from . import _ffi, backward, planner, validate
from .formats import KVFormat, bf16_rows, cache_layout, get_format, quantize_query_fp8
from .reference import sparse_mla_reference

__all__ = ["sparse_mla", "merge_attention_states"]

# Operand names of the flattened op, in order; absent optional operands are left out of the dict.
_OPERANDS = ("q", "kv_cache", "indices", "topk_length", "attn_sink", "extra_kv_cache", "extra_indices",
             "extra_topk_length", "valid_tokens")
#: The platforms whose kernels read a main and an extra cache of two formats in one call (the CPU kernel);
#: elsewhere such a call is one kernel call per cache, merged (_merged_lists).
_JOINT_TWO_FORMAT_PLATFORMS = frozenset({"cpu"})


def sparse_mla(q, kv_cache, indices, *, kv_format: Union[str, KVFormat], sm_scale: float,
               page_size: Optional[int] = None, topk_length=None, attn_sink=None, extra_kv_cache=None,
               extra_indices=None, extra_topk_length=None, extra_page_size: Optional[int] = None,
               valid_tokens=None, impl: str = "auto", batch_invariant: bool = False, precision: str = "bf16",
               extra_kv_format: Union[str, KVFormat, None] = None):
    """Token-sparse MLA attention over a paged (FP8) KV cache.

    Each query row ``t`` attends to the cache slots listed in ``indices[t]``; invalid candidates
    (out of range, negative, past ``topk_length[t]``, past the format's window) are masked and never
    read. The softmax is joint over the main and (for the dual-cache formats) the extra cache. The
    semantics, edge cases and accuracy contract are in docs/semantics.md.

    Array arguments are JAX arrays, NumPy arrays (their dtype is checked as given) or, under tracing,
    tracers; ``indices``, ``topk_length``, ``attn_sink``, the extra index arguments and ``valid_tokens``
    also take Python numbers and nested lists, which become arrays of the documented dtype.

    Args:
      q: bfloat16 ``[T, H, d_qk]`` or ``[B, S, H, d_qk]``; 1 <= H <= 128.
      kv_cache: a cache of ``kv_format`` in any accepted shape (docs/formats.md, cache shapes):
        uint8/int8/float8_e4m3fn bytes, or bfloat16 for ``bf16_*``.
      indices: int32 ``[T, topk]``, ``[T, 1, topk]`` or ``[B, S, topk]``: global slots
        (``page * page_size + offset``).
      kv_format: format key (see :data:`jax_sparse_mla.FORMATS`) or :class:`KVFormat`.
      sm_scale: static softmax scale applied to ``q·k``.
      page_size: tokens per page; required only for the 2-D ``[num_pages, page_bytes]`` form.
      topk_length: int32 ``[T]``/``[B, S]``: only the first ``topk_length[t]`` entries of row t are used.
      attn_sink: float32 ``[H]``: one extra logit per head whose value vector is zero.
      extra_kv_cache: the dual cache (``dsv4``, ``dsv4_1``, ``dsv4_nvfp4``, ``dsv4_1_fp4``): a cache of
        ``extra_kv_format`` with its own shape and page size; given together with ``extra_indices``.
      extra_indices: int32 ``[T, extra_topk]`` (same forms as ``indices``): slots of the extra cache.
      extra_topk_length: int32 ``[T]``/``[B, S]``: like ``topk_length``, for ``extra_indices``.
      extra_page_size: the extra cache's page size, for its 2-D form.
      valid_tokens: int32 scalar or ``[1]``: rows ``t >= valid_tokens`` (of the flattened rows) are padding:
        ``out = 0``, ``lse = -inf``, skipped on the device.
      impl: ``"auto"`` (planner), ``"decode"``/``"prefill"`` (force a CUDA variant) or ``"xla"`` (pure JAX).
      batch_invariant: pin the candidate chunking and combine order so a row's output does not depend
        on T (the batch it is in); see :func:`jax_sparse_mla.plan`.
      precision: ``"bf16"`` (16-bit tensor-core compute) or ``"fp8"``: the operation on the query
        quantized to FP8 per group of 64 lanes (:func:`jax_sparse_mla.quantize_query_fp8`), with its own
        accuracy bound (docs/semantics.md). ``"fp8"`` runs on the CPU kernel and ``impl="xla"``; on a
        GPU backend without an FP8 kernel it raises ``ValueError`` (never a silent 16-bit fallback).
      extra_kv_format: the extra cache's format (default: ``kv_format``); the allowed pairs are each
        dual-cache format with itself, ``("dsv4", "dsv4_nvfp4")`` and ``("dsv4_1", "dsv4_1_fp4")``
        (``supported_configs()[key]["extra_formats"]``). The CUDA kernels run a pair of two formats as
        one call per cache, merged by their lse with the sink (the CPU kernel reads both in one call).

    Returns:
      ``(out, lse)``: bfloat16 ``[..., H, d_v]`` and float32 ``[..., H]`` (natural log, sink included).

    Raises:
      TypeError: wrong dtypes, or a Python value where an array is needed (docs/errors.md).
      ValueError: anything else that shapes reveal (docs/errors.md).
      NotImplementedError: differentiated with respect to a quantized cache (only ``bf16_*`` caches have
        a gradient) or, with ``precision="fp8"``, ``q``; or twice (no second derivative).

    ``jax.grad``/``jax.vjp`` give gradients for ``q``, ``attn_sink`` and a ``bf16_*`` cache (docs/semantics.md,
    differentiation); forward mode (``jax.jvp``) raises JAX's ``TypeError`` for ``custom_vjp`` functions.

    Under ``jax.vmap`` the batch folds into rows (caches must not be batched). Calling this on arrays
    sharded across devices outside ``shard_map`` makes XLA gather the operands; shard per device instead.
    """
    (q, kv_cache, indices, topk_length, attn_sink, extra_kv_cache, extra_indices, extra_topk_length,
     valid_tokens) = (validate.as_operand(name, value) for name, value in zip(_OPERANDS, (
         q, kv_cache, indices, topk_length, attn_sink, extra_kv_cache, extra_indices, extra_topk_length,
         valid_tokens)))
    problem = validate.normalize(
        q, kv_cache, indices, kv_format=kv_format, sm_scale=sm_scale, page_size=page_size,
        topk_length=topk_length, attn_sink=attn_sink, extra_kv_cache=extra_kv_cache, extra_indices=extra_indices,
        extra_topk_length=extra_topk_length, extra_page_size=extra_page_size, valid_tokens=valid_tokens, impl=impl,
        batch_invariant=batch_invariant, precision=precision, extra_kv_format=extra_kv_format)
    lead, t, h = problem.lead_shape, problem.num_tokens, problem.num_heads
    d_v = problem.fmt.d_v
    if t == 0:
        return jnp.zeros((*lead, h, d_v), jnp.bfloat16), jnp.zeros((*lead, h), jnp.float32)
    arrays = {
        "q": q.reshape(t, h, problem.fmt.d_qk),
        "kv_cache": kv_cache,
        "indices": indices.reshape(t, problem.topk),
        "topk_length": None if topk_length is None else topk_length.reshape(t),
        "attn_sink": attn_sink,
        "extra_kv_cache": extra_kv_cache,
        "extra_indices": None if extra_indices is None else extra_indices.reshape(t, problem.extra_topk),
        "extra_topk_length": None if extra_topk_length is None else extra_topk_length.reshape(t),
        "valid_tokens": None if valid_tokens is None else valid_tokens.reshape(()),
    }
    arrays = {k: v for k, v in arrays.items() if v is not None}
    out, lse = _differentiable(problem, arrays)
    return out.reshape(*lead, h, d_v), lse.reshape(*lead, h)


def _differentiable(problem, arrays):
    """The flattened op with its reverse-mode derivative (backward.py): the forward rule keeps the operands,
    out and lse, the backward rule recomputes the rest. Inside ``jax.shard_map`` the results are typed as
    varying like the operands (backward.typed_as_varying)."""

    def attend(arrays):
        return backward.typed_as_varying(_batching_rule_op(problem)(arrays), arrays)

    @jax.custom_vjp
    def op(arrays):
        return attend(arrays)

    def forward_rule(arrays):
        wrt = tuple(name for name, x in arrays.items() if x.perturbed)
        backward.check_differentiable(problem, wrt)
        arrays = {name: x.value for name, x in arrays.items()}
        out, lse = backward.without_second_derivative(attend)(arrays)
        return (out, lse), backward.Residuals(arrays, out, lse, wrt)

    def backward_rule(residuals, cotangents):
        d_out, d_lse = cotangents
        return (backward.vjp(problem, residuals, d_out, d_lse, forward=lambda a: _lower(problem, a)),)

    op.defvjp(forward_rule, backward_rule, symbolic_zeros=True)
    return op(arrays)


def _batching_rule_op(problem):
    """The flattened op, with a vmap rule that folds the batch into rows."""

    @jax.custom_batching.custom_vmap
    def op(arrays):
        return _lower(problem, arrays)

    @op.def_vmap
    def _fold_batch(axis_size, in_batched, arrays):
        (in_batched,) = in_batched  # one entry per positional argument of op
        for name in ("kv_cache", "extra_kv_cache"):
            if in_batched.get(name):
                raise ValueError(f"{name}: a cache batched under jax.vmap is not supported (caches are shared, "
                                 f"never copied per batch element); pass it unbatched (in_axes=None)")
        if in_batched.get("attn_sink"):
            raise ValueError("attn_sink: batching over jax.vmap is not supported (one sink per head); "
                             "pass it unbatched (in_axes=None)")
        batch, t = axis_size, problem.num_tokens
        rows = batch * t

        def fold(name):
            x = arrays[name]
            if not in_batched[name]:
                x = jnp.broadcast_to(x, (batch, *x.shape))
            return x.reshape(rows, *x.shape[2:])

        folded = {name: (fold(name) if name in ("q", "indices", "topk_length", "extra_indices",
                                                "extra_topk_length") else arrays[name])
                  for name in arrays if name != "valid_tokens"}
        row_valid = None
        if "valid_tokens" in arrays:
            per_element = arrays["valid_tokens"]
            if not in_batched["valid_tokens"]:
                per_element = jnp.broadcast_to(per_element, (batch,))
            row_valid = (jnp.arange(t, dtype=jnp.int32)[None, :] < per_element[:, None]).reshape(rows)
            # Masked rows get empty candidate lists so the kernels skip their work.
            folded["topk_length"] = jnp.where(row_valid, folded.get("topk_length", problem.topk), 0)
            if "extra_indices" in folded:
                folded["extra_topk_length"] = jnp.where(
                    row_valid, folded.get("extra_topk_length", problem.extra_topk), 0)
        inner = dataclasses.replace(problem, lead_shape=(rows,), num_tokens=rows)
        out, lse = _batching_rule_op(inner)(folded)
        if row_valid is not None:
            out = jnp.where(row_valid[:, None, None], out, jnp.zeros((), out.dtype))
            lse = jnp.where(row_valid[:, None], lse, -jnp.inf)
        out = out.reshape(batch, t, *out.shape[1:])
        lse = lse.reshape(batch, t, *lse.shape[1:])
        return (out, lse), (True, True)

    return op


def _missing_cuda_kernel(problem) -> Optional[str]:
    """Why no CUDA kernel can run the call (None when one can): the rules of validate.RULES that a CUDA
    platform adds (the call is not impl='xla' here)."""
    fmt, rule, impl = problem.fmt, validate.RULE, problem.impl
    if not rule["precision_on_platform"].accepts(fmt, problem.precision, impl, "cuda"):
        return f"precision: {problem.precision!r} has no CUDA kernel yet (FP8 tensor-core compute)"
    if not rule["format_on_platform"].accepts(fmt, "cuda", impl):
        return f"kv_format: {fmt.key!r} has no CUDA kernel yet"
    return None


def _lower(problem, arrays):
    # Where no CUDA kernel serves the call, it runs on the CPU kernel (or impl="xla"); on a GPU backend it
    # raises rather than fall back silently.
    missing_cuda = None if problem.impl == "xla" else _missing_cuda_kernel(problem)
    if missing_cuda is not None and (problem.impl in ("decode", "prefill") or jax.default_backend() == "gpu"):
        raise ValueError(f"{missing_cuda}; on the GPU use impl='xla' (the pure-JAX path) for this call")
    if problem.precision == "fp8":
        # The mode is the operation on the FP8-quantized query; the CPU kernel and the pure-JAX path run it
        # on that query (with P·V in 16 bits, so the default accuracy bound holds).
        arrays = dict(arrays, q=quantize_query_fp8(arrays["q"]))
    get = arrays.get
    if problem.impl == "xla":
        return sparse_mla_reference(
            get("q"), get("kv_cache"), get("indices"), fmt=problem.fmt, layout=problem.layout,
            sm_scale=problem.sm_scale, topk_length=get("topk_length"), attn_sink=get("attn_sink"),
            extra_kv_cache=get("extra_kv_cache"), extra_indices=get("extra_indices"),
            extra_topk_length=get("extra_topk_length"), extra_layout=problem.extra_layout, extra_fmt=problem.extra_fmt,
            valid_tokens=get("valid_tokens"))
    operands = [get(name) for name in _OPERANDS]

    def lower_for(platform):
        def lower_single(single, single_arrays):
            return _lower_single(single, single_arrays, platform)

        if _two_formats(problem) and platform not in _JOINT_TWO_FORMAT_PLATFORMS:
            return lambda *ops: _merged_lists(problem, dict(zip(_OPERANDS, ops)), lower_single)
        return lambda *ops: lower_single(problem, dict(zip(_OPERANDS, ops)))

    if problem.impl in ("decode", "prefill"):
        # The backend first: without a GPU no build of the extension helps.
        if jax.default_backend() != "gpu":
            raise ValueError(f"impl: {problem.impl!r} selects a CUDA kernel, but JAX's default backend is "
                             f"{jax.default_backend()!r} (JAX sees no GPU: no NVIDIA GPU or driver, or no JAX "
                             f"CUDA plugin); use impl='auto' or 'xla'")
        if not _ffi.cuda_available():
            raise ValueError(f"impl: {problem.impl!r} needs the CUDA extension: {_cuda_unavailable()}; or use "
                             f"impl='xla'")
        return lower_for("cuda")(*operands)
    if jax.default_backend() == "gpu" and not _ffi.cuda_available():
        raise ValueError(f"impl: 'auto' on a GPU backend needs the CUDA extension: {_cuda_unavailable()}; or "
                         f"pass impl='xla'")
    if missing_cuda is not None:  # the CPU only (see above)
        return lower_for("cpu")(*operands)
    # Both platforms are planned; only the branch of the platform being lowered for is emitted, so a
    # program exported for CUDA from a CPU host carries the CUDA plan.
    return jax.lax.platform_dependent(*operands, cpu=lower_for("cpu"), cuda=lower_for("cuda"))


def _lower_single(problem, arrays, platform):
    """The kernel call of one plan for ``platform`` (arrays by operand name, None where absent)."""
    plan = planner.plan((problem.num_tokens, problem.num_heads, problem.fmt.d_qk), problem.fmt, problem.topk,
                        extra_topk=problem.extra_topk, platform=platform, impl=problem.impl,
                        batch_invariant=problem.batch_invariant,
                        num_slots=problem.layout.num_slots if platform == "cuda" else None)
    if plan.staged_format is not None:
        problem, arrays = _staged(problem, arrays, get_format(plan.staged_format))
    return _ffi.call(plan, problem, *(arrays.get(name) for name in _OPERANDS))


def _staged(problem, arrays, staged_fmt):
    """The call on a BF16 copy of every slot of the cache (a staged plan, planner module docstring): the
    same values (the format converts to BF16 exactly), read by ``staged_fmt``'s kernels. The barrier ties
    the copy to this call's indices, so XLA never shares one copy between calls (each call pays for the
    copy it reads, and no copy outlives its call)."""
    cache, indices = jax.lax.optimization_barrier((arrays["kv_cache"], arrays["indices"]))
    rows = bf16_rows(cache, problem.layout, problem.fmt)
    staged = dataclasses.replace(problem, fmt=staged_fmt, layout=cache_layout(rows, staged_fmt))
    return staged, dict(arrays, kv_cache=rows, indices=indices)


def _two_formats(problem) -> bool:
    """A dual cache whose extra cache has another format than the main one."""
    return problem.extra_fmt is not None and problem.extra_fmt.key != problem.fmt.key


def _merged_lists(problem, arrays, lower_single):
    """A dual-cache call as two single-cache calls, one per candidate list (each in its cache's format,
    without the sink), merged by their lse with the sink in float32: the joint softmax over main ∪ extra
    (docs/semantics.md). How the CUDA kernels, which read one format per call, serve a dual cache of two
    formats. ``lower_single(problem, arrays) -> (out, lse)`` lowers one single-cache call."""
    get = arrays.get
    single = dataclasses.replace(problem, extra_topk=0, extra_layout=None, extra_fmt=None)
    main_out, main_lse = lower_single(single, {
        "q": get("q"), "kv_cache": get("kv_cache"), "indices": get("indices"), "topk_length": get("topk_length"),
        "valid_tokens": get("valid_tokens")})
    extra_single = dataclasses.replace(single, fmt=problem.extra_fmt, topk=problem.extra_topk,
                                       layout=problem.extra_layout)
    extra_out, extra_lse = lower_single(extra_single, {
        "q": get("q"), "kv_cache": get("extra_kv_cache"), "indices": get("extra_indices"),
        "topk_length": get("extra_topk_length"), "valid_tokens": get("valid_tokens")})
    lse = jnp.logaddexp(main_lse, extra_lse)
    sink = get("attn_sink")
    if sink is not None:
        lse = jnp.logaddexp(lse, sink.astype(jnp.float32)[None, :])
    out = _mix(((main_out, main_lse), (extra_out, extra_lse)), lse)
    valid_tokens = get("valid_tokens")
    if valid_tokens is not None:  # padding rows stay empty, whatever the sink
        row_valid = (jnp.arange(problem.num_tokens, dtype=jnp.int32) < valid_tokens)[:, None]
        out = jnp.where(row_valid[..., None], out, 0.0)
        lse = jnp.where(row_valid, lse, -jnp.inf)
    return out.astype(main_out.dtype), lse


def _cuda_unavailable() -> str:
    """Why the CUDA extension is missing, with what fixes it: a build without it, or one that cannot load."""
    if not _ffi.cuda_built():
        return str(_ffi.cuda_import_error())
    return (f"it is installed but failed to load ({_ffi.cuda_import_error()}); check the NVIDIA driver and the "
            f"CUDA libraries of the JAX CUDA plugin")


def merge_attention_states(out_a, lse_a, out_b, lse_b):
    """Combines two attention states over disjoint candidate sets (docs/semantics.md, merging partial states).

    Args:
      out_a: ``[..., H, d_v]`` (any float dtype; the result has out_a's dtype).
      lse_a: float32 ``[..., H]``, natural log; ``-inf`` marks an empty state.
      out_b: the second state's output, shaped like ``out_a``.
      lse_b: the second state's lse, shaped like ``lse_a``.

    Returns:
      ``(out, lse)`` of the union: ``lse = logaddexp(lse_a, lse_b)``, ``out`` the lse-weighted mix.
      Two empty states give ``out = 0``, ``lse = -inf``; a ``+inf`` lse (an infinite sink) gives
      ``out = 0``, ``lse = +inf``.

    Raises:
      TypeError: an argument that is not an array, or ``lse_a``/``lse_b`` not float32.
      ValueError: shapes that do not match.
    """
    for name, x in (("out_a", out_a), ("lse_a", lse_a), ("out_b", out_b), ("lse_b", lse_b)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name}: expected an array, got {type(x).__name__}")
    for name, x in (("lse_a", lse_a), ("lse_b", lse_b)):
        if x.dtype != jnp.float32:
            raise TypeError(f"{name}: expected float32 [..., H], got {x.dtype} {list(x.shape)}")
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape or out_a.shape[:-1] != lse_a.shape:
        raise ValueError(f"out/lse: expected out_a, out_b [..., H, d_v] and lse_a, lse_b [..., H] of matching "
                         f"shapes, got {list(out_a.shape)}, {list(out_b.shape)}, {list(lse_a.shape)}, "
                         f"{list(lse_b.shape)}")
    lse = jnp.logaddexp(lse_a, lse_b)
    return _mix(((out_a, lse_a), (out_b, lse_b)), lse).astype(out_a.dtype), lse


def _mix(states, lse):
    """float32 sum of the ``(out, part_lse)`` states weighted by ``exp(part_lse - lse)``, in order; rows whose
    ``lse`` is not finite (all states empty, or an infinite sink) get 0."""
    finite = jnp.isfinite(lse)
    safe = jnp.where(finite, lse, 0.0)
    total = None
    for out, part_lse in states:
        weight = jnp.where(finite, jnp.exp(part_lse - safe), 0.0)[..., None]
        # where(), not a product, so an empty state's values can never leak into the result.
        term = jnp.where(weight > 0, weight * out.astype(jnp.float32), 0.0)
        total = term if total is None else total + term
    return total
