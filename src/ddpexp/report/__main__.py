"""``python -m ddpexp.report``."""

import sys

from ddpexp.report import main

sys.exit(main())
