"""benchmarks/fp8_pv_accuracy.py: the P rounding it measures orders as the number formats do (BF16 P
beside e4m3 P beside two e4m3 terms), and e4m3 P stays within precision="fp8"'s bounds on a small case."""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))

import fp8_pv_accuracy  # noqa: E402


@pytest.mark.parametrize("sharpen", [1.0, 4.0])
def test_p_rounding_errors_order_as_the_formats(sharpen):
    rows = fp8_pv_accuracy.measure("dsv3_2", tokens=2, heads=4, topk=64, sharpen=sharpen)
    (bf16_max, bf16_l2), (e4m3_max, e4m3_l2), (split_max, split_l2) = (rows[m] for m in
                                                                       ("bf16", "e4m3", "e4m3 hi+lo"))
    assert 0 < split_l2 < e4m3_l2 and 0 < bf16_l2 < e4m3_l2
    assert e4m3_max <= fp8_pv_accuracy.BOUND_MAX and e4m3_l2 <= fp8_pv_accuracy.BOUND_L2
    assert e4m3_l2 > 4 * bf16_l2  # three mantissa bits against eight


def test_e4m3_rounding_is_the_formats():
    import numpy as np

    assert fp8_pv_accuracy._e4m3(np.array([1.0625, 1.1875, 500.0, -500.0])).tolist() == [1.0, 1.25, 448.0, -448.0]
