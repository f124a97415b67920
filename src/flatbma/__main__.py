"""``python -m flatbma`` = the ``flatbma`` command."""

from flatbma.experiment.cli import main

raise SystemExit(main())
