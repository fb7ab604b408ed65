"""The W4A16 MoE kernel family's build side: planners (which kernel, grid and buffers for each M)."""
