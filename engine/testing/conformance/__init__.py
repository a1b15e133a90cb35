"""Conformance checks, one module per contract of ``engine.core.interfaces``.

Run: ``pytest --pyargs engine.testing.conformance --engine-platform NAME``. Every check
names the clause it tests (``[attention.varlen]`` ...) in its docstring and its failure
messages; skips say why a check does not apply to the platform.
"""
