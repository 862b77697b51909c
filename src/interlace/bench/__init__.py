"""Benchmarks behind interlace's performance claims, run as ``interlace bench <name>``.

Every benchmark (``dp``, ``kfac``, ``pipeline``) fills in :mod:`~interlace.bench.skeleton` and
has its rank code (``*_rank``) and its rows (``*_report``); ``validate*`` is
``simulate --validate``'s measuring side.
"""
