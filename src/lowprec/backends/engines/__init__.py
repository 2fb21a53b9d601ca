"""The running backends: one module per backend declared in ``lowprec/backends/<name>.py``.

``native.py`` (:class:`NativeBackend`, lowprec's own engine), ``torchao.py``, ``te.py`` and
``msamp.py`` (the backend on its library, and the native engine standing in where that library
is missing), ``shared.py`` (what they share). These import torch and ``lowprec.fp8`` at the top;
the declarations do not, and name what they need from here with
:class:`lowprec.backends.spec.Implementation`, which imports it when a backend is built.
"""
