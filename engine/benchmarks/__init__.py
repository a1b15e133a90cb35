"""Benchmarks behind ``engine bench``: the reference workload, offline runs, step profiles.

``workload`` fixes the prompts and sampling of the reference measurements, ``offline``
times them through the ``LLM`` API, ``step_profile`` splits one decode step into its
stages, and ``report`` renders results as a table and JSON. ``serve`` (with ``serve_metrics``,
``serve_prompts``, ``serve_plot``) loads a running OpenAI-compatible server and shares
``workload`` and ``report``.
"""
