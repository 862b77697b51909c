"""Benchmarks behind interlace's performance claims, run as ``interlace bench <name>``.

Each benchmark measures the strategies it compares side by side in the same processes, so that
machine noise hits them alike, and prints the table of ratios it backs (see ``DESIGN.md``:
benchmarks are not timed tests). :mod:`interlace.bench.dp` compares the data-parallel
strategies against PyTorch DDP on the emulated cluster.
"""
