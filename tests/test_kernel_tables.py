"""The kernel tables the planner reads from the C++ headers through the CPU extension (no GPU needed),
and the files generated from the one declaration of the CUDA kernel instances."""

import pathlib
import subprocess
import sys

import pytest

import jax_sparse_mla as jsm
from jax_sparse_mla import kernel_tables

ROOT = pathlib.Path(__file__).resolve().parents[1]
H200_SHARED = 232448  # opt-in shared memory per block on sm_90
PORTABLE_SHARED_LIMIT = 99 * 1024  # the portable family must fit sm_86/89/120's 99 KB


def test_every_table_entry_is_consistent():
    assert set(kernel_tables.FAMILIES) == {"portable", "hopper"}
    for family, kernels in kernel_tables.FAMILIES.items():
        assert kernels, family
        for (key, heads), config in kernels.items():
            fmt = jsm.get_format(key)
            assert 1 <= heads <= kernel_tables.MAX_HEADS and heads % 16 == 0, (family, key, heads)
            assert config.threads % 128 == 0 or config.threads == 128, (family, key, config)
            if family == "portable":
                assert kernel_tables.SPLIT_GRANULE % config.candidate_tile == 0, (family, key, config)
            # One candidate tile of BF16 rows fits beside the rest of the kernel's shared memory.
            assert config.candidate_tile * fmt.d_qk * 2 < config.shared_bytes, (family, key, config)
            limit = PORTABLE_SHARED_LIMIT if family == "portable" else H200_SHARED
            assert config.shared_bytes <= limit, (family, key, config)


def test_every_format_with_cuda_kernels_has_a_small_and_a_large_portable_tile():
    assert set(kernel_tables.HEAD_TILES) == set(jsm.FORMATS)
    assert all(kernel_tables.has_cuda_kernels(key) for key in jsm.FORMATS)
    for key, tiles in kernel_tables.HEAD_TILES.items():
        assert tiles[0] == 16 and len(tiles) == 2 and tiles[1] in (32, 64), (key, tiles)


def test_contract_values():
    assert kernel_tables.VARIANT_IDS == {"reference": 0, "decode": 1, "prefill": 2}
    assert (kernel_tables.MIN_HEADS, kernel_tables.MAX_HEADS, kernel_tables.MIN_TOPK) == (1, 128, 1)
    assert kernel_tables.MIN_COMPUTE_CAPABILITY == 80 and kernel_tables.HOPPER_COMPUTE_CAPABILITY == 90
    # validation and supported_configs() take their limits from the same table
    assert jsm.supported_configs()["dsv3_2"]["heads"] == (kernel_tables.MIN_HEADS, kernel_tables.MAX_HEADS)


def test_shared_memory_sizes_as_compiled():
    # The sizes the configs lay out (the Hopper ones since the consumer split); a layout change in a
    # config.h shows up here.
    assert kernel_tables.KERNELS[("dsv3_2", 16)].shared_bytes == 68224
    assert kernel_tables.KERNELS[("dsv3_2", 64)] == kernel_tables.KernelConfig(256, 32, 78464)
    assert kernel_tables.KERNELS[("dots3_swa", 32)] == kernel_tables.KernelConfig(256, 16, 65856)
    assert kernel_tables.HOPPER_KERNELS[("dsv3_2", 64)] == kernel_tables.KernelConfig(384, 32, 207104)
    assert kernel_tables.HOPPER_KERNELS[("dsv4", 64)].shared_bytes == 182528


@pytest.mark.parametrize("num_splits,tokens,heads,d_v", [(1, 1, 1, 512), (32, 1, 128, 512), (4, 7, 3, 1024)])
def test_workspace_bytes(num_splits, tokens, heads, d_v):
    # float32 partial_out[S][T][H][d_v] then partial_lse[S][T][H]
    assert kernel_tables.workspace_bytes(num_splits, tokens, heads, d_v) == num_splits * tokens * heads * (2 * d_v + 4)


def test_hopper_kernels_serve_portable_plans():
    # The handler swaps the Hopper kernel in for the portable one of the same (format, head tile), so
    # every Hopper entry must have a portable twin whose candidate tile divides its own (the plan's
    # splits are whole portable tiles; a Hopper tile may end short) — except the Hopper-only tiles,
    # whose candidate tile divides the split granule, and which alone run as clusters of blocks.
    only = {(key, heads) for key, tiles in kernel_tables.HOPPER_ONLY_TILES.items() for heads in tiles}
    assert only == {("dots3_swa", 64)}
    for key, config in kernel_tables.HOPPER_KERNELS.items():
        if key in only:
            assert key not in kernel_tables.KERNELS
            assert kernel_tables.SPLIT_GRANULE % config.candidate_tile == 0
            assert config.cluster_blocks == 2
            continue
        assert key in kernel_tables.KERNELS
        assert config.candidate_tile % kernel_tables.KERNELS[key].candidate_tile == 0
        assert config.cluster_blocks == 1
    assert all(config.cluster_blocks == 1 for config in kernel_tables.KERNELS.values())
    # BF16 rows (no staging area) and 16-head tiles (the candidates are the wgmma M) take 64-candidate
    # tiles; the others the portable family's 32.
    for (key, heads), config in kernel_tables.HOPPER_KERNELS.items():
        assert config.candidate_tile == (64 if key.startswith("bf16") or heads == 16 else 32), (key, config)


def test_hopper_16_head_tiles_serve_the_fp8_and_fp4_formats_with_exact_conversions():
    # Arbitrary FP32 scales (glm_*) and BF16 rows keep the portable 16-head tile; dots3_swa's Hopper tile
    # is the 64-head cluster only.
    served = {fmt for fmt, heads in kernel_tables.HOPPER_KERNELS if heads == 16}
    assert served == {"dsv3_2", "dsv4", "dsv4_1", "dsv4_nvfp4", "dsv4_1_fp4"}
    assert kernel_tables.HOPPER_KERNELS[("dsv3_2", 16)].threads == 384


def test_hopper_formats_are_the_576_and_512_wide_formats_and_dots3_in_two_lane_slices():
    # Every 512/576-wide format with d_v 512: scales of every kind (arbitrary FP32 ones in groups that
    # tile each consumer's 256 columns); dots3_swa's 1088-wide rows as two 576-wide lane slices (its FP8
    # lanes halved, the BF16 rope in slice 0), one block of a two-block cluster each.
    served = {fmt for fmt, _ in kernel_tables.HOPPER_KERNELS}
    expected = {key for key, f in jsm.FORMATS.items() if f.d_qk in (512, 576) and f.d_v == 512}
    assert {"dsv4_nvfp4", "dsv4_1_fp4", "glm_nsa", "glm53_nope"} <= served
    assert served == expected | {"dots3_swa"}
    dots3 = jsm.get_format("dots3_swa")
    assert (dots3.d_qk - dots3.d_v) + dots3.d_v // 2 == 576  # slice 0 is dsv3_2-shaped: 512 FP8 + 64 BF16


@pytest.mark.parametrize("kv_format,heads,capability,shared,family", [
    ("dsv3_2", 64, 90, H200_SHARED, "hopper"),
    ("dsv3_2", 16, 90, H200_SHARED, "hopper"),         # the 16-head Hopper tile (a prefill plan: one split)
    ("bf16_576", 16, 90, H200_SHARED, "portable"),     # no 16-head Hopper tile for BF16 rows
    ("dsv3_2", 64, 80, 166912, "portable"),            # A100
    ("dsv3_2", 64, 120, 101376, "portable"),           # sm_120: no wgmma
    ("dsv3_2", 64, 90, 100000, "portable"),            # not enough shared memory
    ("glm_nsa", 64, 90, H200_SHARED, "hopper"),        # arbitrary FP32 scales, applied in FP32
    ("glm_nsa", 16, 90, H200_SHARED, "portable"),
    ("dots3_swa", 32, 90, H200_SHARED, "portable"),
    ("dots3_swa", 64, 90, H200_SHARED, "hopper"),     # the Hopper-only cluster tile
    ("dots3_swa", 64, 90, 200000, "portable"),         # no room for it: no kernel (the planner skips it)
    ("bf16_512", 64, 90, H200_SHARED, "hopper"),
])
def test_kernel_family(kv_format, heads, capability, shared, family):
    assert kernel_tables.kernel_family(kv_format, heads, capability, shared) == family


@pytest.mark.parametrize("kv_format,heads,split_size,family", [
    ("dsv3_2", 16, 32, "portable"),   # a split shorter than the 16-head Hopper tile's 64 candidates
    ("dsv3_2", 16, 64, "hopper"),
    ("dsv4_nvfp4", 16, 96, "hopper"),
    ("dsv3_2", 64, 32, "hopper"),     # the 64-head tile takes every split
])
def test_kernel_family_by_split_size(kv_format, heads, split_size, family):
    assert kernel_tables.kernel_family(kv_format, heads, 90, H200_SHARED, split_size=split_size) == family


def test_kernel_family_without_sm90a_code_is_portable():
    assert kernel_tables.kernel_family("dsv3_2", 64, 90, H200_SHARED, hopper_compiled=False) == "portable"


def test_kernel_family_honours_the_environment_override(monkeypatch):
    monkeypatch.setenv("JSMLA_CUDA_FAMILY", "portable")
    assert kernel_tables.kernel_family("dsv3_2", 64, 90, H200_SHARED) == "portable"
    monkeypatch.setenv("JSMLA_CUDA_FAMILY", "auto")
    assert kernel_tables.kernel_family("dsv3_2", 64, 90, H200_SHARED) == "hopper"


def test_plan_names_the_family_that_runs_it():
    from jax_sparse_mla import planner
    big = planner.plan((128, 128, 576), "dsv3_2", 2048, platform="cuda")
    assert big.heads_per_block == 64 and big.family == "hopper"  # the default device is an H200
    assert "family=hopper" in big.describe()
    small = planner.plan((4, 8, 576), "dsv3_2", 64, platform="cuda")
    assert small.heads_per_block == 16
    assert small.family == kernel_tables.kernel_family(
        "dsv3_2", 16, 90, H200_SHARED, split_size=small.split_size if small.variant == "decode" else None)
    one = planner.plan((1, 16, 576), "bf16_576", 2048, platform="cuda")
    assert one.heads_per_block == 16 and one.family == "portable"  # no 16-head Hopper tile for BF16 rows
    assert planner.plan((4, 8, 576), "dsv3_2", 64, platform="cpu").family == "cpu_reference"


def test_generated_kernel_files_are_up_to_date():
    result = subprocess.run([sys.executable, str(ROOT / "kernels" / "cuda" / "generate_kernels.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_generator_declares_every_table_entry():
    sys.path.insert(0, str(ROOT / "kernels" / "cuda"))
    try:
        import generate_kernels
    finally:
        sys.path.pop(0)
    declared = {(family, key, heads) for family, key, _, heads in generate_kernels.instances()
                if family in generate_kernels.FORWARD_FAMILIES}
    compiled = {(family, key, heads) for family, kernels in kernel_tables.FAMILIES.items() for key, heads in kernels}
    assert declared == compiled
    assert set(generate_kernels.INSTANCES) == set(jsm.FORMATS)


def test_backward_family_declares_every_format_its_tiling_serves():
    # The tensor-core backward (kernels/cuda/backward/mma_launch.h: mma_backward_serves) holds rows of
    # 512 or 576 lanes with a 512-lane V and scales a BF16 tile carries exactly; each such format needs its
    # instance (otherwise the SIMT kernel would silently serve it), and no other format may have one (its
    # instance would not compile).
    sys.path.insert(0, str(ROOT / "kernels" / "cuda"))
    try:
        import generate_kernels
    finally:
        sys.path.pop(0)
    declared = {key for family, key, _, heads in generate_kernels.instances() if family == "backward"}
    served = {key for key, fmt in jsm.FORMATS.items()
              if fmt.d_qk in (512, 576) and fmt.d_v == 512
              and not (fmt.scale_kind == jsm.formats.ScaleKind.FP32 and not fmt.pow2_scales)}
    assert declared == served
    assert {heads for family, _, _, heads in generate_kernels.instances() if family == "backward"} == {64}


@pytest.mark.parametrize("rows, num_splits, d_v, shape", [
    (128, 16, 512, "narrow"),    # T = 1 H = 128: slices of a row on separate blocks
    (256, 22, 512, "narrow"),    # 1024 slices fit two waves of 4 narrow blocks an SM
    (512, 8, 512, "warp"),       # T = 4 H = 128: at most 8 splits, too many rows for the narrow shape
    (512, 11, 512, "wide"),      # more splits than merge groups
    (4096, 2, 512, "warp"),
    (4096, 8, 1024, "wide"),     # d_v = 1024: a lane holds the loads of 4 splits
    (4096, 4, 1024, "warp"),
])
def test_combine_shape(rows, num_splits, d_v, shape):
    assert kernel_tables.combine_shape(rows, num_splits, d_v, 132) == shape


def test_combine_shape_narrows_on_a_larger_device():
    assert kernel_tables.combine_shape(512, 8, 512, 132) == "warp"
    assert kernel_tables.combine_shape(512, 8, 512, 264) == "narrow"


def test_row_conversion_of_every_format():
    conversions = {key: kernel_tables.row_conversion(key) for key in jsm.FORMATS}
    assert conversions == {"dsv3_2": "converted", "glm_nsa": "exact_scales", "glm53_nope": "exact_scales",
                           "dsv4": "converted", "dsv4_1": "converted", "dots3_swa": "converted",
                           "bf16_576": "direct", "bf16_512": "direct", "dsv4_nvfp4": "converted",
                           "dsv4_1_fp4": "converted"}


def test_decode_positions_cut_the_main_list_at_the_window():
    assert kernel_tables.decode_positions("dots3_swa", 2048) == 513  # positions >= 513 are never read
    assert kernel_tables.decode_positions("dots3_swa", 300) == 300
    assert kernel_tables.decode_positions("dsv3_2", 2048) == 2048  # no window
    # An extra list starts after the main list's full width: both are covered whole.
    assert kernel_tables.decode_positions("dsv4", 2048, 512) == 2560


def test_window_plans_split_only_the_window():
    plan = jsm.plan((2, 64, 1088), "dots3_swa", 2048, platform="cuda", impl="decode")
    assert plan.num_splits * plan.split_size >= 513 > (plan.num_splits - 1) * plan.split_size
    # batch_invariant keeps its fixed layout over the whole index row.
    fixed = jsm.plan((2, 64, 1088), "dots3_swa", 2048, platform="cuda", batch_invariant=True)
    assert fixed.num_splits * fixed.split_size >= 2048


def test_hopper_only_tiles_are_planned_only_where_the_hopper_family_runs(monkeypatch):
    from jax_sparse_mla import planner

    h200 = planner.DEFAULT_CUDA_DEVICE
    a100 = planner.DeviceInfo("NVIDIA A100", "cuda", 80, 108, 166912, 167936, 65536)
    assert planner.head_tiles("dots3_swa", h200) == (16, 32, 64)
    assert planner.head_tiles("dots3_swa", a100) == (16, 32)
    assert planner.head_tiles("dsv3_2", h200) == kernel_tables.HEAD_TILES["dsv3_2"]
    for device in (h200, a100):
        for tokens, heads in ((1, 128), (128, 128), (4096, 128), (8, 16)):
            plan = jsm.plan((tokens, heads, 1088), "dots3_swa", 2048, platform="cuda", device=device)
            assert plan.heads_per_block in planner.head_tiles("dots3_swa", device)
            assert plan.family == ("hopper" if plan.heads_per_block == 64 else "portable"), plan
    # A cluster's two blocks are both charged: the 64-head tile costs the model twice the blocks of a
    # one-block tile of the same shape.
    model = planner.CostModel()
    one = model.kernel_us(128 * 2 * 2, 513, 64, h200.sm_count, 1, "hopper", "converted", "dots3_swa")  # T x tiles x 2
    assert planner.option_us(model, jsm.get_format("dots3_swa"), 128, 128, 513, "prefill", 64, 1, h200) == one
    # JSMLA_CUDA_FAMILY=portable: no Hopper kernel runs, so no Hopper-only tile is planned.
    monkeypatch.setenv("JSMLA_CUDA_FAMILY", "portable")
    planner.clear_cache()
    assert planner.head_tiles("dots3_swa", h200) == (16, 32)
    assert jsm.plan((128, 128, 1088), "dots3_swa", 2048, platform="cuda", device=h200).heads_per_block != 64
    planner.clear_cache()
