"""Checks the planner against measurement: calibrate, then time every candidate plan of a grid of shapes
and compare the planner's pick (calibrated and default constants) with the fastest measured choice.

    python benchmarks/planner_sweep.py --out_dir /tmp/out
"""

from __future__ import annotations

import json
import os
import tempfile

from absl import app, flags, logging

flags.DEFINE_string("out_dir", os.path.join(os.path.dirname(__file__), "results"), "Where results go.")
flags.DEFINE_string("kv_format", "dsv3_2", "Format of the sweep.")
flags.DEFINE_list("tokens", ["1", "16", "64", "128", "1024"], "Token counts.")
flags.DEFINE_list("heads", ["16", "128"], "Head counts.")
flags.DEFINE_integer("topk", 2048, "Candidates per row.")
flags.DEFINE_integer("passes", 2, "Timings of each choice (averaged).")
FLAGS = flags.FLAGS

SPLITS = (2, 4, 8, 16)
SPLITS_FEW_TOKENS = SPLITS + (32, 64)  # T <= 16 (more splits would only grow the workspace elsewhere)


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    os.environ.setdefault("JAX_SPARSE_MLA_CACHE_DIR", tempfile.mkdtemp())
    import jax_sparse_mla as jsm
    from jax_sparse_mla import calibration, kernel_tables, planner
    from jax_sparse_mla.timing import RandomCache

    device = planner.device_info("cuda")

    def progress(done, total, label):
        print(f"  calibrate [{done}/{total}] {label}", flush=True)

    # Calibration shapes (T in calibration.CALIBRATION_TOKENS, H in 16/64/128) differ from the sweep's T.
    constants = calibration.calibrate(formats=(FLAGS.kv_format,), topks=(FLAGS.topk,), force=True,
                                      progress=progress)
    print("calibrated:", json.dumps(constants), flush=True)
    cache = RandomCache(FLAGS.kv_format, seed=1)
    rows = []
    for heads in map(int, FLAGS.heads):
        for tokens in map(int, FLAGS.tokens):
            tiles = [t for t in kernel_tables.HEAD_TILES[FLAGS.kv_format] if t <= max(heads, 16)]
            choices = []
            for tile in tiles:
                choices.append(("prefill", tile, 1))
                choices += [("decode", tile, splits) for splits in (SPLITS_FEW_TOKENS if tokens <= 16 else SPLITS)]
            # Two passes over all choices (fresh index sets each), averaged: run-to-run noise of one
            # timing is several percent, more at T=1.
            timings = {key: [] for key in choices}
            for _ in range(FLAGS.passes):
                for key in choices:
                    timings[key].append(calibration.time_choice(cache, tokens, heads, FLAGS.topk, key[0], key[1], key[2]))
            measured = {key: sum(v) / len(v) for key, v in timings.items()}
            best_key = min(measured, key=measured.get)
            shape = (tokens, heads, jsm.get_format(FLAGS.kv_format).d_qk)
            picks = {}
            for label, model in (("calibrated", None), ("default", planner.CostModel())):
                p = jsm.plan(shape, FLAGS.kv_format, FLAGS.topk, platform="cuda", cost_model=model)
                key = (p.variant, p.heads_per_block, p.num_splits)
                if key not in measured:
                    measured[key] = calibration.time_choice(cache, tokens, heads, FLAGS.topk, p.variant, p.heads_per_block,
                                                           p.num_splits)
                picks[label] = (key, measured[key])
            row = {"T": tokens, "H": heads, "best": list(best_key), "best_us": measured[best_key],
                   "pick": list(picks["calibrated"][0]), "pick_us": picks["calibrated"][1],
                   "ratio": picks["calibrated"][1] / measured[best_key],
                   "default_pick": list(picks["default"][0]), "default_us": picks["default"][1],
                   "measured": {f"{k[0]}/h{k[1]}/s{k[2]}": v for k, v in measured.items()}}
            rows.append(row)
            print(json.dumps(row), flush=True)
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    with open(os.path.join(FLAGS.out_dir, "planner_sweep.json"), "w") as f:
        json.dump({"device": device.name, "constants": constants, "rows": rows}, f, indent=1)
    lines = [f"planner sweep on {device.name}, {FLAGS.kv_format}, topk={FLAGS.topk}",
             "| T | H | best (variant/tile/splits) | best µs | planner pick | pick µs | pick/best | default pick | "
             "default µs |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['T']} | {r['H']} | {'/'.join(map(str, r['best']))} | {r['best_us']:.1f} | "
                     f"{'/'.join(map(str, r['pick']))} | {r['pick_us']:.1f} | {r['ratio']:.2f} | "
                     f"{'/'.join(map(str, r['default_pick']))} | {r['default_us']:.1f} |")
    within = sum(r["ratio"] <= 1.10 for r in rows)
    lines.append(f"planner pick within 10% of the best measured choice: {within}/{len(rows)}")
    lines.append("")
    lines.append("\"default pick\" uses the planner's built-in constants; \"planner pick\" the calibrated ones:")
    lines.append(json.dumps(constants))
    with open(os.path.join(FLAGS.out_dir, "planner_sweep.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n" + "\n".join(lines))
    return 0


if __name__ == "__main__":
    app.run(main)
