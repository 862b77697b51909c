"""``python -m interlace`` is the ``interlace`` command."""

from interlace.cli import main

raise SystemExit(main())
