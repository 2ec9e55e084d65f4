"""Constants of the portable CUDA kernel family that the planner needs (mirrors kernels/cuda)."""

#: Head tiles the kernels are instantiated for (heads per block).
HEAD_TILES = (16, 64)
#: Candidates per tile; decode split sizes are multiples of it.
CANDIDATE_TILE = 64
