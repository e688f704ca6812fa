"""``python -m sao``: the same command line as the ``sao`` script."""

import sys

from sao.cli import main

sys.exit(main())
