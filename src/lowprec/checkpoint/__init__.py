"""Saving and loading training state, atomically, without ever unpickling code.

* :mod:`lowprec.checkpoint.state`: ``save_state`` / ``load_state`` of an Accelerator (model,
  optimizer, scheduler, RNG, FP8 scaling state), ``save_model``, their atomic temp + rename;
* :mod:`lowprec.checkpoint.serialization`: the file formats (safetensors and JSON, checked
  pickles only where Accelerate's layout needs them), sharded ``model.safetensors`` writing;
* :mod:`lowprec.checkpoint.sharded`: FSDP2 / distributed checkpoints (one shard per process,
  loadable on any number of processes) with a load planner that refuses code.

This package's ``__init__`` imports nothing, so that reading a file format does not load the
Accelerator's state machinery. Activation recomputation is ``lowprec.fp8.modules.recompute``.
"""
