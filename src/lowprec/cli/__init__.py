"""The ``lowprec`` command line (``lowprec.cli.main:main``): launch, config, env, and the
trainer's train/compare. One module per subcommand; see :mod:`lowprec.cli.main`."""

from __future__ import annotations

__all__: list[str] = []
