"""What converting arbitrary FP32 scales like the others would cost in accuracy (no GPU needed).

The kernels hold a `glm_*` row in the BF16 tile as FP8 × 2^e (exact) and apply each scale's mantissa
to the scores and to P in FP32, so K and V enter the products exactly. The alternative a loader has
for every other off-path scale is FP8 × scale in FP32 rounded once to BF16: the scale is still
applied at float32 precision, but each K and V lane is rounded to 8 significant bits. This script
measures both against the float64 reference of the default bounds (the dequantized cache), with P
rounded to BF16 in both as the kernels do, on random queries over a random `glm_nsa` cache quantized
by `quantize_kv`, and with the scores sharpened (query × 4 and × 16, as attention in trained models
can be).

    python benchmarks/scale_rounding_accuracy.py [--out benchmarks/results/scale_rounding_accuracy.md]
"""

from __future__ import annotations

import argparse

import ml_dtypes
import numpy as np

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


def measure(kv_format: str, tokens: int, heads: int, topk: int, sharpen: float, seed: int = 0):
    """{"exact tile": (max, relative L2), "FP32 path": (max, relative L2)} of the output."""
    rng = np.random.default_rng(seed)
    fmt = jsm.get_format(kv_format)
    pool = max(4096, topk)
    kv = rng.standard_normal((pool, fmt.d_qk)).astype(np.float32)
    cache = np.asarray(jsm.quantize_kv(kv, kv_format))
    exact = np.asarray(jsm.dequantize_kv(cache, kv_format)[0], np.float64)
    q = _bf16(rng.standard_normal((tokens, heads, fmt.d_qk)) * sharpen)
    indices = np.stack([rng.choice(pool, topk, replace=False) for _ in range(tokens)])

    def attend(rows: np.ndarray, round_p: bool) -> np.ndarray:
        k = rows[indices]
        scores = np.einsum("thd,tkd->thk", q, k) * fmt.d_qk ** -0.5
        p = np.exp(scores - scores.max(-1, keepdims=True))
        total = p.sum(-1, keepdims=True)
        return np.einsum("thk,tkd->thd", _bf16(p) if round_p else p, k[..., :fmt.d_v]) / total

    ref = attend(exact, False)
    rows = {}
    for name, tile in (("exact tile", exact), ("FP32 path", rounded_rows(cache, kv_format))):
        out = attend(tile, True)
        rows[name] = (np.abs(out - ref).max() / max(1.0, np.abs(ref).max()),
                      np.linalg.norm(out - ref) / np.linalg.norm(ref))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="", help="also write the table (markdown) here")
    args = parser.parse_args()
    lines = [f"Arbitrary FP32 scales: the exact tile against the FP32 conversion path (bounds: max {BOUND_MAX:g}, "
             f"relative L2 {BOUND_L2:g}); max / relative L2 error of the output against the float64 reference",
             "", "| format | T | H | topk | scores | exact tile | FP32 path |", "|---|---|---|---|---|---|---|"]
    for kv_format in ("glm_nsa", "glm53_nope"):
        for topk in (64, 2048):
            for sharpen, label in ((1.0, "random"), (4.0, "sharpened ×4"), (16.0, "sharpened ×16")):
                rows = measure(kv_format, 4, 16, topk, sharpen)
                cells = " | ".join(f"{m:.2e} / {l2:.2e}" for m, l2 in rows.values())
                lines.append(f"| {kv_format} | 4 | 16 | {topk} | {label} | {cells} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
