"""``python -m kaisa.plan``."""

import sys

from kaisa.plan.cli import main

sys.exit(main())
