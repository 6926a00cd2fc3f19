"""``python -m quanta ...``: the same command line as ``quanta ...``."""

import sys

from quanta.cli import main

sys.exit(main())
