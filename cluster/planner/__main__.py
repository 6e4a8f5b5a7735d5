"""`python -m cluster.planner`: the planner on its own (cluster/planner/run.py)."""

import sys

from cluster.planner.run import main

sys.exit(main())
