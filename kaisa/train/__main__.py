"""``python -m kaisa.train``: same as the ``kaisa-train`` command."""

from kaisa.train import main

raise SystemExit(main())
