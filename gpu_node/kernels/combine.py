"""Combine functions for `tl.reduce`, shared by the kernels.

Reductions go through `tl.reduce` with these rather than `tl.max` / `tl.sum` /
`tl.zeros`, which are @jit functions of Triton's own library: those are decorated
compiled-mode if Triton was imported before TRITON_INTERPRET was set, and the
interpreter cannot call them then. The same code runs on the GPU.
"""

import triton
import triton.language as tl


@triton.jit
def maximum_tl(a, b):
    return tl.maximum(a, b)


@triton.jit
def add_tl(a, b):
    return a + b
