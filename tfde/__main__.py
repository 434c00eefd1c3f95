import sys

from tfde.cli import main

sys.exit(main())
