"""In-tree platform plugins (cpu, cuda, rocm, xpu).

Each subpackage is a pluggy plugin registered through the ``engine.plugins`` entry-point
group exactly as a third-party package would be; nothing imports them directly except
through that group. A plugin never imports another plugin: code the GPU plugins share
lives in :mod:`engine.plugins.gpu_memory` (arithmetic) and :mod:`engine.kernels`.
"""
