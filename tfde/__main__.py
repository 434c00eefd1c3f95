"""`python -m tfde`: the `tfde` command (tfde_cli.py; `python -m tfde_cli` starts faster)."""

import sys

from tfde_cli import main

sys.exit(main())
