"""What FP8 for P·V would cost in accuracy under `precision="fp8"` (no GPU needed).

A kernel that runs P·V in FP8 reads V as the cache stores it (e4m3 lanes; the group scales folded into
P) and rounds P to e4m3. This script measures that rounding alone, against the float64 reference the
`precision="fp8"` bounds are stated against (the dequantized cache and the FP8-quantized query): the
output with P rounded to BF16 (the 16-bit P·V of today's kernels), to e4m3 as P·2^8 (one power-of-two
scale a tile), and to e4m3 with P split into two e4m3 terms (hi + lo: two FP8 products). Scores are
exact (float64), so the difference is P's rounding only. Shapes: random queries over a random cache, as
the test matrix draws them, and the same with the scores sharpened (query × 4), for each index width.

    python benchmarks/fp8_pv_accuracy.py [--out benchmarks/results/fp8_pv_accuracy.md]
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

import accuracy_tables
import jax_sparse_mla as jsm

BOUND_MAX, BOUND_L2 = 4e-2, 2.5e-2  # precision="fp8": max |out - ref| / max(1, max |ref|), relative L2


def _e4m3(x: np.ndarray) -> np.ndarray:
    return np.clip(x, -448.0, 448.0).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)


def _round_p(p: np.ndarray, mode: str) -> np.ndarray:
    if mode == "bf16":
        return p.astype(ml_dtypes.bfloat16).astype(np.float64)
    if mode == "e4m3":
        return _e4m3(p * 256.0) / 256.0
    if mode == "e4m3 hi+lo":
        hi = _e4m3(p * 256.0) / 256.0
        return hi + _e4m3((p - hi) * 256.0 * 16.0) / (256.0 * 16.0)
    raise ValueError(mode)


def measure(kv_format: str, tokens: int, heads: int, topk: int, sharpen: float, seed: int = 0):
    rng = np.random.default_rng(seed)
    fmt = jsm.get_format(kv_format)
    pool = max(4096, topk)
    kv = rng.standard_normal((pool, fmt.d_qk)).astype(np.float32)
    cache = jsm.quantize_kv(kv, kv_format)
    keys = np.asarray(jsm.dequantize_kv(cache, kv_format)[0], np.float64)  # the values the kernels read
    q = rng.standard_normal((tokens, heads, fmt.d_qk)).astype(np.float32) * sharpen
    q = np.asarray(jsm.quantize_query_fp8(q), np.float64)
    indices = np.stack([rng.choice(pool, topk, replace=False) for _ in range(tokens)])
    k = keys[indices]  # [T, topk, d_qk]
    v = k[..., :fmt.d_v]
    scores = np.einsum("thd,tkd->thk", q, k) * fmt.d_qk ** -0.5
    p = np.exp(scores - scores.max(-1, keepdims=True))
    total = p.sum(-1, keepdims=True)  # the row sum stays in FP32 in a kernel: exact here
    ref = np.einsum("thk,tkd->thd", p, v) / total
    rows = {}
    for mode in ("bf16", "e4m3", "e4m3 hi+lo"):
        out = np.einsum("thk,tkd->thd", _round_p(p, mode), v) / total
        rows[mode] = accuracy_tables.errors(out, ref)
    return rows


def table_lines():
    """The table's markdown lines."""
    lines = [f"P·V rounding under precision=\"fp8\" (bounds: max {BOUND_MAX:g}, relative L2 {BOUND_L2:g}); "
             "max / relative L2 error of the output against the float64 reference",
             "| format | T | H | topk | scores | P in BF16 | P in e4m3 | P in e4m3 hi+lo |",
             "|---|---|---|---|---|---|---|---|"]
    for kv_format in ("dsv3_2", "dsv4"):
        for topk in (16, 256, 2048):
            for sharpen, label in ((1.0, "random"), (4.0, "sharpened ×4")):
                rows = measure(kv_format, 8, 16, topk, sharpen)
                lines.append(f"| {kv_format} | 8 | 16 | {topk} | {label} | {accuracy_tables.cells(rows)} |")
    return lines


if __name__ == "__main__":
    accuracy_tables.main(__doc__.splitlines()[0], table_lines)
