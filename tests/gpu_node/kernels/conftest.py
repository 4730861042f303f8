"""Kernel tests run the Triton kernels on CPU tensors through the interpreter.

Triton decides interpreted-or-compiled when a kernel is decorated, so this has to be
set before any kernel module is imported.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
