"""``interlace bench pipeline`` as a script: pipeline schedules against DataParallel and torch.

``python benchmarks/pipeline.py [--json docs/pipeline/bench.json --png
docs/pipeline/timeline.png]``; ``--no-netem --models mlp --input-shape 1,8,8 --iters 1`` is quick.
"""

from __future__ import annotations

from interlace.bench.pipeline import main

if __name__ == "__main__":
    raise SystemExit(main())
