"""Triton kernels, each beside its pure-torch reference (`*_ref`)."""
