"""A DeepSeek-V3.2 attention block for inference in Flax NNX, over a paged FP8 latent cache.

The block is DeepSeek Sparse Attention: Multi-head Latent Attention (MLA) whose queries each attend to
the ``index_topk`` earlier tokens that a *lightning indexer* picks, computed with
``jax_sparse_mla.sparse_mla`` on the latent cache. Contents:

- :class:`Config`: the model's dimensions (DeepSeek-V3.2's by default), the cache format and the kernel.
- :class:`Caches`, :func:`init_caches`, :func:`cache_slots`: the paged caches and the page table.
- :func:`rope`, :func:`rope_frequencies`: rotary embedding with YaRN frequencies, both pair layouts.
- :class:`Indexer`: the lightning indexer (its own key cache, top-k over each query's causal range).
- :class:`SparseMLA`: the attention block; ``prepare`` / ``attend`` / ``project_out`` are its three
  stages, so the attention call can also run sharded (see ``expert_parallel.py``).
- :func:`jit_step`, :func:`prefill`, :func:`decode_loop`: prefill and a jitted decode loop whose
  caches are donated (updated in place).

Conventions that are easy to get wrong (each one changes the result silently):

1. **The latent row** written to the cache is ``[kv_a_layernorm(c_kv) ++ rope(k_pe)]``: the RMSNorm
   applies to the 512 ``c_kv`` lanes *before* they are stored, the rotary embedding to the 64 ``k_pe``
   lanes; the nope lanes come first (the formats' ``nope(512) ++ rope(64)`` layout, ``dsv3_2``
   quantizes the first 512 lanes to FP8 and keeps the last 64 in BF16).
2. **The rope pair layout** of ``q_pe`` must match the one used for ``k_pe`` in the cache. DeepSeek-V3.2
   rotates the MLA rope lanes *interleaved* (pairs ``(2i, 2i+1)``) and the indexer's *half-split*
   (pairs ``(i, i + 32)``). A mismatch still runs, but scores no longer depend on relative position only.
3. **``sm_scale``** is DeepSeek's ``softmax_scale = qk_head_dim ** -0.5 * mscale ** 2`` with
   ``qk_head_dim = qk_nope_head_dim + qk_rope_head_dim = 192`` (the per-head width of the un-absorbed
   attention, *not* the 576 lanes of the absorbed query) and YaRN's
   ``mscale = 0.1 * mscale_coefficient * ln(rope_factor) + 1``: about 0.1352 for DeepSeek-V3.2, against
   0.0417 for ``576 ** -0.5``.
4. **The query** is ``[q_nope · W_UK ++ rope(q_pe)]`` (576 lanes): the nope part absorbed into the
   512-lane latent space through the key half of ``wkv_b``, then the roped part, in the cache's order.
   The 512-lane output is brought back per head through the value half of ``wkv_b`` before ``wo``.
5. **Indexer positions are per sequence**: a query at position ``p`` of sequence ``b`` may pick
   positions ``0..p`` of sequence ``b`` only, and a picked position becomes a cache slot through the
   page table (``slot = page_table[b, pos // page_size] * page_size + pos % page_size``), never
   ``b * max_len + pos``. Picks outside the causal range (when ``p + 1 < index_topk``) are set to -1.

DeepSeek's indexer rotates its queries and keys by a Hadamard transform before quantizing them to FP8;
the rotation is orthogonal, so with the BF16 index-key cache used here the scores are the same without it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jax_sparse_mla as jsm

__all__ = ["Config", "Caches", "init_caches", "cache_slots", "allocate_pages", "rope_frequencies", "rope",
           "Indexer", "SparseMLA", "with_config", "jit_step", "prefill", "decode_loop"]


@dataclasses.dataclass(frozen=True)
class Config:
    """Dimensions of one DeepSeek-V3.2 attention block (the defaults are the released model's).

    ``kv_lora_rank`` and ``qk_rope_head_dim`` are fixed by the latent cache formats (576-lane rows:
    512 nope ++ 64 rope); everything else may be shrunk, e.g. for tests.
    """

    hidden_size: int = 7168
    num_heads: int = 128
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    index_num_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 2048
    rope_theta: float = 10000.0
    rope_factor: float = 40.0  # YaRN context extension; 1 disables YaRN (and its mscale)
    original_seq_len: int = 4096
    beta_fast: int = 32
    beta_slow: int = 1
    mscale_coefficient: float = 1.0  # the config's mscale / mscale_all_dim
    norm_eps: float = 1e-6
    kv_format: str = "dsv3_2"  # "dsv3_2" (FP8), "glm_nsa" (FP8, free scales) or "bf16_576"
    page_size: int = 64
    impl: str = "auto"  # sparse_mla's impl: "auto" runs the C++ / CUDA kernels, "xla" the pure-JAX path
    dtype: jnp.dtype = jnp.float32  # parameters and projections

    def __post_init__(self):
        fmt = jsm.get_format(self.kv_format)
        if (fmt.d_qk, fmt.d_v) != (self.kv_lora_rank + self.qk_rope_head_dim, self.kv_lora_rank):
            raise ValueError(f"kv_format: expected a format with d_qk = kv_lora_rank + qk_rope_head_dim = "
                             f"{self.kv_lora_rank + self.qk_rope_head_dim} and d_v = kv_lora_rank = "
                             f"{self.kv_lora_rank}, got {fmt.key} (d_qk {fmt.d_qk}, d_v {fmt.d_v})")
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ValueError(f"index_head_dim: expected >= qk_rope_head_dim = {self.qk_rope_head_dim} (the "
                             f"indexer ropes its first {self.qk_rope_head_dim} lanes), got {self.index_head_dim}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def mscale(self) -> float:
        """YaRN's attention-temperature factor (1 without YaRN)."""
        if self.rope_factor <= 1:
            return 1.0
        return 0.1 * self.mscale_coefficient * math.log(self.rope_factor) + 1.0

    @property
    def softmax_scale(self) -> float:
        """The ``sm_scale`` for ``sparse_mla``: ``qk_head_dim ** -0.5 * mscale ** 2`` (convention 3)."""
        return self.qk_head_dim ** -0.5 * self.mscale ** 2


# --------------------------------------------------------------------------------------------------
# Paged caches
# --------------------------------------------------------------------------------------------------

class Caches(NamedTuple):
    """The two paged caches of one layer; both use the same pages and page table.

    latent: the ``kv_format`` cache of latent rows ``[kv_a_layernorm(c_kv) ++ rope(k_pe)]``
      (uint8 ``[num_pages, page_size, bytes_per_token]``, or bfloat16 ``[num_pages, page_size, 576]``).
    index_keys: bfloat16 ``[num_pages, page_size, index_head_dim]``, the indexer's keys.
    """

    latent: jax.Array
    index_keys: jax.Array


def init_caches(config: Config, num_pages: int) -> Caches:
    """Empty caches of ``num_pages`` pages (all bytes zero; a slot is read only after it is written)."""
    num_slots = num_pages * config.page_size
    # quantize_kv fixes the cache's shape and dtype per format; eval_shape gets them without encoding.
    latent = jax.eval_shape(functools.partial(jsm.quantize_kv, kv_format=config.kv_format, page_size=config.page_size),
                            jax.ShapeDtypeStruct((num_slots, config.latent_dim), jnp.float32))
    return Caches(latent=jnp.zeros(latent.shape, latent.dtype),
                  index_keys=jnp.zeros((num_pages, config.page_size, config.index_head_dim), jnp.bfloat16))


def allocate_pages(lengths, page_size: int, max_pages_per_seq: int, num_pages: int, seed: int = 0):
    """A page table for sequences of ``lengths`` tokens, pages drawn in random order from the pool.

    Returns int32 ``[len(lengths), max_pages_per_seq]``: row ``b`` lists sequence ``b``'s pages in order,
    -1 past the pages it needs. Random order stands in for a serving allocator's free list, so nothing
    may assume that a sequence's pages are contiguous.
    """
    needed = [-(-int(n) // page_size) for n in lengths]
    if max(needed) > max_pages_per_seq or sum(needed) > num_pages:
        raise ValueError(f"lengths: {list(lengths)} need {needed} pages of {page_size} tokens, more than "
                         f"max_pages_per_seq={max_pages_per_seq} or num_pages={num_pages} allow")
    free = np.random.default_rng(seed).permutation(num_pages)
    table = np.full((len(lengths), max_pages_per_seq), -1, np.int32)
    start = 0
    for b, count in enumerate(needed):
        table[b, :count] = free[start:start + count]
        start += count
    return jnp.asarray(table)


def cache_slots(page_table, positions, page_size: int):
    """Cache slots of per-sequence ``positions [B, S]`` (-1 = none) through ``page_table [B, pages]``.

    ``slot = page_table[b, pos // page_size] * page_size + pos % page_size``; a negative position, one past
    the table, or one on an unallocated page (-1) gives slot -1, which ``update_kv`` and ``sparse_mla``
    skip.
    """
    max_pages = page_table.shape[1]
    page_index = jnp.clip(positions // page_size, 0, max_pages - 1)
    page = jnp.take_along_axis(page_table, page_index, axis=1)
    valid = (positions >= 0) & (positions < max_pages * page_size) & (page >= 0)
    return jnp.where(valid, page * page_size + positions % page_size, -1).astype(jnp.int32)


# --------------------------------------------------------------------------------------------------
# Rotary embedding (YaRN)
# --------------------------------------------------------------------------------------------------

def rope_frequencies(config: Config) -> np.ndarray:
    """The ``qk_rope_head_dim // 2`` rotation frequencies, with YaRN's interpolation when ``rope_factor > 1``.

    YaRN keeps the high frequencies (dimensions that rotate more than ``beta_fast`` times over the
    original context), divides the low ones (fewer than ``beta_slow`` rotations) by ``rope_factor``, and
    ramps linearly in between.
    """
    dim, base = config.qk_rope_head_dim, config.rope_theta
    freqs = 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    if config.rope_factor > 1:
        def correction_dim(rotations):
            return dim * math.log(config.original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(correction_dim(config.beta_fast)), 0)
        high = min(math.ceil(correction_dim(config.beta_slow)), dim - 1)
        ramp = np.clip((np.arange(dim // 2) - low) / max(high - low, 1e-3), 0.0, 1.0)
        keep = 1.0 - ramp
        freqs = freqs / config.rope_factor * (1.0 - keep) + freqs * keep
    return freqs.astype(np.float32)


def rope(x, positions, freqs, *, interleaved: bool):
    """Rotates ``x [..., S, (heads,) dim]`` by ``positions [..., S]``; pairs ``(2i, 2i+1)`` or ``(i, i + dim/2)``.

    ``x`` has a heads axis when its rank exceeds ``positions``' by 2. Computed in float32, returned in
    ``x``'s dtype.
    """
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(freqs)  # [..., S, dim/2]
    if x.ndim == positions.ndim + 2:
        angles = angles[..., None, :]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    xf = x.astype(jnp.float32)
    if interleaved:
        real, imag = xf[..., 0::2], xf[..., 1::2]
    else:
        real, imag = jnp.split(xf, 2, axis=-1)
    rotated_real, rotated_imag = real * cos - imag * sin, real * sin + imag * cos
    if interleaved:
        out = jnp.stack([rotated_real, rotated_imag], axis=-1).reshape(x.shape)
    else:
        out = jnp.concatenate([rotated_real, rotated_imag], axis=-1)
    return out.astype(x.dtype)


# --------------------------------------------------------------------------------------------------
# The block
# --------------------------------------------------------------------------------------------------

def _linear(inputs, outputs, config, rngs, dtype=None):
    dtype = dtype or config.dtype
    return nnx.Linear(inputs, outputs, use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs)


class Indexer(nnx.Module):
    """DeepSeek-V3.2's lightning indexer: for each query, the ``index_topk`` earlier tokens to attend to.

    Scores are ``score[t, l] = sum_h w[t, h] * relu(q[t, h] · k[l])`` with ``index_num_heads`` query heads,
    one key head (its own paged cache) and per-head weights ``w = weights_proj(x) * H**-0.5 * D**-0.5``.
    The rope lanes are the *first* ``qk_rope_head_dim`` lanes of the indexer's heads, rotated half-split.
    """

    def __init__(self, config: Config, *, rngs: nnx.Rngs):
        self.config = config
        self.wq_b = _linear(config.q_lora_rank, config.index_num_heads * config.index_head_dim, config, rngs)
        self.wk = _linear(config.hidden_size, config.index_head_dim, config, rngs)
        self.k_norm = nnx.LayerNorm(config.index_head_dim, epsilon=config.norm_eps, dtype=jnp.float32,
                                    param_dtype=jnp.float32, rngs=rngs)
        self.weights_proj = _linear(config.hidden_size, config.index_num_heads, config, rngs, dtype=jnp.float32)

    def _rope_first_lanes(self, x, positions, freqs):
        rope_dim = self.config.qk_rope_head_dim
        return jnp.concatenate([rope(x[..., :rope_dim], positions, freqs, interleaved=False), x[..., rope_dim:]],
                               axis=-1)

    def keys(self, x, positions, freqs):
        """The index keys of tokens ``x [B, S, hidden]``: bfloat16 ``[B, S, index_head_dim]``."""
        k = self.k_norm(self.wk(x).astype(jnp.float32))
        return self._rope_first_lanes(k, positions, freqs).astype(jnp.bfloat16)

    def queries(self, x, qr, positions, freqs):
        """Index queries ``[B, S, heads, index_head_dim]`` and head weights ``[B, S, heads]`` (float32)."""
        c = self.config
        q = self.wq_b(qr).reshape(*qr.shape[:-1], c.index_num_heads, c.index_head_dim)
        q = self._rope_first_lanes(q, positions, freqs).astype(jnp.bfloat16)
        weights = self.weights_proj(x.astype(jnp.float32)) * (c.index_num_heads ** -0.5 * c.index_head_dim ** -0.5)
        return q, weights

    def select(self, q, weights, index_keys, positions, page_table):
        """The cache slots each query attends to: int32 ``[B, S, index_topk]``, -1 where nothing is picked.

        Scores every position of the query's own sequence (its pages, gathered through ``page_table``),
        masks positions after the query's, takes ``lax.top_k`` and maps the picked positions to slots.
        """
        c = self.config
        batch, max_pages = page_table.shape
        context = max_pages * c.page_size
        context_positions = jnp.broadcast_to(jnp.arange(context, dtype=jnp.int32), (batch, context))
        context_slots = cache_slots(page_table, context_positions, c.page_size)  # [B, L]
        keys = index_keys.reshape(-1, c.index_head_dim)[jnp.maximum(context_slots, 0)]  # [B, L, D]
        logits = jnp.einsum("bshd,bld->bshl", q, keys, preferred_element_type=jnp.float32)
        scores = jnp.einsum("bshl,bsh->bsl", jax.nn.relu(logits), weights)
        causal = context_positions[:, None, :] <= positions[:, :, None]  # padding queries (-1) see nothing
        scores = jnp.where(causal, scores, -jnp.inf)
        k = min(c.index_topk, context)
        _, picked = jax.lax.top_k(scores, k)  # positions in the sequence, [B, S, k]
        admissible = jnp.take_along_axis(causal, picked, axis=-1)
        slots = jnp.where(admissible, jnp.take_along_axis(context_slots[:, None, :], picked, axis=-1), -1)
        # A context shorter than index_topk still gives index_topk candidates: the rest are empty.
        return jnp.pad(slots, ((0, 0), (0, 0), (0, c.index_topk - k)), constant_values=-1)


class SparseMLA(nnx.Module):
    """DeepSeek-V3.2 attention (MLA with weight absorption + lightning indexer) over paged caches.

    ``y, caches = block(x, positions, caches, page_table)`` with ``x [B, S, hidden]``, per-sequence
    ``positions`` int32 ``[B, S]`` (-1 marks padding: nothing is written, the output row is 0) and
    ``page_table`` int32 ``[B, max_pages_per_seq]``. The new tokens are written to both caches first, so
    each query attends to the tokens of this call up to its own position too (causal prefill).
    """

    def __init__(self, config: Config, *, rngs: nnx.Rngs):
        c = self.config = config
        self.wq_a = _linear(c.hidden_size, c.q_lora_rank, c, rngs)
        self.q_norm = nnx.RMSNorm(c.q_lora_rank, epsilon=c.norm_eps, dtype=jnp.float32, param_dtype=jnp.float32,
                                  rngs=rngs)
        self.wq_b = _linear(c.q_lora_rank, c.num_heads * c.qk_head_dim, c, rngs)
        self.wkv_a = _linear(c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim, c, rngs)
        self.kv_norm = nnx.RMSNorm(c.kv_lora_rank, epsilon=c.norm_eps, dtype=jnp.float32, param_dtype=jnp.float32,
                                   rngs=rngs)
        # wkv_b maps a latent row to every head's [k_nope ++ v]; absorption uses its two halves separately.
        self.wkv_b = _linear(c.kv_lora_rank, c.num_heads * (c.qk_nope_head_dim + c.v_head_dim), c, rngs)
        self.wo = _linear(c.num_heads * c.v_head_dim, c.hidden_size, c, rngs)
        self.indexer = Indexer(c, rngs=rngs)

    def w_uk_uv(self):
        """The key and value halves of ``wkv_b``: ``[kv_lora_rank, heads, qk_nope]``, ``[kv_lora_rank, heads, v]``."""
        c = self.config
        kernel = self.wkv_b.kernel[...].reshape(c.kv_lora_rank, c.num_heads, c.qk_nope_head_dim + c.v_head_dim)
        return kernel[..., :c.qk_nope_head_dim], kernel[..., c.qk_nope_head_dim:]

    def latent_rows(self, x, positions):
        """``[kv_a_layernorm(c_kv) ++ rope(k_pe)]`` of tokens ``x [B, S, hidden]`` (convention 1), float32."""
        c = self.config
        kv = self.wkv_a(x)
        c_kv = self.kv_norm(kv[..., :c.kv_lora_rank].astype(jnp.float32))
        k_pe = rope(kv[..., c.kv_lora_rank:].astype(jnp.float32), positions, rope_frequencies(c), interleaved=True)
        return jnp.concatenate([c_kv, k_pe], axis=-1)

    def queries(self, x, positions):
        """The per-head ``q_nope [B, S, H, qk_nope]`` and roped ``q_pe [B, S, H, rope]``, plus ``qr``."""
        c = self.config
        qr = self.q_norm(self.wq_a(x).astype(jnp.float32)).astype(c.dtype)
        q = self.wq_b(qr).reshape(*x.shape[:-1], c.num_heads, c.qk_head_dim)
        q_pe = rope(q[..., c.qk_nope_head_dim:], positions, rope_frequencies(c), interleaved=True)
        return q[..., :c.qk_nope_head_dim], q_pe, qr

    def prepare(self, x, positions, caches: Caches, page_table):
        """Writes the new tokens to both caches and builds the kernel's operands.

        Returns ``(q, indices, caches)``: the absorbed query bfloat16 ``[B, S, H, 576]`` (convention 4),
        the picked cache slots int32 ``[B, S, index_topk]`` and the updated caches.
        """
        c = self.config
        slots = cache_slots(page_table, positions, c.page_size).reshape(-1)
        latent = jsm.update_kv(caches.latent, slots, self.latent_rows(x, positions).reshape(-1, c.latent_dim),
                               c.kv_format)
        freqs = rope_frequencies(c)
        new_keys = self.indexer.keys(x, positions, freqs).reshape(-1, c.index_head_dim)
        index_keys = caches.index_keys.reshape(-1, c.index_head_dim)
        index_keys = index_keys.at[jnp.where(slots >= 0, slots, index_keys.shape[0])].set(new_keys, mode="drop")
        index_keys = index_keys.reshape(caches.index_keys.shape)

        q_nope, q_pe, qr = self.queries(x, positions)
        index_q, index_weights = self.indexer.queries(x, qr, positions, freqs)
        indices = self.indexer.select(index_q, index_weights, index_keys, positions, page_table)
        w_uk, _ = self.w_uk_uv()
        q_latent = jnp.einsum("bshd,chd->bshc", q_nope, w_uk, preferred_element_type=jnp.float32)
        q = jnp.concatenate([q_latent, q_pe.astype(jnp.float32)], axis=-1).astype(jnp.bfloat16)
        return q, indices, Caches(latent, index_keys)

    def attend(self, q, latent_cache, indices):
        """``sparse_mla`` over the latent cache: the per-head 512-lane latent output ``[B, S, H, 512]``."""
        c = self.config
        out, _ = jsm.sparse_mla(q, latent_cache, indices, kv_format=c.kv_format, sm_scale=c.softmax_scale,
                                impl=c.impl)
        return out

    def project_out(self, out_latent):
        """Latent output ``[B, S, H, 512]`` → per-head values through ``W_UV`` → ``wo`` → ``[B, S, hidden]``."""
        c = self.config
        _, w_uv = self.w_uk_uv()
        values = jnp.einsum("bshc,chd->bshd", out_latent.astype(c.dtype), w_uv, preferred_element_type=jnp.float32)
        return self.wo(values.reshape(*values.shape[:2], c.num_heads * c.v_head_dim).astype(c.dtype))

    def __call__(self, x, positions, caches: Caches, page_table):
        q, indices, caches = self.prepare(x, positions, caches, page_table)
        return self.project_out(self.attend(q, caches.latent, indices)), caches


def with_config(block: SparseMLA, **changes) -> SparseMLA:
    """The block's parameters under a config with ``changes`` that leave every parameter's shape alone
    (``kv_format``, ``page_size``, ``impl``, ...)."""
    config = dataclasses.replace(block.config, **changes)
    abstract = nnx.eval_shape(lambda: SparseMLA(config, rngs=nnx.Rngs(0)))
    return nnx.merge(nnx.graphdef(abstract), nnx.state(block))


# --------------------------------------------------------------------------------------------------
# Prefill and decode
# --------------------------------------------------------------------------------------------------

def jit_step(block: SparseMLA):
    """``step(caches, x, positions, page_table) -> (y, caches)``: the block under ``jax.jit``, caches donated.

    The parameters are split from the module once (``nnx.split``) and passed as a pytree, so a call costs
    one jitted dispatch; donating the caches lets XLA update them in place. One executable per input shape:
    the prefill shape and the decode shape ``[B, 1, hidden]`` compile once each.
    """
    graphdef, state = nnx.split(block)

    @functools.partial(jax.jit, donate_argnums=1)
    def run(state, caches, x, positions, page_table):
        return nnx.merge(graphdef, state)(x, positions, caches, page_table)

    return lambda caches, x, positions, page_table: run(state, caches, x, positions, page_table)


def prefill(step, caches: Caches, x, lengths, page_table):
    """Runs prompts ``x [B, S, hidden]`` of ``lengths [B]`` tokens (rows past a length are padding)."""
    position = jnp.arange(x.shape[1], dtype=jnp.int32)[None, :]
    positions = jnp.where(position < jnp.asarray(lengths, jnp.int32)[:, None], position, -1)
    return step(caches, x, positions, page_table)


def decode_loop(step, caches: Caches, xs, lengths, page_table):
    """Decodes ``xs [N, B, hidden]`` one token per sequence per step, starting at positions ``lengths [B]``.

    ``xs`` are the hidden states a full model would feed this layer at each step. Returns the outputs
    ``[N, B, hidden]`` and the caches; the caches passed in are donated (do not reuse them).
    """
    start = jnp.asarray(lengths, jnp.int32)[:, None]
    outputs = []
    for i in range(xs.shape[0]):
        y, caches = step(caches, xs[i][:, None, :], start + i, page_table)
        outputs.append(y[:, 0])
    return jnp.stack(outputs), caches
