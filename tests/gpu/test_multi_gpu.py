"""shard_map helpers on several GPUs: values equal the unsharded call (skipped with fewer than 2 GPUs)."""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

import oracle  # noqa: E402

import jax_sparse_mla as jsm  # noqa: E402


def _gpus():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(len(_gpus()) < 2, reason="needs at least 2 GPUs")]


def _inputs(rng, shards, key="dsv4", tokens_per_shard=6, heads=32, topk=96, pages_per_rank=8):
    fmt = jsm.get_format(key)
    kv = rng.standard_normal((shards * pages_per_rank * 64, fmt.d_qk)).astype(np.float32)
    caches = np.concatenate([oracle.quantize(kv[r * pages_per_rank * 64:(r + 1) * pages_per_rank * 64], key, 64)
                             for r in range(shards)])
    local = rng.integers(-2, pages_per_rank * 64 + 2, (shards * tokens_per_shard, topk)).astype(np.int32)
    q = rng.standard_normal((shards * tokens_per_shard, heads, fmt.d_qk)).astype(jnp.bfloat16)
    sink = rng.standard_normal(heads).astype(np.float32)
    return fmt, jnp.asarray(q), jnp.asarray(caches), jnp.asarray(local), jnp.asarray(sink), pages_per_rank


@pytest.mark.parametrize("layout", ["tensor", "expert", "both"])
def test_sharded_equals_unsharded_on_gpus(layout):
    rng = np.random.default_rng(11)
    devices = _gpus()[:2]
    shards = 2
    fmt, q, caches, local, sink, pages = _inputs(rng, shards)
    counts = jnp.asarray([6, 0], jnp.int32)  # the second shard is empty
    if layout == "tensor":
        mesh = jax.sharding.Mesh(np.array(devices), ("tp",))
        attend = jsm.sharded_sparse_mla(mesh, head_axis="tp", kv_format=fmt.key, sm_scale=0.05)
        cache0 = caches[:pages]
        out, lse = jax.jit(attend)(q, cache0, local, attn_sink=sink)
        half = q.shape[1] // shards  # each shard's problem, run unsharded: same plan, so the same bits
        parts = [jsm.sparse_mla(q[:, r * half:(r + 1) * half], cache0, local, kv_format=fmt.key, sm_scale=0.05,
                                attn_sink=sink[r * half:(r + 1) * half]) for r in range(shards)]
        ref_out = jnp.concatenate([p[0] for p in parts], axis=1)
        ref_lse = jnp.concatenate([p[1] for p in parts], axis=1)
    else:
        shape = (2,) if layout == "expert" else (2, 1)
        names = ("ep",) if layout == "expert" else ("ep", "tp")
        mesh = jax.sharding.Mesh(np.array(devices).reshape(shape), names)
        attend = jsm.sharded_sparse_mla(mesh, token_axis="ep", head_axis=None if layout == "expert" else "tp",
                                        kv_format=fmt.key, sm_scale=0.05)
        out, lse = jax.jit(attend)(q, caches, local, attn_sink=sink, valid_tokens=counts)
        rows = q.shape[0] // shards
        parts = [jsm.sparse_mla(q[r * rows:(r + 1) * rows], caches[r * pages:(r + 1) * pages],
                                local[r * rows:(r + 1) * rows], kv_format=fmt.key, sm_scale=0.05, attn_sink=sink,
                                valid_tokens=counts[r]) for r in range(shards)]
        ref_out = jnp.concatenate([p[0] for p in parts])
        ref_lse = jnp.concatenate([p[1] for p in parts])
        assert np.all(np.asarray(out[rows:]) == 0) and np.all(np.asarray(lse[rows:]) == -np.inf)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref_out))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(ref_lse))


# The sharded decode step in a subprocess with command buffers on (XLA flags must precede backend start):
# after the first capture, replays with fresh index values in the same donated buffers never re-enter
# the handler, and every result equals the unsharded calls of the shards.
_CAPTURE_SCRIPT = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
import jax_sparse_mla as jsm
from jax_sparse_mla import _ffi
devices = jax.devices("gpu")[:2]
mesh = jax.sharding.Mesh(np.array(devices).reshape(2, 1), ("ep", "tp"))
rng = np.random.default_rng(5)
pages = 8
kv = rng.standard_normal((2 * pages * 64, 576)).astype(np.float32)
caches = jnp.concatenate([jsm.quantize_kv(jnp.asarray(kv[r * pages * 64:(r + 1) * pages * 64]), "dsv3_2")
                          for r in range(2)])
attend = jsm.sharded_sparse_mla(mesh, token_axis="ep", kv_format="dsv3_2", sm_scale=0.05)
counts = jnp.asarray([4, 0], jnp.int32)

def step(q, indices, seed):
    out, lse = attend(q, caches, indices, valid_tokens=counts)
    key = jax.random.fold_in(jax.random.PRNGKey(0), seed)
    next_indices = jax.random.randint(key, indices.shape, -4, pages * 64 + 4, jnp.int32)
    return out, lse, next_indices, seed + 1

run = jax.jit(step, donate_argnums=(1, 2))
q = jnp.asarray(rng.standard_normal((8, 16, 576)), jnp.bfloat16)
indices = jnp.asarray(rng.integers(0, pages * 64, (8, 64)), jnp.int32)
seed, results, invocations = jnp.int32(0), [], []
for _ in range(20):
    host_indices = np.asarray(indices)
    out, lse, indices, seed = run(q, indices, seed)
    results.append((host_indices, np.asarray(out, np.float32), np.asarray(lse)))
    invocations.append(_ffi.cuda_handler_invocations())
worst = 0.0  # the unsharded calls run after the loop, so they do not count as handler invocations above
for host_indices, out, lse in results:
    ref, _ = jsm.sparse_mla(q[:4], caches[:pages], host_indices[:4], kv_format="dsv3_2", sm_scale=0.05)
    worst = max(worst, float(np.max(np.abs(out[:4] - np.asarray(ref, np.float32)))))
    assert np.all(out[4:] == 0) and np.all(lse[4:] == -np.inf)
print(json.dumps({"worst": worst, "invocations": invocations}))
"""


def test_sharded_step_is_captured_in_command_buffers(tmp_path):
    import json
    import subprocess

    script = tmp_path / "capture.py"
    script.write_text(_CAPTURE_SCRIPT)
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false",
               XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1")
    result = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["worst"] == 0.0
    calls = report["invocations"]
    assert calls[-1] - calls[1] <= 2 * 2, calls  # captured once per device (plus at most a re-capture each)
