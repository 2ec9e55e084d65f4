"""jax_sparse_mla: token-sparse MLA attention over paged FP8 KV caches for JAX.

Public API:
  sparse_mla, merge_attention_states          the operations (api.py)
  quantize_kv, update_kv, dequantize_kv       building and reading caches (formats.py)
  quantize_query_fp8                          the query of precision="fp8" (formats.py)
  FORMATS, KVFormat, get_format               the format registry (formats.py)
  plan, Plan, DeviceInfo                      trace-time planning (planner.py)
  supported_configs, check_supported          the supported envelope (validate.py)
  sharded_sparse_mla, sparse_mla_specs        jax.shard_map helpers: operands stay local (sharding.py)
  disabled_checks                             jax.export support for the FFI targets (export.py)
  cuda_available                              whether the CUDA kernels are built
"""

# Before the imports: the extension loader (_ffi) checks an installed build against it.
__version__ = "0.1.0"

from ._ffi import cuda_available
from .api import merge_attention_states, sparse_mla
from .export import disabled_checks
from .formats import FORMATS, KVFormat, dequantize_kv, get_format, quantize_kv, quantize_query_fp8, update_kv
from .planner import DeviceInfo, Plan, plan
from .sharding import SparseMLASpecs, sharded_sparse_mla, sparse_mla_specs
from .validate import check_supported, supported_configs

__all__ = [
    "sparse_mla",
    "merge_attention_states",
    "quantize_kv",
    "update_kv",
    "dequantize_kv",
    "quantize_query_fp8",
    "FORMATS",
    "KVFormat",
    "get_format",
    "plan",
    "Plan",
    "DeviceInfo",
    "supported_configs",
    "check_supported",
    "sharded_sparse_mla",
    "sparse_mla_specs",
    "SparseMLASpecs",
    "disabled_checks",
    "cuda_available",
]
