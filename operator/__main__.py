"""`python -m kvmesh.operator`: the operator without the top-level CLI."""

import sys

from .cli import main

sys.exit(main())
