"""Benchmarks behind ``engine bench``: the reference workload, offline runs, step profiles.

``workload`` fixes the prompts and sampling of the reference measurements, ``offline``
times them through the ``LLM`` API, ``step_profile`` splits one decode step into its
stages, and ``report`` renders results as a table and JSON. Serving benchmarks (against
an OpenAI-compatible server) will live beside these and share ``workload`` and ``report``.
"""
