"""Testing helpers shipped with the engine: the plugin conformance kit.

A vendor checks its platform plugin against the contracts of
``engine.core.interfaces`` with::

    pytest --pyargs engine.testing.conformance --engine-platform NAME

(the ``--engine-platform`` option comes from :mod:`engine.testing.pytest_plugin`,
registered through the ``pytest11`` entry point; load it with
``-p engine.testing.pytest_plugin`` where the entry point is not installed).
Each check names the contract clause it tests, e.g. ``[attention.varlen]``.
"""

from engine.testing.reference import (
    dequantize_int_weights,
    paged_attention_reference,
    rms_norm_reference,
    rotary_neox_reference,
    silu_and_mul_reference,
)

__all__ = [
    "dequantize_int_weights",
    "paged_attention_reference",
    "rms_norm_reference",
    "rotary_neox_reference",
    "silu_and_mul_reference",
]
