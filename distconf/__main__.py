"""``python -m distconf`` runs the command line."""

import sys

from distconf.cli import main

sys.exit(main())
