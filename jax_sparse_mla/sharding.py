"""``jax.shard_map`` helpers for :func:`~jax_sparse_mla.sparse_mla` that keep every operand local.

``sparse_mla`` is a custom call: XLA's partitioner cannot split it, so calling it on arrays sharded across
devices outside ``shard_map`` makes XLA gather every operand (the whole KV cache included) onto each
device. The helpers here run one ``sparse_mla`` per shard instead:

- **tensor parallel** (``head_axis``): the heads of ``q`` (and ``attn_sink``) are split over a mesh axis;
  caches, indices and lengths are replicated.
- **data / expert parallel** (``token_axis``): the tokens of ``q``, ``indices`` and the lengths are split
  over a mesh axis; each rank owns its own cache, passed as one global array whose leading (page) axis is
  the concatenation of the ranks' pages, and its indices address that local cache. ``valid_tokens`` is a
  global int32 ``[num_token_shards]`` array: one count per shard, so a shard whose count is 0 is an
  *empty shard* (``out = 0``, ``lse = -inf``, its kernel launches exit at once).
- **both** (``token_axis`` and ``head_axis``).

No collective is needed: every output row is computed where its query lives. User documentation:
docs/sharding_and_export.md.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Union

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from .api import sparse_mla
from .formats import KVFormat

__all__ = ["SparseMLASpecs", "sparse_mla_specs", "sharded_sparse_mla", "collectives_in"]

#: HLO collective operations (their asynchronous -start/-done forms included).
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")

#: A mesh axis name, a tuple of names (one array axis split over several mesh axes), or None.
MeshAxes = Union[str, tuple, None]


class SparseMLASpecs(NamedTuple):
    """The ``PartitionSpec`` of every operand and result of a sharded ``sparse_mla``.

    Specs name only the axes that are split (a spec shorter than the array replicates the rest), so one
    spec serves every accepted rank of an operand (e.g. every accepted cache shape). There is one field
    per operand of :func:`~jax_sparse_mla.sparse_mla` (``q``, ``kv_cache``, ``indices``,
    ``topk_length``, ``attn_sink``, ``extra_kv_cache``, ``extra_indices``, ``extra_topk_length``,
    ``valid_tokens``) and one per result (``out``, ``lse``).
    """

    q: PartitionSpec
    kv_cache: PartitionSpec
    indices: PartitionSpec
    topk_length: PartitionSpec
    attn_sink: PartitionSpec
    extra_kv_cache: PartitionSpec
    extra_indices: PartitionSpec
    extra_topk_length: PartitionSpec
    valid_tokens: PartitionSpec
    out: PartitionSpec
    lse: PartitionSpec


def sparse_mla_specs(*, token_axis: MeshAxes = None, head_axis: MeshAxes = None, per_rank_cache: bool = True,
                     lead_dims: int = 1) -> SparseMLASpecs:
    """The partition specs that keep ``sparse_mla``'s operands local, for building your own ``shard_map``.

    Args:
      token_axis: mesh axis (or tuple of axes) splitting the tokens: the first axis of ``q``, ``indices``,
        ``topk_length`` and their ``extra_`` counterparts, and ``valid_tokens`` (one entry per shard).
      head_axis: mesh axis (or tuple of axes) splitting the heads of ``q`` and ``attn_sink``.
      per_rank_cache: with ``token_axis``, split the caches' leading (page) axis too: each rank holds its
        own cache and its indices address it. False replicates the caches (indices stay global).
      lead_dims: leading axes of ``q`` before ``[H, d_qk]``: 1 for ``[T, H, d_qk]``, 2 for
        ``[B, S, H, d_qk]`` (then ``token_axis`` splits ``B``).

    Returns:
      A :class:`SparseMLASpecs`. Inside the shard, ``valid_tokens`` has shape ``[1]`` with ``token_axis``,
      and is replicated (scalar or ``[1]``) without it.
    """
    if lead_dims not in (1, 2):
        raise ValueError(f"lead_dims: expected 1 ([T, H, d_qk]) or 2 ([B, S, H, d_qk]), got {lead_dims!r}")
    # P() rather than P(None) for an unsplit operand: it replicates operands of any rank, scalars included.
    rows = PartitionSpec(token_axis) if token_axis is not None else PartitionSpec()
    heads = PartitionSpec(token_axis, *([None] * (lead_dims - 1)), head_axis)
    cache = rows if per_rank_cache else PartitionSpec()
    sink = PartitionSpec(head_axis) if head_axis is not None else PartitionSpec()
    return SparseMLASpecs(q=heads, kv_cache=cache, indices=rows, topk_length=rows, attn_sink=sink,
                          extra_kv_cache=cache, extra_indices=rows, extra_topk_length=rows, valid_tokens=rows,
                          out=heads, lse=heads)


def _axis_names(axes: MeshAxes) -> tuple:
    if axes is None:
        return ()
    return tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)


def _describe(x) -> str:
    return f"{np.dtype(x.dtype).name} [{', '.join(str(d) for d in x.shape)}]"


def sharded_sparse_mla(mesh, *, kv_format: Union[str, KVFormat], sm_scale: float, token_axis: MeshAxes = None,
                       head_axis: MeshAxes = None, per_rank_cache: bool = True, page_size: Optional[int] = None,
                       extra_page_size: Optional[int] = None, impl: str = "auto"):
    """Returns ``sparse_mla`` run per shard of ``mesh`` with every operand local to its shard.

    Args:
      mesh: a ``jax.sharding.Mesh`` (Auto or Explicit axes; with Explicit axes the operands are resharded
        to the specs first, a no-op when they already are).
      kv_format: as for :func:`~jax_sparse_mla.sparse_mla`.
      sm_scale: as for :func:`~jax_sparse_mla.sparse_mla`.
      token_axis: mesh axis (or tuple of axes) over which tokens, indices, lengths, ``valid_tokens`` and
        (with ``per_rank_cache``) the caches are split: data/expert parallelism.
      head_axis: mesh axis (or tuple of axes) over which the heads of ``q`` and ``attn_sink`` are split:
        tensor parallelism.
      per_rank_cache: see :func:`sparse_mla_specs`.
      page_size: the per-rank cache's page size (the split leaves it unchanged), for its 2-D form.
      extra_page_size: the same, for the extra cache.
      impl: as for :func:`~jax_sparse_mla.sparse_mla`.

    Returns:
      ``f(q, kv_cache, indices, *, topk_length=None, attn_sink=None, extra_kv_cache=None,
      extra_indices=None, extra_topk_length=None, valid_tokens=None) -> (out, lse)`` taking and returning
      global arrays laid out by :func:`sparse_mla_specs`. Use it under ``jax.jit``.

    Raises:
      ValueError: at construction, an axis missing from the mesh or used twice, or neither axis given;
        at call time, an operand whose split axis is not divisible by its shard count, or
        ``valid_tokens`` not of shape ``[num_token_shards]``. Each shard's operands are then validated
        by ``sparse_mla``.
    """
    token_names, head_names = _axis_names(token_axis), _axis_names(head_axis)
    if not token_names and not head_names:
        raise ValueError("token_axis/head_axis: expected at least one mesh axis to shard over, got neither; "
                         "without sharding call sparse_mla directly")
    mesh_sizes = dict(mesh.shape)
    for arg, names in (("token_axis", token_names), ("head_axis", head_names)):
        for name in names:
            if name not in mesh_sizes:
                raise ValueError(f"{arg}: expected axes of the mesh {tuple(mesh_sizes)}, got {name!r}")
    shared = set(token_names) & set(head_names)
    if shared or len(set(token_names)) != len(token_names) or len(set(head_names)) != len(head_names):
        raise ValueError(f"token_axis/head_axis: each mesh axis may appear once, got token_axis={token_axis!r}, "
                         f"head_axis={head_axis!r}")
    token_shards = math.prod(mesh_sizes[n] for n in token_names)
    head_shards = math.prod(mesh_sizes[n] for n in head_names)
    explicit = bool(getattr(mesh, "explicit_axes", ()))
    static = dict(kv_format=kv_format, sm_scale=sm_scale, page_size=page_size, extra_page_size=extra_page_size,
                  impl=impl)

    def check_divisible(name, x, dim, what, shards, axes):
        if shards > 1 and x.shape[dim] % shards:
            raise ValueError(f"{name}: the {what} axis (dim {dim}) of {_describe(x)} must be divisible by the "
                             f"{shards} shards of mesh axis {axes!r}, got {x.shape[dim]}")

    def sharded(q, kv_cache, indices, *, topk_length=None, attn_sink=None, extra_kv_cache=None, extra_indices=None,
                extra_topk_length=None, valid_tokens=None):
        """``sparse_mla`` on global arrays, computed shard by shard (see :func:`sharded_sparse_mla`)."""
        arrays = dict(q=q, kv_cache=kv_cache, indices=indices, topk_length=topk_length, attn_sink=attn_sink,
                      extra_kv_cache=extra_kv_cache, extra_indices=extra_indices,
                      extra_topk_length=extra_topk_length, valid_tokens=valid_tokens)
        arrays = {name: x for name, x in arrays.items() if x is not None}
        for name, x in arrays.items():
            if not hasattr(x, "shape") or not hasattr(x, "dtype"):
                raise TypeError(f"{name}: expected an array, got {type(x).__name__}")
        if q.ndim not in (3, 4):
            raise ValueError(f"q: expected bfloat16 [T, H, d_qk] or [B, S, H, d_qk], got {_describe(q)}")
        for name in ("q", "indices", "topk_length", "extra_indices", "extra_topk_length"):
            if name in arrays and arrays[name].ndim:
                check_divisible(name, arrays[name], 0, "token", token_shards, token_axis)
        check_divisible("q", q, q.ndim - 2, "head", head_shards, head_axis)
        if attn_sink is not None and attn_sink.ndim:
            check_divisible("attn_sink", attn_sink, 0, "head", head_shards, head_axis)
        if per_rank_cache:
            for name in ("kv_cache", "extra_kv_cache"):
                if name in arrays and arrays[name].ndim:
                    check_divisible(name, arrays[name], 0, "page", token_shards, token_axis)
        if valid_tokens is not None and token_names:
            if np.dtype(valid_tokens.dtype) != np.dtype(np.int32):
                raise TypeError(f"valid_tokens: expected int32 [{token_shards}] (one count per shard of mesh axis "
                                f"{token_axis!r}), got {_describe(valid_tokens)}")
            if tuple(valid_tokens.shape) != (token_shards,):
                raise ValueError(f"valid_tokens: expected int32 [{token_shards}] (one count per shard of mesh axis "
                                 f"{token_axis!r}), got {_describe(valid_tokens)}")

        specs = sparse_mla_specs(token_axis=token_axis, head_axis=head_axis, per_rank_cache=per_rank_cache,
                                 lead_dims=q.ndim - 2)
        in_specs = {name: getattr(specs, name) for name in arrays}
        if explicit:
            arrays = {name: jax.sharding.reshard(x, NamedSharding(mesh, in_specs[name])) for name, x in arrays.items()}

        def per_shard(local):
            local = dict(local)
            return sparse_mla(local.pop("q"), local.pop("kv_cache"), local.pop("indices"), **static, **local)

        return jax.shard_map(per_shard, mesh=mesh, in_specs=(in_specs,), out_specs=(specs.out, specs.lse))(arrays)

    return sharded


def collectives_in(hlo_text: str) -> list:
    """The collective operations (all-gather, all-reduce, reduce-scatter, all-to-all, collective-permute)
    a compiled program's HLO text contains, sorted: ``[]`` for a sharded step that communicates nothing.

    Example: ``collectives_in(jax.jit(step).lower(*args).compile().as_text())``.
    """
    import re

    return sorted(name for name in COLLECTIVES if re.search(rf"\b{name}(-start|-done)?\(", hlo_text))
