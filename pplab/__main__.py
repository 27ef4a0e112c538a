"""`python -m pplab ...` is the `pplab` command (pplab/course/cli.py)."""
import sys

from .course.cli import main

sys.exit(main())
