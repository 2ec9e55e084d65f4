"""Checks the planner against measurement: calibrate, then time every candidate plan of a grid of shapes
and compare the planner's pick (calibrated and default constants) and its predicted time with the
fastest measured choice.

    python benchmarks/planner_sweep.py --out_dir /tmp/out                  # GPU: calibrate + sweep
    python benchmarks/planner_sweep.py --replay benchmarks/results/planner_sweep.json
        # any machine: the current default constants' picks and predictions against a recorded sweep
    python benchmarks/planner_sweep.py --replay a.json,b.json --refit 3000
        # constants judged (and refitted) on several recorded sweeps at once, e.g. one per format

Every choice's measured time is recorded, so ``--replay`` judges the built-in constants on the
measurements of the GPU run without a GPU (the constants are refitted from a calibration run and then
checked this way).
"""

from __future__ import annotations

import json
import os
import tempfile

from absl import app, flags, logging

flags.DEFINE_string("out_dir", os.path.join(os.path.dirname(__file__), "results"), "Where results go.")
flags.DEFINE_string("kv_format", "dsv3_2", "Format of the sweep.")
flags.DEFINE_list("tokens", ["1", "2", "4", "8", "16", "32", "64"], "Token counts.")
flags.DEFINE_list("heads", ["16", "64", "128"], "Head counts.")
flags.DEFINE_integer("topk", 2048, "Candidates per row.")
flags.DEFINE_list("calibrate_formats", [], "Formats calibrated before the sweep (default: the sweep's format and "
                  "calibration.CALIBRATION_FORMATS, as `calibrate` measures by default); 'none': no calibration, "
                  "the calibrated column then judges the default constants.")
flags.DEFINE_integer("passes", 1, "Timings of each choice (averaged).")
flags.DEFINE_list("replay", [], "Recorded planner_sweep.json files: evaluate the default constants on them (no GPU).")
flags.DEFINE_integer("refit", 0, "With --replay: constant sets to try around the first file's calibrated ones.")
FLAGS = flags.FLAGS

def sweep_choices(kv_format, tokens, topk):
    """{key: (variant, head tile, splits)} timed per shape: every head tile the planner weighs (also
    those wider than H), each with prefill and decode at every split count of the planner's (as the
    plans have them: whole granules); beyond T = 16 none above 16 splits (the picks there have at most
    8, and a pick outside the grid is timed on its own)."""
    from jax_sparse_mla import kernel_tables, planner

    choices = {}
    positions = kernel_tables.decode_positions(kv_format, topk)
    for tile in kernel_tables.HEAD_TILES[kv_format]:
        choices[choice_key("prefill", tile, 1)] = ("prefill", tile, 1)
        for splits in planner.SPLIT_CHOICES:
            if tokens <= 16 or splits <= 16:
                _, splits = planner.split_layout(positions, splits)
                choices.setdefault(choice_key("decode", tile, splits), ("decode", tile, splits))
    return choices


def choice_key(variant, tile, splits) -> str:
    return f"{variant}/h{tile}/s{splits}"


def evaluate(measured: dict, shape, kv_format, topk, model, device):
    """(pick key, its measured µs or None when it was not timed, predicted µs) of one model's plan."""
    import jax_sparse_mla as jsm

    p = jsm.plan(shape, kv_format, topk, platform="cuda", cost_model=model, device=device)
    key = choice_key(p.variant, p.heads_per_block, p.num_splits)
    return key, measured.get(key), p.predicted_us


def table(device_name, kv_format, topk, rows, constants, default_constants, calibrated="calibrated") -> str:
    """The sweep as markdown; ``calibrated`` names the run's constants (``"run's"`` for a run that did
    not calibrate and planned with the defaults of its day)."""
    lines = [f"planner sweep on {device_name}, {kv_format}, topk={topk}; µs measured (predicted)",
             f"| T | H | best (variant/tile/splits) | best µs | {calibrated} pick | µs (predicted) | pick/best | "
             "default pick | µs (predicted) | default/best |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['T']} | {r['H']} | {r['best']} | {r['best_us']:.1f} | {r['pick']} | {r['pick_us']:.1f} "
            f"({r['pick_predicted_us']:.1f}) | {r['ratio']:.2f} | {r['default_pick']} | {r['default_us']:.1f} "
            f"({r['default_predicted_us']:.1f}) | {r['default_ratio']:.2f} |")
    within = sum(r["ratio"] <= 1.10 for r in rows)
    default_within = sum(r["default_ratio"] <= 1.10 for r in rows)
    lines.append(f"{calibrated} pick within 10% of the best measured choice: {within}/{len(rows)}; "
                 f"default constants: {default_within}/{len(rows)}")
    lines.append("")
    lines.append(f"{calibrated} constants: " + json.dumps(constants))
    lines.append("default constants: " + json.dumps(default_constants))
    return "\n".join(lines) + "\n"


def run_label(data) -> str:
    """What a recorded run's own constants were: calibrated, or (``--calibrate_formats none``) its defaults."""
    return "run's" if data.get("calibrated_formats") == ["none"] else "calibrated"


def judge(data, model):
    """Each recorded shape with ``model``'s pick, its measured and predicted µs; None if a pick was not
    timed in the run."""
    from jax_sparse_mla import get_format, planner

    device = planner.DEFAULT_CUDA_DEVICE
    kv_format, topk = data.get("kv_format", "dsv3_2"), data.get("topk", 2048)
    rows = []
    for r in data["rows"]:
        shape = (r["T"], r["H"], get_format(kv_format).d_qk)
        key, us, predicted = evaluate(r["measured"], shape, kv_format, topk, model, device)
        if us is None:
            return None
        rows.append({**r, "default_pick": key, "default_us": us, "default_predicted_us": predicted,
                     "default_ratio": us / r["best_us"]})
    return rows


#: Constants the refit keeps at the run's calibrated values: the sweep's grid has few plans whose blocks
#: share an SM (the 16-head tiles of other formats run co-resident where dsv3_2's run one an SM), so it
#: does not pin the co-residency gain, while calibrate() times such plans at larger T.
CALIBRATED_ONLY = ("co_residency_gain",)


#: Constants a run's calibration may lack (recorded before the model had them), each with the one it
#: starts from in a refit.
COUNTERPARTS = {"portable_block_us": "block_us", "portable_dequant_ns": "dequant_ns",
                "exact_scales_row_ns": "dequant_ns", "direct_row_ns": "dequant_ns",
                "warp_combine_gbps": "combine_gbps"}


def refit(datas, tries, seed=0):
    """A seeded search from the first run's calibrated constants: ``tries`` log-normal steps (all
    constants but CALIBRATED_ONLY), each kept when its picks are within 10% of the best on more shapes
    of all ``datas``, or on as many with a smaller max + mean |log(predicted / measured)| over the
    picks. Returns the best constants found."""
    import math
    import random

    from jax_sparse_mla import planner

    rng = random.Random(seed)
    calibrated = dict(datas[0]["constants"])
    for name, counterpart in COUNTERPARTS.items():
        calibrated.setdefault(name, calibrated.get(counterpart, getattr(planner.CostModel(), counterpart)))
    best = None
    for i in range(tries):
        values = planner.CostModel.from_dict(calibrated).to_dict() if best is None else {
            k: v * math.exp(rng.gauss(0.0, 0.25 if i < tries // 2 else 0.1))
            if k not in CALIBRATED_ONLY and isinstance(v, float) else v  # per-format tables are kept
            for k, v in best[1].items()}
        judged = [judge(data, planner.CostModel(**values)) for data in datas]
        if any(rows is None for rows in judged):
            continue
        rows = [r for file_rows in judged for r in file_rows]
        errors = [abs(math.log(r["default_predicted_us"] / r["default_us"])) for r in rows]
        objective = (-sum(r["default_ratio"] <= 1.10 for r in rows), max(errors) + sum(errors) / len(errors))
        if best is None or objective < best[0]:
            best = (objective, values)
    return best[1]


def replay(paths, tries):
    """The built-in constants' picks on recorded sweeps (every choice was timed there); with ``tries``,
    those of the best constants refitted to all of them instead. 0 when every pick of every sweep is
    within 10% of that shape's best."""
    from jax_sparse_mla import planner

    datas = [json.load(open(path)) for path in paths]
    model = planner.CostModel()
    if tries:
        model = planner.CostModel(**{k: float(f"{v:.3g}") if isinstance(v, float) else v
                                     for k, v in refit(datas, tries).items()})
        print("refitted constants (3 significant digits):", json.dumps(model.to_dict()))
    ok = True
    for path, data in zip(paths, datas):
        rows = judge(data, model)
        if rows is None:
            raise SystemExit(f"a pick of the constants was not timed in {path}")
        print(path)
        print(table(data["device"], data.get("kv_format", "dsv3_2"), data.get("topk", 2048), rows,
                    data["constants"], model.to_dict(), run_label(data)))
        ok = ok and all(r["default_ratio"] <= 1.10 for r in rows)
    return 0 if ok else 1


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    if FLAGS.replay:
        return replay(FLAGS.replay, FLAGS.refit)
    os.environ.setdefault("JAX_SPARSE_MLA_CACHE_DIR", tempfile.mkdtemp())
    import jax_sparse_mla as jsm
    from jax_sparse_mla import calibration, planner
    from jax_sparse_mla.timing import RandomCache

    device = planner.device_info("cuda")

    def progress(done, total, label):
        print(f"  calibrate [{done}/{total}] {label}", flush=True)

    # Calibration shapes (T in calibration.CALIBRATION_TOKENS, H in 16/64/128) differ from the sweep's T.
    formats = FLAGS.calibrate_formats or list(dict.fromkeys((FLAGS.kv_format,) + calibration.CALIBRATION_FORMATS))
    if formats == ["none"]:
        constants = planner.CostModel().to_dict()
    else:
        constants = calibration.calibrate(formats=formats, topks=(FLAGS.topk,), force=True, progress=progress)
    print("calibrated:", json.dumps(constants), flush=True)
    calibrated_model = planner.CostModel.from_dict(constants)
    default_model = planner.CostModel()
    cache = RandomCache(FLAGS.kv_format, seed=1)
    rows = []
    for heads in map(int, FLAGS.heads):
        for tokens in map(int, FLAGS.tokens):
            timings = {}
            choices = sweep_choices(FLAGS.kv_format, tokens, FLAGS.topk)
            for _ in range(FLAGS.passes):
                for key, (variant, tile, splits) in choices.items():
                    timings.setdefault(key, []).append(
                        calibration.time_choice(cache, tokens, heads, FLAGS.topk, variant, tile, splits))
            measured = {key: sum(v) / len(v) for key, v in timings.items()}
            shape = (tokens, heads, jsm.get_format(FLAGS.kv_format).d_qk)
            picks = {}
            for label, model in (("calibrated", calibrated_model), ("default", default_model)):
                key, us, predicted = evaluate(measured, shape, FLAGS.kv_format, FLAGS.topk, model, device)
                if us is None:
                    variant, tile, splits = key.split("/")
                    us = measured[key] = calibration.time_choice(cache, tokens, heads, FLAGS.topk, variant,
                                                                 int(tile[1:]), int(splits[1:]))
                picks[label] = (key, us, predicted)
            best_key = min(measured, key=measured.get)
            row = {"T": tokens, "H": heads, "best": best_key, "best_us": measured[best_key],
                   "pick": picks["calibrated"][0], "pick_us": picks["calibrated"][1],
                   "pick_predicted_us": picks["calibrated"][2], "ratio": picks["calibrated"][1] / measured[best_key],
                   "default_pick": picks["default"][0], "default_us": picks["default"][1],
                   "default_predicted_us": picks["default"][2],
                   "default_ratio": picks["default"][1] / measured[best_key], "measured": measured}
            rows.append(row)
            print(json.dumps(row), flush=True)
            # Written after every shape, so a run cut short keeps what it timed.
            record = {"device": device.name, "kv_format": FLAGS.kv_format, "topk": FLAGS.topk,
                      "constants": constants, "calibrated_formats": formats,
                      "default_constants": default_model.to_dict(), "rows": rows}
            os.makedirs(FLAGS.out_dir, exist_ok=True)
            with open(os.path.join(FLAGS.out_dir, "planner_sweep.json"), "w") as f:
                json.dump(record, f, indent=1)
    text = table(device.name, FLAGS.kv_format, FLAGS.topk, rows, constants, default_model.to_dict(),
                 run_label({"calibrated_formats": formats}))
    with open(os.path.join(FLAGS.out_dir, "planner_sweep.md"), "w") as f:
        f.write(text)
    print("\n" + text)
    return 0


if __name__ == "__main__":
    app.run(main)
