"""Checks the CUDA FFI handler against the CPU handler through jax.ffi, without the Python package.

Usage: python3 kernels/cuda/tests/ffi_check.py BUILD_DIR
BUILD_DIR holds _cpu_ext*.so and _cuda_ext*.so (a CMake build with -DJSMLA_CUDA=ON). Both targets are
registered under the same name; the CPU reference (variant 0) is the oracle for decode (1) and
prefill (2). Also checks handler errors (bad plan attributes, small workspace) and T == 0.
"""

import glob
import importlib.util
import os
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

TARGET = None  # the versioned target name, from the CPU extension's registrations()

def load(build_dir, name):
    path = glob.glob(os.path.join(build_dir, name + "*.so"))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def quantize_dsv32(kv):
    """[n, 576] float32 -> [n, 656] uint8 (docs/formats.md, power-of-two FP32 scales)."""
    n = kv.shape[0]
    out = np.zeros((n, 656), np.uint8)
    nope = kv[:, :512].reshape(n, 4, 128)
    amax = np.maximum(np.abs(nope).max(-1), 1e-4)
    scale = np.exp2(np.ceil(np.log2(amax / 448.0))).astype(np.float32)
    fp8 = (nope / scale[..., None]).astype(ml_dtypes.float8_e4m3fn)
    out[:, :512] = fp8.reshape(n, 512).view(np.uint8)
    out[:, 512:528] = scale.view(np.uint8).reshape(n, 16)
    out[:, 528:] = kv[:, 512:].astype(ml_dtypes.bfloat16).view(np.uint8).reshape(n, 128)
    return out


def quantize_dsv4_page(kv, page_size):
    """[pages*P, 512] float32 -> [pages, P*584] uint8 footer pages (UE8M0 per 64, bf16 rope)."""
    n = kv.shape[0]
    pages = n // page_size
    nope = kv[:, :448].reshape(n, 7, 64)
    amax = np.maximum(np.abs(nope).max(-1), 1e-4)
    exponent = np.ceil(np.log2(amax / 448.0)).astype(np.int32)
    scale = np.exp2(exponent).astype(np.float32)
    data = np.zeros((n, 576), np.uint8)
    data[:, :448] = (nope / scale[..., None]).astype(ml_dtypes.float8_e4m3fn).view(np.uint8).reshape(n, 448)
    data[:, 448:] = kv[:, 448:].astype(ml_dtypes.bfloat16).view(np.uint8).reshape(n, 128)
    scales = np.zeros((n, 8), np.uint8)
    scales[:, :7] = (exponent + 127).astype(np.uint8)
    page = np.concatenate([data.reshape(pages, page_size * 576), scales.reshape(pages, page_size * 8)], axis=1)
    return page


def call(device, variant, hpb, splits, split_size, workspace, q, cache, idx, tl, sink, xcache, xidx, xtl, valid,
         fmt_id, d_v, geometry, xgeometry, sm_scale):
    t, h = q.shape[0], q.shape[1]
    results = (jax.ShapeDtypeStruct((t, h, d_v), jnp.bfloat16), jax.ShapeDtypeStruct((t, h), jnp.float32),
               jax.ShapeDtypeStruct((workspace,), jnp.uint8))
    attrs = dict(kv_format=np.int32(fmt_id), extra_kv_format=np.int32(fmt_id), sm_scale=np.float32(sm_scale),
                 page_size=np.int64(geometry[0]), num_pages=np.int64(geometry[1]),
                 page_stride=np.int64(geometry[2]), row_stride=np.int64(geometry[3]),
                 extra_page_size=np.int64(xgeometry[0]), extra_num_pages=np.int64(xgeometry[1]),
                 extra_page_stride=np.int64(xgeometry[2]), extra_row_stride=np.int64(xgeometry[3]),
                 variant=np.int32(variant), num_splits=np.int32(splits), split_size=np.int32(split_size),
                 heads_per_block=np.int32(hpb))
    fn = jax.jit(lambda *ops: jax.ffi.ffi_call(TARGET, results)(*ops, **attrs)[:2])
    ops = [jax.device_put(x, device) for x in (q, cache, idx, tl, sink, xcache, xidx, xtl, valid)]
    out, lse = fn(*ops)
    return np.asarray(out.astype(jnp.float32)), np.asarray(lse)


def compare(name, got, ref):
    out, lse = got
    rout, rlse = ref
    finite = np.isfinite(rlse)
    ok = (not np.isnan(out).any() and not np.isnan(lse).any() and np.array_equal(np.isinf(lse), np.isinf(rlse))
          and np.array_equal(lse[~finite], rlse[~finite]))
    max_abs = float(np.abs(out - rout).max()) if out.size else 0.0
    rel = float(np.linalg.norm(out - rout) / max(np.linalg.norm(rout), 1e-30)) if out.size else 0.0
    lse_err = float(np.abs(lse[finite] - rlse[finite]).max()) if finite.any() else 0.0
    ok = ok and max_abs <= 2e-2 * max(1.0, float(np.abs(rout).max(initial=0))) and rel <= 1e-2 and lse_err <= 2e-3
    print(f"{'PASS' if ok else 'FAIL'} {name}: max_abs={max_abs:.2e} rel_l2={rel:.2e} lse_err={lse_err:.2e}")
    return ok


def main():
    build_dir = sys.argv[1]
    global TARGET
    cpu_ext, cuda_ext = load(build_dir, "_cpu_ext"), load(build_dir, "_cuda_ext")
    (TARGET,) = cpu_ext.registrations()
    jax.ffi.register_ffi_target(TARGET, cpu_ext.registrations()[TARGET], platform="cpu")
    jax.ffi.register_ffi_target(TARGET, cuda_ext.registrations()[TARGET], platform="CUDA")
    print("hopper family compiled:", cuda_ext.hopper_compiled())
    cpu, gpu = jax.devices("cpu")[0], jax.devices("gpu")[0]
    rng = np.random.default_rng(0)
    all_ok = True
    empty_i32 = np.zeros((0,), np.int32)

    # ---- dsv3_2: H=20 (ragged head tile), topk=200 with bad indices, topk_length, sink, valid_tokens ----
    T, H, topk, P, pages = 6, 20, 200, 64, 40
    cache = quantize_dsv32(rng.standard_normal((pages * P, 576)).astype(np.float32)).reshape(pages, P, 656)
    q = rng.standard_normal((T, H, 576)).astype(ml_dtypes.bfloat16)
    idx = rng.integers(0, pages * P, (T, topk)).astype(np.int32)
    idx[0, :5] = [-1, pages * P, -5, 2**31 - 1, 7]
    tl = np.array([200, 0, 150, 3, 199, 200], np.int32)
    sink = rng.standard_normal(H).astype(np.float32)
    sink[3] = np.inf
    valid = np.array([5], np.int32)
    geometry = (P, pages, P * 656, 656)
    none = (1, 0, 0, 0)
    args = (q, cache, idx, tl, sink, np.zeros((0,), np.uint8), np.zeros((T, 0), np.int32), empty_i32, valid, 0, 512,
            geometry, none, 0.0417)
    ref = call(cpu, 0, 0, 1, 0, 0, *args)
    for hpb, splits, size in ((16, 3, 96), (64, 1, 224), (16, 7, 32)):
        ws = splits * T * H * 513 * 4
        all_ok &= compare(f"dsv3_2 decode hpb={hpb} splits={splits}x{size}",
                          call(gpu, 1, hpb, splits, size, ws, *args), ref)
    for hpb in (16, 64):
        all_ok &= compare(f"dsv3_2 prefill hpb={hpb}", call(gpu, 2, hpb, 1, 0, 0, *args), ref)

    # ---- dsv4 with an extra cache (footer pages, 2-D form) ----
    T, H, topk, xtopk = 4, 64, 256, 64
    main_pages, xpages, xP = 8, 50, 2
    cache = quantize_dsv4_page(rng.standard_normal((main_pages * P, 512)).astype(np.float32), P)
    xcache = quantize_dsv4_page(rng.standard_normal((xpages * xP, 512)).astype(np.float32), xP)
    q = rng.standard_normal((T, H, 512)).astype(ml_dtypes.bfloat16)
    idx = rng.integers(-3, main_pages * P + 3, (T, topk)).astype(np.int32)
    xidx = rng.integers(-3, xpages * xP + 3, (T, xtopk)).astype(np.int32)
    xtl = np.array([64, 0, 10, 33], np.int32)
    args = (q, cache, idx, empty_i32, np.zeros((0,), np.float32), xcache, xidx, xtl, np.array([T], np.int32), 3, 512,
            (P, main_pages, P * 584, 576), (xP, xpages, xP * 584, 576), 0.0442)
    ref = call(cpu, 0, 0, 1, 0, 0, *args)
    all_ok &= compare("dsv4+extra decode hpb=64 splits=3x128", call(gpu, 1, 64, 3, 128, 3 * T * H * 513 * 4, *args), ref)
    all_ok &= compare("dsv4+extra prefill hpb=16", call(gpu, 2, 16, 1, 0, 0, *args), ref)

    # ---- handler errors and T == 0 ----
    def expect_error(name, fn):
        nonlocal all_ok
        try:
            fn()
        except Exception as e:  # XlaRuntimeError
            print(f"PASS {name}: {str(e).splitlines()[0][:160]}")
            return
        print(f"FAIL {name}: no error")
        all_ok = False

    expect_error("heads_per_block=32 rejected", lambda: call(gpu, 2, 32, 1, 0, 0, *args))
    expect_error("split_size not a multiple of 32", lambda: call(gpu, 1, 64, 8, 40, 8 * T * H * 513 * 4, *args))
    expect_error("workspace too small", lambda: call(gpu, 1, 64, 3, 128, 100, *args))
    expect_error("variant 0 rejected on CUDA", lambda: call(gpu, 0, 64, 1, 0, 0, *args))
    zero = list(args)
    zero[0] = np.zeros((0, H, 512), ml_dtypes.bfloat16)
    zero[2] = np.zeros((0, topk), np.int32)
    zero[6] = np.zeros((0, xtopk), np.int32)
    zero[7] = empty_i32
    out, lse = call(gpu, 1, 64, 3, 128, 0, *zero)
    print(f"{'PASS' if out.shape == (0, H, 512) else 'FAIL'} T == 0 decode: shapes {out.shape} {lse.shape}")
    print("ALL FFI CHECKS PASSED" if all_ok else "SOME FFI CHECKS FAILED")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
