"""What converting arbitrary FP32 scales like the others would cost in accuracy (no GPU needed).

The kernels hold a `glm_*` row in the BF16 tile as FP8 × 2^e (exact) and apply each scale's mantissa
to the scores and to P in FP32, so K and V enter the products exactly. The alternative a loader has
for every other off-path scale is FP8 × scale in FP32 rounded once to BF16: the scale is still
applied at float32 precision, but each K and V lane is rounded to 8 significant bits. This script
measures both against the float64 reference of the default bounds (the dequantized cache), with P
rounded to BF16 in both as the kernels do, on random queries over a random `glm_nsa` cache quantized
by `quantize_kv`, and with the scores sharpened (query × 4 and × 16, as attention in trained models
can be).

A third column models a tile of FP16 lanes (11 significant bits, where BF16 has 8): each row's
quantized lanes as FP8 × scale × 2^-E in FP32 rounded once to FP16, E the exponent of the row's largest
group scale (so every lane stays below 2^10 and the factor 2^E is exact, applied to the row's scores
and to P in FP32), the BF16 lanes as stored, and P rounded to FP16 after the factor 2^(E - E_max) of
its row (E_max: the largest E among the row's candidates, so P stays at most 1). It is not built: it
too rounds the scaled lanes to 16 bits, and leaves the bounds on rows of spread sizes (the
"rows × 2^±8" cases: each row of the cache times 2^u, u uniform in [-8, 8]).

    python benchmarks/scale_rounding_accuracy.py [--out benchmarks/results/scale_rounding_accuracy.md]
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

import accuracy_tables
import jax_sparse_mla as jsm

BOUND_MAX, BOUND_L2 = 2e-2, 1e-2  # default precision: max |out - ref| / max(1, max |ref|), relative L2


def _bf16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def rounded_rows(cache: np.ndarray, kv_format: str) -> np.ndarray:
    """The rows as the FP32 conversion path would put them in a tile: each quantized lane's FP8 value
    times its group's scale in float32, rounded once to BF16 (the BF16 lanes as stored)."""
    fmt = jsm.get_format(kv_format)
    exact = np.asarray(jsm.dequantize_kv(cache, kv_format)[0], np.float64)
    lanes = fmt.quant_dim
    # dequantize_kv's quantized lanes are the float32 products FP8 × scale, as the loader's FP32 multiply
    # gives them; the FP32 path then rounds each once to BF16.
    return np.concatenate([_bf16(exact[:, :lanes]), exact[:, lanes:]], axis=1)


def _fp16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float32).astype(np.float16).astype(np.float64)


def row_exponents(cache: np.ndarray, kv_format: str) -> np.ndarray:
    """E of each row: the exponent of its largest group scale (frexp's, less one: 2^E <= scale < 2^(E+1))."""
    fmt = jsm.get_format(kv_format)
    rows = cache.reshape(-1, fmt.bytes_per_token)
    scales = np.ascontiguousarray(rows[:, fmt.scale_offset:fmt.scale_offset + 4 * fmt.num_groups]).view(np.float32)
    return np.frexp(scales.max(axis=1).astype(np.float64))[1] - 1


def fp16_rows(cache: np.ndarray, kv_format: str) -> tuple:
    """(rows, E): the rows as an FP16 tile would hold them, with the factor 2^E of each row applied back."""
    fmt = jsm.get_format(kv_format)
    exact = np.asarray(jsm.dequantize_kv(cache, kv_format)[0], np.float64)
    e = row_exponents(cache, kv_format)
    lanes = fmt.quant_dim
    scaled = _fp16(exact[:, :lanes] * np.ldexp(1.0, -e)[:, None]) * np.ldexp(1.0, e)[:, None]
    return np.concatenate([scaled, exact[:, lanes:]], axis=1), e


def measure(kv_format: str, tokens: int, heads: int, topk: int, sharpen: float, spread: float = 0.0, seed: int = 0):
    """{"exact tile" | "FP32 path" | "FP16 tile": (max, relative L2)} of the output."""
    rng = np.random.default_rng(seed)
    fmt = jsm.get_format(kv_format)
    pool = max(4096, topk)
    # spread > 0: each row times 2^u, u uniform in [-spread, spread] (rows, and so their E, of different sizes)
    kv = rng.standard_normal((pool, fmt.d_qk))
    if spread > 0:
        kv = kv * np.exp2(rng.uniform(-spread, spread, (pool, 1)))
    kv = kv.astype(np.float32)
    cache = np.asarray(jsm.quantize_kv(kv, kv_format))
    exact = np.asarray(jsm.dequantize_kv(cache, kv_format)[0], np.float64)
    q = _bf16(rng.standard_normal((tokens, heads, fmt.d_qk)) * sharpen)
    indices = np.stack([rng.choice(pool, topk, replace=False) for _ in range(tokens)])

    def attend(rows: np.ndarray, round_p, exponents=None) -> np.ndarray:
        k = rows[indices]
        scores = np.einsum("thd,tkd->thk", q, k) * fmt.d_qk ** -0.5
        p = np.exp(scores - scores.max(-1, keepdims=True))
        total = p.sum(-1, keepdims=True)
        if exponents is not None:  # P · 2^(E - E_max) rounded to FP16, then the factor 2^(E_max - E) back
            shift = exponents[indices] - exponents[indices].max(-1, keepdims=True)  # [T, topk] <= 0
            p = round_p(p * np.ldexp(1.0, shift)[:, None, :]) * np.ldexp(1.0, -shift)[:, None, :]
        elif round_p is not None:
            p = round_p(p)
        return np.einsum("thk,tkd->thd", p, k[..., :fmt.d_v]) / total

    ref = attend(exact, None)
    fp16_tile, exponents = fp16_rows(cache, kv_format)
    rows = {}
    for name, tile, round_p, e in (("exact tile", exact, _bf16, None),
                                   ("FP32 path", rounded_rows(cache, kv_format), _bf16, None),
                                   ("FP16 tile", fp16_tile, _fp16, exponents)):
        out = attend(tile, round_p, e)
        rows[name] = accuracy_tables.errors(out, ref)
    return rows


def table_lines():
    """The table's markdown lines."""
    lines = [f"Arbitrary FP32 scales: the exact tile against the FP32 conversion path and an FP16 tile (bounds: "
             f"max {BOUND_MAX:g}, relative L2 {BOUND_L2:g}); max / relative L2 error of the output against the "
             "float64 reference",
             "", "| format | T | H | topk | scores | exact tile | FP32 path | FP16 tile |", "|---|---|---|---|---|---|---|---|"]
    for kv_format in ("glm_nsa", "glm53_nope"):
        for topk in (64, 512, 2048):
            for sharpen, spread, label in ((1.0, 0, "random"), (4.0, 0, "sharpened ×4"), (16.0, 0, "sharpened ×16"),
                                           (1.0, 8, "random, rows × 2^±8"), (4.0, 8, "sharpened ×4, rows × 2^±8")):
                rows = measure(kv_format, 4, 16, topk, sharpen, spread)
                lines.append(f"| {kv_format} | 4 | 16 | {topk} | {label} | {accuracy_tables.cells(rows)} |")
    return lines


if __name__ == "__main__":
    accuracy_tables.main(__doc__.splitlines()[0], table_lines)
