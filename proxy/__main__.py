"""`python -m proxy` is the same CLI as the `affinity-proxy` console script."""

import sys

from proxy.cli import main

sys.exit(main())
