"""`python -m miles_lite.cli ...`: the same as the `miles-lite` console script."""

import sys

from miles_lite.cli.main import main

sys.exit(main())
