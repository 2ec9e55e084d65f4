"""A dense pure-JAX version of :class:`attention.SparseMLA`, to check the paged, sparse one against.

The same layer written the way DeepSeek's reference prefill computes it, with nothing shared with the
sparse path but the parameters (the block's linear and norm layers) and the rotary embedding function:
no cache, no page table, no weight absorption (``wkv_b`` expands each latent row into per-head keys
``[k_nope ++ k_pe]`` and values, 192-lane dot products), full causal attention in float32 over whole sequences, and the
indexer's top-k applied as a mask on it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attention import SparseMLA, rope, rope_frequencies

__all__ = ["index_mask", "dense_attention"]

HIGHEST = jax.lax.Precision.HIGHEST


def index_mask(block: SparseMLA, x, lengths):
    """The indexer's choice as a mask: bool ``[B, L, L]``, True where query ``s`` attends to token ``l``.

    Scores all pairs of the ``lengths [B]`` real tokens of each sequence of ``x [B, L, hidden]``, keeps the
    causal ones and, per query, the ``index_topk`` best (all of them when fewer are causal).
    """
    c, indexer = block.config, block.indexer
    batch, seq_len, _ = x.shape
    position = jnp.arange(seq_len, dtype=jnp.int32)
    positions = jnp.broadcast_to(position, (batch, seq_len))
    freqs, rope_dim = rope_frequencies(c), c.qk_rope_head_dim

    def rope_first_lanes(v):  # the indexer's rope lanes come first and pair half-split
        return jnp.concatenate([rope(v[..., :rope_dim], positions, freqs, interleaved=False), v[..., rope_dim:]],
                               axis=-1)

    qr = block.q_norm(block.wq_a(x).astype(jnp.float32)).astype(c.dtype)
    q = rope_first_lanes(indexer.wq_b(qr).reshape(batch, seq_len, c.index_num_heads, c.index_head_dim))
    q = q.astype(jnp.bfloat16)
    keys = rope_first_lanes(indexer.k_norm(indexer.wk(x).astype(jnp.float32))).astype(jnp.bfloat16)
    weights = indexer.weights_proj(x.astype(jnp.float32)) * (c.index_num_heads ** -0.5 * c.index_head_dim ** -0.5)
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
    freqs = rope_frequencies(c)
    if latent_rows is None:
        kv = block.wkv_a(x).astype(jnp.float32)
        latent_rows = jnp.concatenate([block.kv_norm(kv[..., :c.kv_lora_rank]),
                                       rope(kv[..., c.kv_lora_rank:], positions, freqs, interleaved=True)], axis=-1)
    c_kv, k_pe = latent_rows[..., :c.kv_lora_rank], latent_rows[..., c.kv_lora_rank:]
    qr = block.q_norm(block.wq_a(x).astype(jnp.float32)).astype(c.dtype)
    q = block.wq_b(qr).reshape(batch, seq_len, c.num_heads, c.qk_head_dim)
    q_nope, q_pe = q[..., :c.qk_nope_head_dim], rope(q[..., c.qk_nope_head_dim:], positions, freqs, interleaved=True)
    kv = block.wkv_b(c_kv.astype(c.dtype)).astype(jnp.float32)
    kv = kv.reshape(batch, seq_len, c.num_heads, c.qk_nope_head_dim + c.v_head_dim)
    k_nope, values = kv[..., :c.qk_nope_head_dim], kv[..., c.qk_nope_head_dim:]
    keys = jnp.concatenate([k_nope, jnp.broadcast_to(k_pe[:, :, None, :], (*k_nope.shape[:3], c.qk_rope_head_dim))],
                           axis=-1)
    queries = jnp.concatenate([q_nope, q_pe], axis=-1).astype(jnp.float32)  # [B, S, H, 192]
    scores = jnp.einsum("bshd,blhd->bhsl", queries, keys, precision=HIGHEST) * c.softmax_scale
    mask = index_mask(block, x, lengths)[:, None]
    scores = jnp.where(mask, scores, -jnp.inf)
    weights = jnp.where(mask, jax.nn.softmax(scores, axis=-1), 0.0)  # a row with nothing to see stays 0
    out = jnp.einsum("bhsl,blhd->bshd", weights, values, precision=HIGHEST)
    return block.wo(out.reshape(batch, seq_len, c.num_heads * c.v_head_dim).astype(c.dtype))
