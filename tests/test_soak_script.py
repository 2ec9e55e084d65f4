"""The GPU soak script's machinery (random configurations, on-device data, the CPU check, the summary),
run on the CPU kernel so CI catches a broken soak before a GPU session does."""

from __future__ import annotations

import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "gpu"))

import soak  # noqa: E402

import jax_sparse_mla as jsm  # noqa: E402
from jax_sparse_mla import planner, validate  # noqa: E402


def test_soak_dry_run_checks_every_other_launch(tmp_path):
    summary_path = tmp_path / "soak.json"
    code = soak.main(["--cpu_dry_run", "--launches", "6", "--configs", "3", "--check_every", "2", "--seed", "3",
                      "--out", str(summary_path)])
    summary = json.loads(summary_path.read_text())
    assert code == 0, summary
    assert summary["launches"] == 6 and summary["checks"] == 3 and summary["failures"] == 0
    assert set(summary["formats"]) == set(jsm.FORMATS)  # every format has CUDA kernels, FP4 included
    # The kernel tile each configuration's plan runs on, counted once a configuration.
    assert sum(summary["kernels"].values()) == summary["configs"]
    assert all(k.split()[0] in ("portable", "hopper", "cpu_reference") for k in summary["kernels"])


def test_soak_refuses_to_run_without_a_gpu(capsys):
    assert soak.main(["--launches", "1"]) == 2
    assert "needs a GPU" in capsys.readouterr().out


def test_soak_draws_dual_caches_of_every_allowed_pair():
    rng = np.random.default_rng(0)
    configs = [soak.draw_config(rng, sorted(jsm.FORMATS)) for _ in range(400)]
    pairs = {(c["key"], c["extra_key"]) for c in configs if c["extra_topk"]}
    assert pairs == {(key, extra) for key in jsm.FORMATS for extra in validate.extra_formats(key)}
    assert all(jsm.get_format(c["key"]).dual_cache for c in configs if c["extra_topk"])


def test_kernel_labels_tell_the_cluster_tile_and_staging_apart(monkeypatch):
    """The summary's kernel names: the `dots3_swa` two-block cluster tile apart from the 64-head tile,
    a staged plan by the copy it reads."""
    cluster = jsm.plan((128, 128, 1088), jsm.get_format("dots3_swa"), 513, platform="cuda")
    assert soak.kernel_label(cluster) == "hopper h64 cluster of 2"
    plain = jsm.plan((128, 128, 576), jsm.get_format("dsv3_2"), 2048, platform="cuda")
    assert soak.kernel_label(plain) == "hopper h64"
    monkeypatch.setenv(planner.STAGING_ENV, "on")
    staged = jsm.plan((4096, 128, 576), jsm.get_format("dsv3_2"), 2048, platform="cuda", num_slots=65536)
    assert staged.staged_format == "bf16_576"
    assert soak.kernel_label(staged) == "hopper h64 bf16_576"
