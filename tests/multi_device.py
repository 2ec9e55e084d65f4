"""Running a test module's checks in a subprocess with forced CPU devices (shared by the sharding tests
of the forward and of the gradient).

A module defines ``CHECKS`` (name -> callable), calls :func:`child_main` under ``__main__`` and gets its
results in the parent through :func:`run_checks`. A check may raise :class:`Skip`; any other exception
is reported to the parent with its traceback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback


class Skip(Exception):
    """Raised by a check that does not apply here; the parent test skips with the message."""


def child_main(checks: dict, result_path: str, num_devices: int) -> None:
    import jax

    assert jax.device_count() == num_devices, jax.devices()
    results = {}
    for name, check in checks.items():
        try:
            check()
            results[name] = "ok"
        except Skip as skip:
            results[name] = f"skip: {skip}"
        except Exception:  # reported to the parent test, which fails with the traceback
            results[name] = traceback.format_exc()
    with open(result_path, "w") as f:
        json.dump(results, f)


def run_checks(module_file: str, result_path, num_devices: int) -> dict:
    """Runs ``module_file`` as a script with ``num_devices`` forced CPU devices; returns its results."""
    env = dict(os.environ,
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={num_devices}",
               JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join(p or os.getcwd() for p in sys.path))
    proc = subprocess.run([sys.executable, os.path.abspath(module_file), str(result_path)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"subprocess failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    with open(result_path) as f:
        return json.load(f)
