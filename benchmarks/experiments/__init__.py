"""Kernel experiments on the GPU machine (timings of launch variants, power, GEMM ceiling); see README.md."""
