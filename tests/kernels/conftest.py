"""Kernel tests run the Triton kernels on CPU tensors through Triton's interpreter.

The flag must be set before the first ``triton.jit`` decoration, i.e. before any
``engine.kernels`` kernel module is imported, so it is set when this conftest loads.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
