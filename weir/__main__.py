"""``python -m weir ...`` is the ``weir`` command."""

import sys

from weir.cli import main

sys.exit(main())
