"""The commands' runners: ``run(args) -> int`` of each ``lowprec`` command that does work, apart
from its parser (``lowprec.cli.<command>``). :func:`lowprec.cli.main.runner` imports one only
when its command runs, so each imports what its work needs (torch, pydantic, matplotlib) at its
top while ``lowprec --help`` and ``lowprec launch`` stay free of them."""
