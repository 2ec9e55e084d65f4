"""The C++ CPU kernel on its own terms: results bitwise independent of the thread count and of the batch,
every instruction-set path against the float64 oracle and bit for bit against the others, accuracy
well inside the contract (the GPU kernels are compared against this kernel), and its environment
settings (JSMLA_CPU_THREADS, JSMLA_CPU_ISA).
"""

from __future__ import annotations

import dataclasses
import platform

import jax
import ml_dtypes
import numpy as np
import pytest

import cases
import oracle
from cases import make_case

INSTRUCTION_SETS = ("portable", "avx2", "avx512", "avx512_bf16")


def _cpu_flags() -> set:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def supported_instruction_sets() -> set:
    """The kernel's instruction sets this CPU has, read independently of the kernel (/proc/cpuinfo)."""
    supported = {"portable"}
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return supported
    flags = _cpu_flags()
    if {"avx2", "fma"} <= flags:
        supported.add("avx2")
        if {"avx512f", "avx512bw"} <= flags:
            supported.add("avx512")
            if "avx512_bf16" in flags:
                supported.add("avx512_bf16")
    return supported


def _bits(out, lse):
    return np.asarray(out).view(np.uint16), np.asarray(lse).view(np.uint32)


def _assert_same_bits(a, b):
    np.testing.assert_array_equal(_bits(*a)[0], _bits(*b)[0])
    np.testing.assert_array_equal(_bits(*a)[1], _bits(*b)[1])


# Cases that reach every path of the kernel: one head block per token (each thread dequantizes its own
# tiles) and several (tiles shared by the head blocks, dequantized in waves); several candidate tiles
# per row with a ragged last tile; FP32, UE8M0 and no scales; the dual cache; the sliding window.
THREAD_CASES = {
    "dsv3_2-h16": dict(key="dsv3_2", num_heads=16, topk=300),
    "dsv3_2-h128": dict(key="dsv3_2", num_heads=128, topk=300),
    "glm_nsa-h48": dict(key="glm_nsa", num_heads=48, topk=300),
    "dsv4-h80-dual": dict(key="dsv4", num_heads=80, topk=200, extra=dict(page_size=2, topk=70, cache_tokens=200)),
    "dots3_swa-h20": dict(key="dots3_swa", num_heads=20, topk=600),
    "bf16_512-h128": dict(key="bf16_512", num_heads=128, topk=150),
}


def _thread_case(rng, key, num_heads, topk, extra=None):
    return make_case(rng, key, num_tokens=7, num_heads=num_heads, topk=topk, page_size=64, cache_tokens=1024,
                     invalid_fraction=0.1, attn_sink=rng.standard_normal(num_heads).astype(np.float32), extra=extra)


@pytest.mark.parametrize("name", list(THREAD_CASES))
def test_results_do_not_depend_on_the_thread_count(rng, monkeypatch, name):
    case = _thread_case(rng, **THREAD_CASES[name])
    results = {}
    for threads in (1, 2, 5):
        monkeypatch.setenv("JSMLA_CPU_THREADS", str(threads))
        results[threads] = case.run("auto")
    oracle.check_accuracy(*results[1], *case.reference())
    _assert_same_bits(results[2], results[1])
    _assert_same_bits(results[5], results[1])


def _subnormal_lanes(rng, values, lanes=None):
    """Copy of BF16 bits with subnormals of the same sign in about 5% of the finite lanes, or in every
    finite value of the given last-axis `lanes`."""
    values = values.copy()
    finite = (values & 0x7f80) != 0x7f80
    if lanes is None:
        spots = (rng.random(values.shape) < 0.05) & finite
    else:
        spots = np.zeros(values.shape, bool)
        spots[..., lanes] = True
        spots &= finite
    values[spots] = (values[spots] & 0x8000) | rng.integers(1, 0x7f, int(spots.sum()), dtype=np.uint16)
    return values


def _flush(values):
    return np.where((values & 0x7f80) == 0, values & 0x8000, values).astype(np.uint16)


@pytest.mark.parametrize("isa", INSTRUCTION_SETS)
@pytest.mark.parametrize("key", list(oracle.SPECS))
def test_every_instruction_set_matches_the_oracle_and_the_portable_path(rng, monkeypatch, isa, key):
    case = make_case(rng, key, num_tokens=4, num_heads=20, topk=200, page_size=64, cache_tokens=512,
                     invalid_fraction=0.1)
    monkeypatch.setenv("JSMLA_CPU_THREADS", "2")
    monkeypatch.setenv("JSMLA_CPU_ISA", isa)
    if isa not in supported_instruction_sets():
        with pytest.raises(jax.errors.JaxRuntimeError, match=f"JSMLA_CPU_ISA: '{isa}' is not supported"):
            case.run("auto")
        return
    result = case.run("auto")
    oracle.check_accuracy(*result, *case.reference())
    monkeypatch.setenv("JSMLA_CPU_ISA", "portable")
    _assert_same_bits(result, case.run("auto"))


@pytest.mark.parametrize("isa", INSTRUCTION_SETS)
def test_subnormal_inputs_read_as_zero_on_every_instruction_set(rng, monkeypatch, isa):
    """On x86-64 the kernel reads subnormal inputs as zero on every path, as the BF16 dot-product
    instruction does: subnormal query and cache lanes give the bits of the same inputs with those lanes
    zeroed. Value lanes that are subnormal in every slot make the difference visible: they come out zero."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("other CPUs follow IEEE rules for subnormals")
    if isa not in supported_instruction_sets():
        pytest.skip(f"this CPU has no {isa}")
    monkeypatch.setenv("JSMLA_CPU_ISA", isa)
    case = make_case(rng, "bf16_576", num_tokens=3, num_heads=16, topk=40, page_size=4, topk_length=None,
                     invalid_fraction=0.0)
    value_lanes = rng.choice(oracle.SPECS["bf16_576"].d_v, 12, replace=False)
    q = _subnormal_lanes(rng, case.q.view(np.uint16))
    cache = _subnormal_lanes(rng, case.main.array.view(np.uint16), value_lanes)
    with_subnormals = dataclasses.replace(case, q=q.view(ml_dtypes.bfloat16), main=dataclasses.replace(
        case.main, array=cache.view(ml_dtypes.bfloat16)))
    flushed = dataclasses.replace(case, q=_flush(q).view(ml_dtypes.bfloat16), main=dataclasses.replace(
        case.main, array=_flush(cache).view(ml_dtypes.bfloat16)))
    out, lse = with_subnormals.run("auto")
    _assert_same_bits((out, lse), flushed.run("auto"))
    assert np.all(out[..., value_lanes].view(np.uint16) & 0x7fff == 0)
    assert np.all(out[..., np.setdiff1d(np.arange(out.shape[-1]), value_lanes)] != 0)


def _one_candidate_of_every_code(rng, key, scale_bytes=None):
    """A row attending to one candidate whose quantized lanes hold every finite FP8 (or every FP4) code,
    and, if given, whose groups' one-byte scales are ``scale_bytes``: (out, want, lanes), ``want`` being
    each code times its group scale as a float32 product rounded to BF16."""
    spec = oracle.SPECS[key]
    case = make_case(rng, key, num_tokens=1, num_heads=3, topk=1, page_size=4, topk_length=None,
                     invalid_fraction=0.0, poison=False)
    if spec.bits == 4:
        codes = np.resize(np.arange(16, dtype=np.uint8), spec.quant_lanes)
        code_bytes = codes[0::2] | (codes[1::2] << 4)
    else:
        code_bytes = np.resize(np.array([c for c in range(256) if c & 0x7f != 0x7f], np.uint8), spec.quant_lanes)
    cache = case.main.array.copy()
    raw = oracle.cache_bytes(cache)
    geom = oracle.geometry(cache.shape, key)
    ranges = oracle.slot_byte_ranges(geom, key, int(case.indices[0, 0]))
    start = ranges[0][0] + spec.quant_offset
    raw[start: start + code_bytes.size] = code_bytes
    if scale_bytes is not None:
        assert spec.scale_width == 1 and spec.kind == "footer"
        scale_start = ranges[1][0] + spec.scale_offset
        raw[scale_start: scale_start + spec.groups] = np.resize(np.asarray(scale_bytes, np.uint8), spec.groups)
    case = dataclasses.replace(case, main=dataclasses.replace(case.main, array=cache))
    out, _ = case.run("auto")
    data, scales = oracle.read_slots(cache, key, case.indices[0])
    raw_scales = (data if spec.kind == "inline" else scales)[0, spec.scale_offset:
                                                              spec.scale_offset + spec.groups * spec.scale_width]
    scale = {"fp32": oracle._fp32_to_f64, "ue8m0": oracle._ue8m0_to_f64, "e4m3": oracle._fp8_to_f64}[spec.scale](
        raw_scales).astype(np.float32)
    values = oracle.decode_tokens(data, scales, key)[0, : spec.quant_lanes]
    unscaled = (values / np.repeat(scale, spec.group)).astype(np.float32)  # the codes' values, exactly
    want = (unscaled * np.repeat(scale, spec.group)).astype(ml_dtypes.bfloat16)
    return out, want, min(spec.d_v, spec.quant_lanes)


@pytest.mark.parametrize("isa", INSTRUCTION_SETS)
@pytest.mark.parametrize("key", ["dsv4", "glm_nsa", "dsv4_nvfp4", "dsv4_1_fp4"])
def test_every_quantized_code_is_dequantized_exactly(rng, monkeypatch, isa, key):
    """A row attending to one candidate returns that candidate's V: with its quantized lanes set to every
    finite FP8 (or every FP4) code, out must be each code times its group scale, as a float32 product
    rounded to BF16 (exact for UE8M0 and E4M3 scales; the code -0 gives +0, a sum of one term)."""
    if isa not in supported_instruction_sets():
        pytest.skip(f"this CPU has no {isa}")
    monkeypatch.setenv("JSMLA_CPU_ISA", isa)
    out, want, lanes = _one_candidate_of_every_code(rng, key)
    for h in range(3):
        np.testing.assert_array_equal(out[0, h, :lanes].astype(np.float32), want[:lanes].astype(np.float32))


@pytest.mark.parametrize("key", ["dsv4", "dsv4_1"])
def test_ue8m0_scale_bytes_across_their_range(rng, key):
    """UE8M0 bytes on both sides of the GPU loaders' integer path (2^(b-127) for b in [1, 134]) and far
    from it, one a group: every code times its group's 2^(b-127), as a float32 product rounded to BF16
    (the smallest byte keeps every product normal: this kernel flushes subnormals)."""
    out, want, lanes = _one_candidate_of_every_code(rng, key, scale_bytes=[20, 64, 127, 133, 134, 135, 200, 120])
    for h in range(3):
        np.testing.assert_array_equal(out[0, h, :lanes].astype(np.float32), want[:lanes].astype(np.float32))


@pytest.mark.parametrize("key", list(oracle.SPECS))
def test_accuracy_is_well_inside_the_contract(rng, key):
    """Half the contract's bounds on out and a tenth on lse (the GPU kernels are checked against this
    kernel), with rows long enough to span several candidate tiles."""
    case = make_case(rng, key, num_tokens=4, num_heads=32, topk=600, page_size=64, cache_tokens=2048,
                     invalid_fraction=0.1)
    out, lse = case.run("auto")
    oracle.check_accuracy(out, lse, *case.reference(), out_tol=1e-2, l2_tol=5e-3, lse_tol=1e-4)


@pytest.mark.parametrize("key", ["dsv3_2", "glm53_nope", "bf16_576"])
def test_online_softmax_when_the_maximum_moves_to_a_later_tile(rng, key):
    """Large logits whose maximum sits in the first, then the third, then the last candidate tile of a
    row: the running state is rescaled exactly as the float64 softmax over the whole row."""
    topk = 700
    case = make_case(rng, key, num_tokens=3, num_heads=4, topk=topk, page_size=64, cache_tokens=2048,
                     invalid_fraction=0.0, topk_length=None, poison=False)
    keys = case.main.keys()
    q = case.q.astype(np.float32)
    for t, positions in enumerate(([5], [5, 300], [5, 300, 650])):
        for h in range(4):
            target = keys[case.indices[t, positions[min(h, len(positions) - 1)]]]
            q[t, h] = target * (60.0 / (case.sm_scale * (target @ target)))
    case = dataclasses.replace(case, q=q.astype(ml_dtypes.bfloat16)).poison_unused()
    out, lse, ref_out, ref_lse = case.check("auto")
    assert np.all(ref_lse > 50)
    np.testing.assert_allclose(lse, ref_lse, atol=1e-4, rtol=0)


@pytest.mark.parametrize("num_heads", [16, 128])
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_a_row_does_not_depend_on_its_batch(rng, num_heads, batch_invariant):
    case = make_case(rng, "dsv4", num_tokens=9, num_heads=num_heads, topk=300, page_size=64, cache_tokens=1024)
    kw = case.kwargs("auto")
    kw["batch_invariant"] = batch_invariant
    batch = cases.call_sparse_mla(case.q, case.main.array, case.indices, **kw)
    for t in (0, 4, 8):
        alone = cases.call_sparse_mla(case.q[t: t + 1], case.main.array, case.indices[t: t + 1],
                                      **dict(kw, topk_length=case.topk_length[t: t + 1]))
        _assert_same_bits((alone[0][0], alone[1][0]), (batch[0][t], batch[1][t]))


@pytest.mark.parametrize("variable,value,message", [
    ("JSMLA_CPU_THREADS", "0", "JSMLA_CPU_THREADS: expected a thread count in \\[1, 4096\\], got '0'"),
    ("JSMLA_CPU_THREADS", "two", "JSMLA_CPU_THREADS: expected a thread count in \\[1, 4096\\], got 'two'"),
    ("JSMLA_CPU_THREADS", "5000", "JSMLA_CPU_THREADS: expected a thread count"),
    ("JSMLA_CPU_ISA", "sse9", "JSMLA_CPU_ISA: expected auto, portable, avx2, avx512 or avx512_bf16, got 'sse9'"),
])
def test_invalid_environment_settings_are_errors_naming_the_variable(rng, monkeypatch, variable, value, message):
    case = make_case(rng, "glm_nsa", num_tokens=2, num_heads=2, topk=8, page_size=4)
    monkeypatch.setenv(variable, value)
    with pytest.raises(jax.errors.JaxRuntimeError, match=message):
        case.run("auto")
