"""Scaling kinds, one module each, behind one protocol (:class:`~lowprec.fp8.kinds.base.Kind`).

``Recipe.kind`` is the kind of a recipe; ``Float8Linear`` asks it for the GEMM plan, the state
to keep, the forward to run and the report line, and never compares its name. A kind's module
is loaded when a recipe first uses it. See ``base.py`` for the protocol and how to add a kind.
"""

from lowprec.fp8.kinds.base import Kind, get, names, register, state_buffers, unregister

__all__ = ["Kind", "get", "names", "register", "unregister", "state_buffers"]
