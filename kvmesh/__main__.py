"""`python -m kvmesh`: the same as the `kvmesh` command."""

import sys

from kvmesh.cli import main

sys.exit(main())
