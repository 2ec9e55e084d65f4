"""``jax.export`` support: the safety checks the library's custom calls need disabled (docs/sharding_and_export.md).

``jax.export`` refuses to serialise custom calls that are not on JAX's list of targets with a stability
guarantee. The library gives that guarantee itself: its FFI target names are versioned
(``jax_sparse_mla._ffi.TARGET``, e.g. ``jax_sparse_mla_fwd_v2``, and the backward's
``jax_sparse_mla._ffi.BACKWARD_TARGET``, ``jax_sparse_mla_bwd_v2``) and a changed attribute contract gets a
new name, so a serialised program keeps loading with later versions of the library that still register
the old name. Pass :func:`disabled_checks` to ``jax.export.export``, or use :func:`export`.

What is baked in: ``sparse_mla`` plans at trace time, so an exported program carries the plan of every
platform it was exported for (kernel variant, split count, workspace size) as custom-call attributes,
planned for the local device or, where the host has none of that platform (exporting for ``cuda`` from a
CPU host), for the planner's documented default device. The handler that runs the program re-checks those
attributes against the device and buffers it is given and returns an error rather than launch a plan that
does not fit. Shapes are static: export one program per shape bucket (symbolic dimensions are not
supported, because planning needs concrete sizes). The host that loads a program must have imported
``jax_sparse_mla`` (which registers the handlers) before calling it.
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax

from ._ffi import BACKWARD_TARGET, TARGET

__all__ = ["disabled_checks", "export"]


def disabled_checks() -> list:
    """The ``jax.export.DisabledSafetyCheck`` entries the library's custom calls need.

    Returns:
      A list to pass as ``jax.export.export(..., disabled_checks=disabled_checks())``; concatenate it with
      your own entries if the program has other custom calls.
    """
    return [jax.export.DisabledSafetyCheck.custom_call(target) for target in (TARGET, BACKWARD_TARGET)]


def export(fn, *args, platforms: Optional[Sequence[str]] = None, extra_disabled_checks: Sequence = (), **kwargs):
    """Exports ``fn`` (which may call ``sparse_mla``) with the library's custom-call checks disabled.

    Args:
      fn: a function or a ``jax.jit``-wrapped function (wrapped in ``jax.jit`` when it is not, so pass an
        already jitted function to keep its static arguments and shardings).
      *args, **kwargs: the arguments to export for: arrays or ``jax.ShapeDtypeStruct``s with concrete shapes.
      platforms: lowering platforms, e.g. ``("cpu", "cuda")``; None exports for the default backend.
      extra_disabled_checks: further ``jax.export.DisabledSafetyCheck`` entries (for other custom calls).

    Returns:
      The ``jax.export.Exported``; ``.serialize()`` gives bytes, ``jax.export.deserialize(b).call(...)``
      runs them.
    """
    jitted = fn if hasattr(fn, "lower") and hasattr(fn, "trace") else jax.jit(fn)
    checks = disabled_checks() + list(extra_disabled_checks)
    return jax.export.export(jitted, platforms=platforms, disabled_checks=checks)(*args, **kwargs)
