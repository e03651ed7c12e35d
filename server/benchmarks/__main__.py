"""``python -m server.benchmarks <benchmark> [options]`` = ``cancelfl-bench``."""

import sys

from server.benchmarks.cli import main

sys.exit(main())
