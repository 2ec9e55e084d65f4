"""check_supported(), sparse_mla() and plan() follow one table of rules (validate.RULES): every rule is
walked through check_supported and through the call it describes, on both sides of its boundary, and the
two must agree. A rule added to the table without a walk here fails test_every_rule_is_walked."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import pytest

import jax_sparse_mla as jsm
from jax_sparse_mla import planner, validate

T = 3
LOCAL = "cuda" if jax.default_backend() == "gpu" and jsm.cuda_available() else "cpu"


def _struct(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def _call(key, *, num_heads=4, topk=8, page_size=64, impl="auto", batch_invariant=False, dual_cache=False,
          extra_topk=4, precision="bf16", extra_format=None, backend=None):
    """sparse_mla under eval_shape (validation and planning, nothing runs) with a cache quantize_kv builds;
    ``backend="gpu"`` makes the call see a GPU backend."""
    fmt = jsm.FORMATS[key]
    q = _struct((T, num_heads, fmt.d_qk), jnp.bfloat16)
    rows = _struct((2 * page_size, fmt.d_qk), jnp.float32)
    indices = _struct((T, topk), jnp.int32)
    extra = {}
    if dual_cache:
        extra_fmt = jsm.FORMATS[extra_format or key]
        extra = dict(extra_kv_cache=jax.eval_shape(functools.partial(jsm.quantize_kv, kv_format=extra_fmt, page_size=2),
                                                   _struct((4, extra_fmt.d_qk), jnp.float32)),
                     extra_indices=_struct((T, extra_topk), jnp.int32))

    def run(q, rows, indices, extra):
        cache = jsm.quantize_kv(rows, fmt, page_size=page_size)
        return jsm.sparse_mla(q, cache, indices, kv_format=fmt, sm_scale=0.1, impl=impl,
                              batch_invariant=batch_invariant, precision=precision, extra_kv_format=extra_format,
                              **extra)

    def call():
        if backend is None:
            return jax.eval_shape(run, q, rows, indices, extra)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(jsm.api.jax, "default_backend", lambda: backend)
            return jax.eval_shape(run, q, rows, indices, extra)

    return call


def _plan(key, *, platform, num_heads=4, topk=8, impl="auto", batch_invariant=False, extra_topk=0):
    fmt = jsm.FORMATS[key]
    device = planner.DEFAULT_CUDA_DEVICE if platform == "cuda" else None
    return lambda: jsm.plan((T, num_heads, fmt.d_qk), fmt, topk, extra_topk=extra_topk, platform=platform,
                            device=device, impl=impl, batch_invariant=batch_invariant)


def _walk_num_heads(key):
    for h in (0, 1, 64, 128, 129):
        yield {"num_heads": h}, _call(key, num_heads=h)
        yield {"num_heads": h, "platform": "cuda"}, _plan(key, platform="cuda", num_heads=h)


def _walk_topk(key):
    for k in (0, 1, 2):
        yield {"topk": k}, _call(key, topk=k)
        yield {"topk": k, "platform": "cuda"}, _plan(key, platform="cuda", topk=k)
        if jsm.FORMATS[key].dual_cache:  # the extra index rows follow the same rule
            yield {"topk": k, "dual_cache": True}, _call(key, dual_cache=True, extra_topk=k)
            if k:  # plan()'s extra_topk=0 means no extra cache
                yield {"topk": k, "dual_cache": True, "platform": "cuda"}, _plan(key, platform="cuda", extra_topk=k)


def _walk_page_size(key):
    for page_size in range(1, 21):
        yield {"page_size": page_size}, _call(key, page_size=page_size)


def _walk_platform(key):
    for platform in ("cpu", "cuda", "tpu", "rocm"):
        yield {"platform": platform}, _plan(key, platform=platform)


def _walk_impl(key):
    for impl in ("auto", "decode", "prefill", "fast"):
        yield {"impl": impl, "platform": LOCAL}, _call(key, impl=impl)


def _walk_impl_on_platform(key):
    for platform in ("cpu", "cuda"):
        for impl in ("auto", "decode", "prefill"):
            yield {"impl": impl, "platform": platform}, _plan(key, platform=platform, impl=impl)
    for impl in ("auto", "decode", "prefill", "xla"):
        yield {"impl": impl, "platform": LOCAL}, _call(key, impl=impl)


def _walk_precision(key):
    for precision in ("bf16", "fp8", "fp16"):
        yield {"precision": precision, "platform": LOCAL}, _call(key, precision=precision)


def _walk_precision_on_platform(key):
    for precision in ("bf16", "fp8"):
        for impl in ("auto", "xla"):
            yield {"precision": precision, "impl": impl, "platform": LOCAL}, _call(key, precision=precision, impl=impl)
    # On a GPU backend (seen as one here: the call fails at the precision rule, before it needs the CUDA
    # extension; bf16 with impl="auto" would need the extension, so it is not walked there).
    for precision, impl in (("fp8", "auto"), ("fp8", "decode"), ("fp8", "xla"), ("bf16", "xla")):
        yield ({"precision": precision, "impl": impl, "platform": "cuda"},
               _call(key, precision=precision, impl=impl, backend="gpu"))


def _walk_format_on_platform(key):
    for platform in ("cpu", "cuda"):
        yield {"platform": platform, "impl": "auto"}, _plan(key, platform=platform)
    yield {"platform": "cuda", "impl": "xla"}, _call(key, impl="xla", backend="gpu")
    if not jsm.FORMATS[key].dual_cache or key in ("dsv4", "dsv4_1"):
        yield {"platform": LOCAL, "impl": "auto"}, _call(key)


def _walk_extra_kv_format(key):
    for extra in sorted(jsm.FORMATS):
        yield {"extra_kv_format": extra}, _call(key, dual_cache=True, extra_format=extra)


def _walk_dual_cache(key):
    for dual in (False, True):
        yield {"dual_cache": dual}, _call(key, dual_cache=dual)
        yield {"dual_cache": dual, "platform": "cpu"}, _plan(key, platform="cpu", extra_topk=4 if dual else 0)


def _walk_batch_invariant(key):
    for impl in ("auto", "decode", "prefill", "xla"):
        yield {"batch_invariant": True, "impl": impl, "platform": LOCAL}, _call(key, impl=impl, batch_invariant=True)
        if impl != "xla":
            yield ({"batch_invariant": True, "impl": impl, "platform": "cuda"},
                   _plan(key, platform="cuda", impl=impl, batch_invariant=True))


WALKS = {
    "num_heads": _walk_num_heads,
    "topk": _walk_topk,
    "page_size": _walk_page_size,
    "platform": _walk_platform,
    "impl": _walk_impl,
    "impl_on_platform": _walk_impl_on_platform,
    "precision": _walk_precision,
    "precision_on_platform": _walk_precision_on_platform,
    "format_on_platform": _walk_format_on_platform,
    "dual_cache": _walk_dual_cache,
    "extra_kv_format": _walk_extra_kv_format,
    "batch_invariant": _walk_batch_invariant,
}


def test_every_rule_is_walked():
    assert set(WALKS) == {rule.name for rule in validate.RULES}


def _accepted(fn) -> bool:
    try:
        fn()
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("key", sorted(jsm.FORMATS))
@pytest.mark.parametrize("rule", sorted(WALKS))
def test_check_supported_agrees_with_the_call(rule, key):
    outcomes = set()
    for config, call in WALKS[rule](key):
        supported = _accepted(lambda: jsm.check_supported(key, **config))
        runs = _accepted(call)
        assert supported == runs, (f"check_supported({key!r}, **{config}) {'passes' if supported else 'fails'} but "
                                   f"the call {'runs' if runs else 'is rejected'}")
        outcomes.add(supported)
    assert outcomes == _expected_outcomes(rule, jsm.FORMATS[key]), f"the walk of {rule} for {key}: {outcomes}"


def _expected_outcomes(rule, fmt) -> set:
    """Which answers a rule's walk gives for a format: both sides of the boundary, except where a format
    is on one side of it for every value walked."""
    one_sided = {
        "dual_cache": {True} if fmt.dual_cache else {True, False},
        "page_size": {True} if _page_multiple(fmt) == 1 else {True, False},
        "format_on_platform": {True} if jsm.supported_configs()[fmt.key]["platforms"]["cuda"]["variants"]
        else {True, False},
        "extra_kv_format": {True, False} if fmt.dual_cache else {False},
    }
    return one_sided.get(rule, {True, False})


def _page_multiple(fmt) -> int:
    """The page-size multiple that keeps pages of packed footer rows 16-byte aligned (docs/formats.md)."""
    if fmt.layout != jsm.formats.Layout.FOOTER:
        return 1
    return 16 // math.gcd(fmt.bytes_per_token, 16)


def test_footer_page_sizes_are_multiples_of_the_aligned_one():
    """The page sizes that check_supported allows are the multiples its message names."""
    for key in ("dsv4", "dsv4_1", "dots3_swa"):
        multiple = _page_multiple(jsm.FORMATS[key])
        for page_size in range(1, 33):
            accepted = _accepted(lambda: jsm.check_supported(key, page_size=page_size))
            assert accepted == (page_size % multiple == 0), (key, page_size)
        if multiple > 1:
            with pytest.raises(ValueError, match=f"a multiple of {multiple}"):
                jsm.check_supported(key, page_size=multiple + 1)


def test_check_supported_rejects_the_dsv4_cache_sparse_mla_rejects():
    """The reported case: page_size=3 gives a dsv4 cache with 1752-byte pages, not 16-byte aligned."""
    with pytest.raises(ValueError, match=r"page_size=3 .*multiple of 2"):
        jsm.check_supported("dsv4", page_size=3)
    with pytest.raises(ValueError, match="page_size\\*584"):
        _call("dsv4", page_size=3)()


def test_plan_rejects_a_query_width_the_format_does_not_have():
    with pytest.raises(ValueError, match=r"^q_shape: expected \(T, H, 512\) or \(B, S, H, 512\) for format dsv4"):
        jsm.plan((1, 128, 576), "dsv4", 2048, platform="cuda")
    with pytest.raises(ValueError, match="^q_shape"):
        jsm.plan((128, 512), "dsv4", 2048, platform="cpu")
    assert jsm.plan((1, 128, 512), "dsv4", 2048, platform="cuda").kv_format == "dsv4"
