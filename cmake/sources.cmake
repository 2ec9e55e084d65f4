# Source lists shared by CMakeLists.txt; tests/test_build_files.py keeps BUILD's lists identical.
set(JSMLA_CPU_SOURCES
  kernels/cpu/sparse_mla_cpu.cc
  ffi/cpu_handlers.cc
)
set(JSMLA_CPU_MODULE_SOURCES
  ffi/cpu_module.cc
)
set(JSMLA_CUDA_SOURCES
)
set(JSMLA_CUDA_MODULE_SOURCES
)
