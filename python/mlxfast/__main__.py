"""``python -m mlxfast``: the ``mlxfast`` command (serve, generate, convert)."""

from .cli import main

raise SystemExit(main())
