import sys

from benchmark.sim.cli import main

sys.exit(main())
