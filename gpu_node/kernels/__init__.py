"""Triton kernels, one folder per op: its variants, its torch reference (`reference.py`, or
`*_ref` beside a kernel) and its launch heuristics; `combine` and `launch` are shared."""
