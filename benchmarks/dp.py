"""``interlace bench dp`` as a script: data-parallel strategies against PyTorch DDP.

``python benchmarks/dp.py`` (5 models x 3 ratios, about 15 minutes), ``--quick`` (about two
minutes), ``--no-netem`` (loopback, for machines without root).
"""

from __future__ import annotations

from interlace.bench.dp import main

if __name__ == "__main__":
    raise SystemExit(main())
