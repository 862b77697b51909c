"""``python -m interlace.launch``: the ``interlace launch`` command, or one rank's worker."""

import sys

from interlace.launch.command import entry

sys.exit(entry(sys.argv[1:]))
