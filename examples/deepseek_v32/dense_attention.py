"""A dense pure-JAX version of :class:`attention.SparseMLA`, to check the paged, sparse one against.

The same layer written the way DeepSeek's reference prefill computes it, with nothing shared with the
sparse path but the projections and the rotary embedding: no cache, no page table, no weight absorption
(per-head keys ``[c_kv · W_UK ++ k_pe]`` and values ``c_kv · W_UV``, 192-lane dot products), full causal
attention in float32 over whole sequences, and the indexer's top-k applied as a mask on it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attention import SparseMLA, rope_frequencies

__all__ = ["index_mask", "dense_attention"]

HIGHEST = jax.lax.Precision.HIGHEST


def index_mask(block: SparseMLA, x, lengths):
    """The indexer's choice as a mask: bool ``[B, L, L]``, True where query ``s`` attends to token ``l``.

    Scores all pairs of the ``lengths [B]`` real tokens of each sequence of ``x [B, L, hidden]``, keeps the
    causal ones and, per query, the ``index_topk`` best (all of them when fewer are causal).
    """
    c = block.config
    batch, seq_len, _ = x.shape
    position = jnp.arange(seq_len, dtype=jnp.int32)
    positions = jnp.broadcast_to(position, (batch, seq_len))
    freqs = rope_frequencies(c)
    _, _, qr = block.queries(x, positions)
    q, weights = block.indexer.queries(x, qr, positions, freqs)
    keys = block.indexer.keys(x, positions, freqs)
    logits = jnp.einsum("bshd,bld->bshl", q, keys, preferred_element_type=jnp.float32)
    scores = jnp.einsum("bshl,bsh->bsl", jax.nn.relu(logits), weights)
    real = position[None, :] < jnp.asarray(lengths)[:, None]  # [B, L]
    causal = (position[None, :, None] >= position[None, None, :]) & real[:, :, None] & real[:, None, :]
    scores = jnp.where(causal, scores, -jnp.inf)
    k = min(c.index_topk, seq_len)
    _, picked = jax.lax.top_k(scores, k)
    chosen = jnp.zeros((batch, seq_len, seq_len), bool)
    chosen = jax.vmap(jax.vmap(lambda row, cols: row.at[cols].set(True)))(chosen, picked)
    return chosen & causal


def dense_attention(block: SparseMLA, x, lengths, latent_rows=None):
    """The layer's output ``[B, L, hidden]`` for whole sequences ``x [B, L, hidden]`` of ``lengths [B]`` tokens.

    ``latent_rows [B, L, 576]`` replaces the layer's own latent rows (e.g. by those read back from a
    quantized cache, to separate quantization error from everything else). Rows past a length are 0.
    """
    c = block.config
    batch, seq_len, _ = x.shape
    positions = jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), (batch, seq_len))
    if latent_rows is None:
        latent_rows = block.latent_rows(x, positions)
    c_kv, k_pe = latent_rows[..., :c.kv_lora_rank], latent_rows[..., c.kv_lora_rank:]
    q_nope, q_pe, _ = block.queries(x, positions)
    w_uk, w_uv = (w.astype(jnp.float32) for w in block.w_uk_uv())
    k_nope = jnp.einsum("blc,chd->blhd", c_kv, w_uk, precision=HIGHEST)
    values = jnp.einsum("blc,chd->blhd", c_kv, w_uv, precision=HIGHEST)
    keys = jnp.concatenate([k_nope, jnp.broadcast_to(k_pe[:, :, None, :], (*k_nope.shape[:3], c.qk_rope_head_dim))],
                           axis=-1)
    queries = jnp.concatenate([q_nope, q_pe], axis=-1).astype(jnp.float32)  # [B, S, H, 192]
    scores = jnp.einsum("bshd,blhd->bhsl", queries, keys, precision=HIGHEST) * c.softmax_scale
    mask = index_mask(block, x, lengths)[:, None]
    scores = jnp.where(mask, scores, -jnp.inf)
    weights = jnp.where(mask, jax.nn.softmax(scores, axis=-1), 0.0)  # a row with nothing to see stays 0
    out = jnp.einsum("bhsl,blhd->bshd", weights, values, precision=HIGHEST)
    return block.wo(out.reshape(batch, seq_len, c.num_heads * c.v_head_dim).astype(c.dtype))
