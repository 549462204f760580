"""`python -m orchestration.cli`: the `rowrelay` command."""

import sys

from orchestration.cli import main

sys.exit(main())
