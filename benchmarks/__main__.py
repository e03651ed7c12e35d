"""``python -m benchmarks <benchmark> [options]`` = ``cancelfl-bench``."""

import sys

from benchmarks.cli import main

sys.exit(main())
