"""Device calibration: times the CUDA kernels on the local GPU and fits the planner's cost model.

:func:`calibrate` times forced plans (:mod:`jax_sparse_mla.timing`'s method) for every calibration
shape — token counts :data:`CALIBRATION_TOKENS` × the requested head counts and candidate counts, every
choice the planner has (prefill and a range of decode split counts, per instantiated head tile) — fits
all constants of :class:`jax_sparse_mla.planner.CostModel` at once by least squares on the logarithm
of the time (relative error), with a small Nelder–Mead search started from the defaults, measures
the staged plans' copy pass of every stageable format (:func:`time_staging`, ``CostModel.stage_gbps``
and ``stage_gbps_by_format``) and the row factors of the formats that are not a row conversion's
reference (:func:`measure_row_factors`, ``CostModel.row_factors``), and stores them in the
calibration file (:mod:`jax_sparse_mla.calibration_store`). Calibration never runs
implicitly, and refuses to run inside a ``jax.jit`` trace.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Callable, Iterable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from . import _ffi, calibration_store, kernel_tables, planner, validate
from .formats import bf16_rows, cache_layout, get_format
from .timing import RandomCache, median_step_seconds

__all__ = ["calibrate", "CALIBRATION_TOKENS", "CALIBRATION_FORMATS", "calibration_choices", "forced_plan",
           "time_plan", "time_choice", "time_staging", "fit_cost_model", "measure_cost_model",
           "ROW_FACTOR_REFERENCES", "ROW_FACTOR_SHAPES", "row_factor_for", "measure_row_factors",
           "measure_stage_rates"]

_STEPS = 8
#: Steps per timed call for T <= 16, where a step is short enough that the host's per-call dispatch
#: would otherwise set the pace of the queued calls (the benchmark harness does the same).
_SMALL_STEPS = 32
_REPEATS = 7


def time_plan(plan, problem, q, cache, indices_sets) -> float:
    """Median µs per call of one forced plan (indices_sets: int32 [steps, T, topk])."""

    @jax.jit
    def run(q, cache, indices_sets):
        def step(carry, indices):
            out, _ = _ffi.call(plan, problem, q, cache, indices, None, None, None, None, None,
                               jnp.int32(problem.num_tokens))
            return carry + jnp.sum(out[:, :1, :8].astype(jnp.float32)), None

        total, _ = jax.lax.scan(step, jnp.zeros((), jnp.float32), indices_sets, unroll=True)
        return total

    median, _, _ = median_step_seconds(run, (q, cache, indices_sets), indices_sets.shape[0], _REPEATS)
    return median * 1e6


def forced_plan(problem, variant: str, heads_per_block: int, num_splits: int = 1):
    """A CUDA plan with the given choices (bypassing the cost model)."""
    base = planner.plan((problem.num_tokens, problem.num_heads, problem.fmt.d_qk), problem.fmt, problem.topk,
                        platform="cuda", impl="prefill")
    candidates = problem.topk
    split_size, num_splits = planner.split_layout(kernel_tables.decode_positions(problem.fmt.key, candidates),
                                                  num_splits)
    workspace = (kernel_tables.workspace_bytes(num_splits, problem.num_tokens, problem.num_heads, problem.fmt.d_v)
                 if variant == "decode" else 0)
    return dataclasses.replace(base, variant=variant, heads_per_block=heads_per_block, num_splits=num_splits,
                               split_size=split_size if variant == "decode" else candidates,
                               workspace_bytes=workspace, reason="forced", predicted_us=None)


def time_choice(cache: RandomCache, tokens: int, heads: int, topk: int, variant: str, heads_per_block: int,
                num_splits: int = 1) -> float:
    """Median µs per call of one planner choice on fresh random queries and index sets over ``cache``."""
    q = cache.query(tokens, heads)
    indices = cache.index_sets(_SMALL_STEPS if tokens <= 16 else _STEPS, tokens, topk)
    problem = validate.normalize(q, cache.cache, indices[0], kv_format=cache.fmt, sm_scale=cache.fmt.d_qk ** -0.5)
    plan = forced_plan(problem, variant, heads_per_block, num_splits)
    return time_plan(plan, problem, q, cache.cache, indices)


def time_staging(cache: RandomCache) -> float:
    """GB/s of a staged plan's copy pass over ``cache`` (a stageable format's): the cache read and its
    BF16 copy written (:meth:`jax_sparse_mla.planner.CostModel.stage_us`'s bytes) over the median time of
    the pass alone, its copy a result of the call (so it is written, as the kernel then reads it)."""
    staged = planner.staging_format(cache.fmt)
    if staged is None:
        raise ValueError(f"kv_format: {cache.fmt.key!r} has no staged plans (planner.staging_format)")
    layout = cache_layout(cache.cache, cache.fmt)
    run = jax.jit(lambda c: bf16_rows(c, layout, cache.fmt))
    median, _, _ = median_step_seconds(run, (cache.cache,), 1, _REPEATS)
    moved = cache.num_slots * (cache.fmt.bytes_per_token + staged.bytes_per_token)
    return moved / median / 1e9


#: Token counts of the calibration shapes (the planner sweep checks the fit on other shapes).
CALIBRATION_TOKENS = (4, 32, 256)
#: Constants the fit adjusts, with how each is kept in range (log, log of (x - 1), logit).
_FIT_PARAMETERS = (("launch_us", "log"), ("block_us", "log"), ("dequant_ns", "log"), ("exact_scales_row_ns", "log"),
                   ("direct_row_ns", "log"), ("portable_block_us", "log"), ("portable_dequant_ns", "log"),
                   ("mma_ns_per_head", "log"), ("co_residency_gain", "log1"), ("combine_gbps", "log"),
                   ("warp_combine_gbps", "log"), ("tail", "logit"))
#: Constants only the plans of one kernel family (and row conversion) time: the fit holds each at its
#: default unless a sample runs such a plan.
_FIT_CLASSES = {"block_us": ("hopper", None), "dequant_ns": ("hopper", "converted"),
                "exact_scales_row_ns": ("hopper", "exact_scales"), "direct_row_ns": ("hopper", "direct"),
                "portable_block_us": ("portable", None), "portable_dequant_ns": ("portable", None)}


def calibration_choices(tokens: int, heads: int, kv_format: str):
    """(variant, head tile, splits) timed for one calibration shape."""
    # Few tokens: the planner's whole split range (the combine of 48-64 splits is not extrapolated).
    splits = (2, 4, 8) if tokens >= 256 else (2, 4, 8, 16) if tokens > 4 else (2, 4, 8, 16, 32, 64)
    # Every head tile, also those wider than H: the planner weighs them all (a wide Hopper tile can beat
    # a portable narrow one).
    for tile in kernel_tables.HEAD_TILES[kv_format]:
        yield ("prefill", tile, 1)
        for s in splits:
            yield ("decode", tile, s)


#: Starting points of the fit: the built-in defaults and a point with every term active.
_FIT_STARTS = (planner.CostModel(),
               planner.CostModel(launch_us=10.0, block_us=1.0, dequant_ns=80.0, exact_scales_row_ns=80.0,
                                 direct_row_ns=80.0, portable_block_us=1.0, portable_dequant_ns=80.0,
                                 mma_ns_per_head=0.5, co_residency_gain=1.5, combine_gbps=1500.0,
                                 warp_combine_gbps=1500.0, tail=0.2))


def _encode(model: planner.CostModel, parameters) -> np.ndarray:
    values = []
    for name, kind in parameters:
        v = getattr(model, name)
        values.append(np.log(max(v - 1.0, 1e-6)) if kind == "log1" else
                      np.log(max(v, 1e-6) / max(1.0 - v, 1e-6)) if kind == "logit" else np.log(max(v, 1e-9)))
    return np.array(values)


def _decode(x: np.ndarray, parameters, base: planner.CostModel) -> planner.CostModel:
    values = {}
    for (name, kind), v in zip(parameters, x):
        v = float(np.clip(v, -40.0, 40.0))
        values[name] = 1.0 + np.exp(v) if kind == "log1" else 1.0 / (1.0 + np.exp(-v)) if kind == "logit" else np.exp(v)
    return dataclasses.replace(base, **values)


def _nelder_mead(f, x0: np.ndarray, iterations: int = 3000, step: float = 0.5) -> np.ndarray:
    """Minimises f from x0 (deterministic simplex search; enough for a handful of parameters)."""
    n = len(x0)
    simplex = [x0] + [x0 + step * np.eye(n)[i] for i in range(n)]
    values = [f(x) for x in simplex]
    for _ in range(iterations):
        order = np.argsort(values)
        simplex = [simplex[i] for i in order]
        values = [values[i] for i in order]
        if values[-1] - values[0] < 1e-10:
            break
        centroid = np.mean(simplex[:-1], axis=0)
        reflected = centroid + (centroid - simplex[-1])
        fr = f(reflected)
        if fr < values[0]:
            expanded = centroid + 2.0 * (centroid - simplex[-1])
            fe = f(expanded)
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = centroid + 0.5 * (simplex[-1] - centroid)
            fc = f(contracted)
            if fc < values[-1]:
                simplex[-1], values[-1] = contracted, fc
            else:
                simplex = [simplex[0] + 0.5 * (x - simplex[0]) for x in simplex]
                values = [f(x) for x in simplex]
    return simplex[int(np.argmin(values))]


def _sample_classes(samples, device) -> set:
    """The (family, row conversion) pairs, and (family, None), of the plans ``samples`` timed."""
    classes = set()
    for kv_format, _, _, candidates, variant, tile, splits, _ in samples:
        split_size = None if variant == "prefill" else planner.split_layout(candidates, splits)[0]
        family = planner._family(get_format(kv_format), tile, split_size, device)  # as the planner decides
        classes |= {(family, None), (family, kernel_tables.row_conversion(kv_format))}
    return classes


def fit_cost_model(samples, device) -> planner.CostModel:
    """Least-squares fit (log time) of the model to ``samples``: (kv_format, tokens, heads, candidates,
    variant, head tile, splits, measured µs) tuples. A family's (or row conversion's) constants that no
    sample's plan exercises keep their defaults (:data:`_FIT_CLASSES`)."""
    classes = _sample_classes(samples, device)
    parameters = tuple(p for p in _FIT_PARAMETERS if _FIT_CLASSES.get(p[0], (None, None)) in classes
                       or p[0] not in _FIT_CLASSES)

    defaults = planner.CostModel()

    def loss(x):
        model = _decode(x, parameters, defaults)
        total = 0.0
        for kv_format, tokens, heads, candidates, variant, tile, splits, measured in samples:
            predicted = planner.option_us(model, get_format(kv_format), tokens, heads, candidates, variant, tile,
                                          splits, device)
            total += (np.log(predicted) - np.log(measured)) ** 2
        return total

    results = []
    for start in _FIT_STARTS:  # the simplex search is local: start from the defaults and a neutral point
        x = _encode(start, parameters)
        for _ in range(3):  # restarts around the best point so far
            x = _nelder_mead(loss, x)
        results.append((loss(x), tuple(x)))
    return _decode(np.array(min(results)[1]), parameters, defaults)


def measure_cost_model(device, *, formats, heads, topks, progress: Optional[Callable] = None) -> dict:
    """Times the calibration shapes on the local device and returns the fitted constants as a dict."""
    shapes = [(kv_format, tokens, h, topk) for kv_format in formats for topk in topks
              for h in heads for tokens in CALIBRATION_TOKENS]
    total = sum(len(list(calibration_choices(t, h, f))) for f, t, h, _ in shapes)
    done = 0
    samples = []
    caches = {}
    for kv_format, tokens, h, topk in shapes:
        cache = caches.setdefault(kv_format, RandomCache(kv_format))
        positions = kernel_tables.decode_positions(kv_format, topk)  # the candidates the kernels read
        for variant, tile, splits in calibration_choices(tokens, h, kv_format):
            measured = time_choice(cache, tokens, h, topk, variant, tile, splits)
            samples.append((kv_format, tokens, h, positions, variant, tile, splits, measured))
            done += 1
            if progress is not None:
                progress(done, total, f"{kv_format} T={tokens} H={h} topk={topk} {variant} tile {tile}"
                                      + (f" x{splits}" if variant == "decode" else ""))
    fitted = fit_cost_model(samples, device)
    constants = fitted.to_dict()
    # The other formats' row costs against the formats the constants were fitted on.
    constants["row_factors"] = measure_row_factors(device, fitted, formats, caches=caches)
    # The copy pass of staged plans, per stageable format (the first one's rate also for the others).
    stageable = [f for f in formats if planner.staging_format(f) is not None]
    if stageable:
        rates = measure_stage_rates(fitted, stageable, caches)
        constants["stage_gbps"] = rates[0][1]
        constants["stage_gbps_by_format"] = rates
    return constants


def measure_stage_rates(model: planner.CostModel, formats, caches: Optional[dict] = None) -> tuple:
    """``model.stage_gbps_by_format`` with the copy pass of every stageable format of ``formats`` timed
    (:func:`time_staging`; the others kept), the measured ones first in the order of ``formats``."""
    caches = {} if caches is None else caches
    measured = tuple((f, time_staging(caches.setdefault(f, RandomCache(f)))) for f in formats
                     if planner.staging_format(f) is not None)
    keys = {f for f, _ in measured}
    return measured + tuple(r for r in model.stage_gbps_by_format if r[0] not in keys)


#: The format each row conversion's constant of the Hopper family is fitted on (row factor 1 by
#: definition); :func:`measure_row_factors` times the other formats against it.
ROW_FACTOR_REFERENCES = {"converted": "dsv3_2", "exact_scales": "glm_nsa", "direct": "bf16_576"}
#: The prefill shape (tokens, heads) at which a head tile's row factor is measured: many blocks a SM,
#: so the rows' cost dominates the launch and the tail.
ROW_FACTOR_SHAPES = {16: (256, 16), 64: (1024, 128)}


def row_factor_for(model: planner.CostModel, device, kv_format: str, head_tile: int, measured_us: float,
                   reference_us: float) -> float:
    """The :meth:`~jax_sparse_mla.planner.CostModel.row_factor` of ``kv_format`` at ``head_tile`` that makes
    the model's prefill time of :data:`ROW_FACTOR_SHAPES` stand to its reference format's (factor 1) as
    the measured times do (``measured_us`` / ``reference_us``), found by bisection in [0.25, 4]."""
    fmt = get_format(kv_format)
    reference = get_format(ROW_FACTOR_REFERENCES[kernel_tables.row_conversion(kv_format)])
    tokens, heads = ROW_FACTOR_SHAPES[head_tile]
    others = tuple(r for r in model.row_factors if r[:2] != (kv_format, head_tile))

    def predicted(fmt_, factor):
        m = dataclasses.replace(model, row_factors=others + ((kv_format, head_tile, factor),))
        return planner.option_us(m, fmt_, tokens, heads, kernel_tables.decode_positions(fmt_.key, 2048),
                                 "prefill", head_tile, 1, device)

    target = measured_us / reference_us * predicted(reference, 1.0)
    low, high = 0.25, 4.0
    for _ in range(40):
        mid = (low * high) ** 0.5
        low, high = (mid, high) if predicted(fmt, mid) < target else (low, mid)
    return round((low * high) ** 0.5, 3)


def measure_row_factors(device, model: planner.CostModel, formats, progress: Optional[Callable] = None,
                        caches: Optional[dict] = None) -> tuple:
    """Times the prefill of every format of ``formats`` that is not a reference
    (:data:`ROW_FACTOR_REFERENCES`) on each of its Hopper-family head tiles beside its reference format,
    and returns ``model.row_factors`` with those (format, tile) entries measured (the others kept).
    ``caches``: random caches by format key, reused and added to (as :func:`measure_stage_rates`)."""
    factors = {(key, tile): f for key, tile, f in model.row_factors}
    caches = {} if caches is None else caches
    for kv_format in formats:
        if kv_format in ROW_FACTOR_REFERENCES.values():
            continue
        fmt = get_format(kv_format)
        reference = ROW_FACTOR_REFERENCES[kernel_tables.row_conversion(kv_format)]
        for tile in kernel_tables.HEAD_TILES[kv_format]:
            if tile not in ROW_FACTOR_SHAPES or planner._family(fmt, tile, None, device) != "hopper":
                continue
            tokens, heads = ROW_FACTOR_SHAPES[tile]
            times = {key: time_choice(caches.setdefault(key, RandomCache(key)), tokens, heads, 2048, "prefill", tile)
                     for key in (reference, kv_format)}
            factors[(kv_format, tile)] = row_factor_for(model, device, kv_format, tile, times[kv_format],
                                                        times[reference])
            if progress is not None:
                progress(kv_format, tile, times[kv_format], times[reference], factors[(kv_format, tile)])
    return tuple((key, tile, f) for (key, tile), f in sorted(factors.items()))


def _inside_trace() -> bool:
    try:
        from jax._src import core
    except ImportError:  # pragma: no cover - layout of a future jax
        return False
    return not core.trace_state_clean() if hasattr(core, "trace_state_clean") else False


#: Formats calibrate() times by default, one of each row conversion (kernel_tables.row_conversion):
#: dsv3_2 (converted rows; its 16-head tile is Hopper too), glm_nsa (exact scales; its 16-head tile is
#: portable) and bf16_576 (BF16 rows), so together they pin every constant of both families.
CALIBRATION_FORMATS = ("dsv3_2", "glm_nsa", "bf16_576")


def calibrate(*, formats: Iterable[str] = CALIBRATION_FORMATS, heads: Iterable[int] = (16, 64, 128),
              topks: Iterable[int] = (2048,), force: bool = False, progress: Optional[Callable] = None,
              path: Optional[pathlib.Path] = None) -> dict:
    """Measures the local CUDA device and stores its cost-model constants.

    Args:
      formats / heads / topks: the shapes to measure (each combination runs a short sweep of split
        counts, token counts and head tiles; a few seconds each). The default formats,
        :data:`CALIBRATION_FORMATS`, exercise both kernel families and every row conversion; formats
        without a plan of a family (or of a row conversion) keep that family's (or conversion's)
        constants at the defaults. Every other format given also gets its row factors measured
        (:func:`measure_row_factors`), and every stageable one its copy pass's rate.
      force: re-measure even when the device already has constants.
      progress: called as ``progress(done, total, label)`` after each measurement (the CLI draws a bar).
      path: the calibration file (default :func:`jax_sparse_mla.calibration_store.calibration_path`).
    Returns:
      The constants stored for the device.
    Raises:
      RuntimeError: inside a ``jax.jit`` trace, or without a CUDA device and the CUDA extension.
    """
    if _inside_trace():
        raise RuntimeError("calibrate() measures the device and cannot run inside a jax.jit trace")
    if not _ffi.cuda_available():
        raise RuntimeError(f"calibrate() needs the CUDA extension: {_ffi.cuda_import_error()}")
    device = planner.device_info("cuda")
    if device is planner.DEFAULT_CUDA_DEVICE:
        raise RuntimeError("calibrate() needs a local CUDA device")
    existing = calibration_store.device_constants(device.name, path)
    if existing is not None and not force:
        return existing
    constants = measure_cost_model(device, formats=tuple(formats), heads=tuple(heads), topks=tuple(topks),
                                   progress=progress)
    calibration_store.store(device.name, constants, path)
    planner.clear_cache()
    return constants
