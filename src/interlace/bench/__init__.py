"""Benchmarks behind interlace's performance claims, run as ``interlace bench <name>``.

:mod:`~interlace.bench.harness` holds what they share; ``dp``, ``kfac`` and ``pipeline`` are the
benchmarks, each with its rank code (``*_rank``) and its rows (``*_report``).
"""
