"""The CUDA kernel tables the planner mirrors (no GPU needed; tests/gpu compares them with the build)."""

import pytest

import jax_sparse_mla as jsm
from jax_sparse_mla import cuda_config

H200_SHARED = 232448  # opt-in shared memory per block on sm_90


def test_hopper_kernels_serve_portable_plans():
    # The handler swaps the Hopper kernel in for the portable one of the same (format, head tile), so
    # every Hopper entry must have a portable twin with the same candidate tile (split granule).
    for key, config in cuda_config.HOPPER_KERNELS.items():
        assert key in cuda_config.KERNELS
        assert config.candidate_tile == cuda_config.KERNELS[key].candidate_tile
        assert cuda_config.SPLIT_GRANULE % config.candidate_tile == 0
        assert config.shared_bytes <= H200_SHARED


def test_hopper_formats_are_the_576_and_512_wide_formats_without_arbitrary_scales():
    # scale_kind 0: no scales (bf16 rows); pow2_scales: power-of-two FP32 or UE8M0 scales.
    served = {fmt for fmt, _ in cuda_config.HOPPER_KERNELS}
    expected = {key for key, f in jsm.FORMATS.items()
                if f.d_qk in (512, 576) and f.d_v == 512 and (f.scale_kind == 0 or f.pow2_scales)}
    assert served == expected


@pytest.mark.parametrize("kv_format,heads,capability,shared,family", [
    ("dsv3_2", 64, 90, H200_SHARED, "hopper"),
    ("dsv3_2", 16, 90, H200_SHARED, "portable"),       # no Hopper kernel for 16-head tiles
    ("dsv3_2", 64, 80, 166912, "portable"),            # A100
    ("dsv3_2", 64, 120, 101376, "portable"),           # sm_120: no wgmma
    ("dsv3_2", 64, 90, 100000, "portable"),            # not enough shared memory
    ("glm_nsa", 64, 90, H200_SHARED, "portable"),      # arbitrary FP32 scales
    ("dots3_swa", 32, 90, H200_SHARED, "portable"),
    ("bf16_512", 64, 90, H200_SHARED, "hopper"),
])
def test_kernel_family(kv_format, heads, capability, shared, family):
    assert cuda_config.kernel_family(kv_format, heads, capability, shared) == family


def test_kernel_family_honours_the_environment_override(monkeypatch):
    monkeypatch.setenv("JSMLA_CUDA_FAMILY", "portable")
    assert cuda_config.kernel_family("dsv3_2", 64, 90, H200_SHARED) == "portable"


def test_plan_names_the_family_that_runs_it():
    from jax_sparse_mla import planner
    big = planner.plan((128, 128, 576), "dsv3_2", 2048, platform="cuda")
    assert big.heads_per_block == 64 and big.family == "hopper"  # the default device is an H200
    assert "family=hopper" in big.describe()
    small = planner.plan((4, 8, 576), "dsv3_2", 64, platform="cuda")
    assert small.heads_per_block == 16 and small.family == "portable"
    assert planner.plan((4, 8, 576), "dsv3_2", 64, platform="cpu").family == "cpu_reference"
