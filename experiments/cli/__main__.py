"""``python -m experiments.cli``: the same as the `fedpriv` console script."""

import sys

from .main import main

sys.exit(main())
