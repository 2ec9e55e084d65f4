"""Measures the planner's per-format constants on the local GPU: the row factors
(``planner.CostModel.row_factors``) and the staging pass's rate (``CostModel.stage_gbps_by_format``).

Row factors: the prefill of each format against the format its row conversion's constant is fitted
on (``calibration.ROW_FACTOR_REFERENCES``), on every Hopper-family head tile, at
``calibration.ROW_FACTOR_SHAPES``, and the factors that make the built-in model's predictions stand as
the measured times do (``calibration.measure_row_factors``). Staging: the copy pass of every stageable
format (``calibration.measure_stage_rates``). Prints both tables and writes
``<out_dir>/format_costs.json``.

    python benchmarks/format_costs.py --out_dir /tmp/out
"""

from __future__ import annotations

import json
import os

from absl import app, flags

flags.DEFINE_string("out_dir", os.path.join(os.path.dirname(__file__), "results"), "Where results go.")
flags.DEFINE_list("formats", ["dsv3_2", "dsv4", "dsv4_1", "dsv4_nvfp4", "dsv4_1_fp4", "glm53_nope", "bf16_512"],
                  "Formats to measure (references get no row factor; formats without staging no rate).")
FLAGS = flags.FLAGS


def main(argv):
    del argv
    import jax

    from jax_sparse_mla import calibration, planner

    device = planner.device_info("cuda")
    if device is planner.DEFAULT_CUDA_DEVICE:
        raise SystemExit("format_costs.py needs a local CUDA device")
    rows = []

    def progress(kv_format, tile, us, reference_us, factor):
        shape = calibration.ROW_FACTOR_SHAPES[tile]
        rows.append(dict(kv_format=kv_format, head_tile=tile, tokens=shape[0], heads=shape[1], us=us,
                         reference_us=reference_us, factor=factor))
        print(json.dumps(rows[-1]), flush=True)

    model = planner.CostModel()
    caches = {}  # one random cache per format for both measurements
    factors = calibration.measure_row_factors(device, model, FLAGS.formats, progress, caches=caches)
    stageable = [f for f in FLAGS.formats if planner.staging_format(f) is not None]
    rates = calibration.measure_stage_rates(model, stageable, caches)[:len(stageable)]  # the measured ones
    name = jax.devices()[0].device_kind
    lines = [f"Per-format planner constants on {name}, topk 2048. Row factors: prefill time of each format over "
             f"its reference format's ({calibration.ROW_FACTOR_REFERENCES}) and the factor that makes the "
             "built-in model agree.", "",
             "| format | head tile | T | H | µs | reference µs | ratio | factor |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['kv_format']} | {r['head_tile']} | {r['tokens']} | {r['heads']} | {r['us']:.1f} | "
              f"{r['reference_us']:.1f} | {r['us'] / r['reference_us']:.3f} | {r['factor']:.3f} |" for r in rows]
    lines += ["", "Staging pass (the cache read and its BF16 copy written over the pass's median time):", "",
              "| format | GB/s |", "|---|---|"]
    lines += [f"| {key} | {gbps:.0f} |" for key, gbps in rates]
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    with open(os.path.join(FLAGS.out_dir, "format_costs.json"), "w") as f:
        json.dump({"device": name, "rows": rows, "row_factors": factors, "stage_gbps_by_format": rates}, f, indent=1)
    print("\n".join(lines))
    print("row_factors =", factors)
    print("stage_gbps_by_format =", tuple((k, round(g)) for k, g in rates))
    return 0


if __name__ == "__main__":
    app.run(main)
