"""`python -m kvmesh.engine.server [flags]` runs `kvmesh serve [flags]`."""

import sys

from kvmesh.engine.server.cli import main

sys.exit(main())
