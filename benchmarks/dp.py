"""Data-parallel strategies against PyTorch DDP at chosen communication/compute ratios.

The same benchmark as ``interlace bench dp`` (see :mod:`interlace.bench.dp`), as a script::

    python benchmarks/dp.py                 # the full run: 5 models x 3 ratios, 4 ranks (~15 min)
    python benchmarks/dp.py --quick         # about two minutes
    python benchmarks/dp.py --no-netem      # loopback, for machines without root
"""

from __future__ import annotations

from interlace.bench.dp import main

if __name__ == "__main__":
    raise SystemExit(main())
