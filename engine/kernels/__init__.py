"""Portable Triton kernels shared by the GPU plugins (cuda, rocm, xpu).

Nothing here is imported by ``engine`` at start-up: the kernel modules import triton
at module level, so import them only where Triton is known to be present. The same
kernels run on CPU tensors under ``TRITON_INTERPRET=1`` (set before the first import of
a kernel module), which is how CI checks their correctness without a GPU.
"""
