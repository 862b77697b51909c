"""Pipeline schedules against DataParallel and torch's pipelines at equal global batch.

The same benchmark as ``interlace bench pipeline`` (see :mod:`interlace.bench.pipeline`), as a
script::

    python benchmarks/pipeline.py                          # vgg11 and resnet20, 4 stages, 100mbit
    python benchmarks/pipeline.py --json docs/pipeline/bench.json \\
        --png docs/pipeline/timeline.png                   # the rows and a timeline as well
    python benchmarks/pipeline.py --no-netem --models mlp --input-shape 1,8,8 --iters 1
"""

from __future__ import annotations

from interlace.bench.pipeline import main

if __name__ == "__main__":
    raise SystemExit(main())
