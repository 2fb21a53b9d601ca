"""Accelerate's own multi-process test scripts (``accelerate/test_utils/scripts``, shipped in the
pinned ``accelerate`` package the dev extra installs), run on 2 CPU processes under plain
``torchrun`` with Accelerate's objects rebound to lowprec's (tests/accelerate_shim.py, through a
``sitecustomize.py`` as in tests/test_accelerate_conformance.py). Accelerate's test suite launches
them with ``accelerate launch --num_processes 2``; each asserts inside and exits non-zero on a
failure. Real Accelerate 1.15 passes them on this setup (2 CPU processes, gloo; checked by hand,
docs/LOG.md 2026-11-29).

- ``test_ops.py``: gather, gather_object, broadcast, pad_across_processes, reduce (sum, mean, max)
  and debug mode's shape check (``DistributedOperationException``), then
  ``destroy_process_group``. lowprec lacked ``reduce(..., "max")`` and the debug check, and the
  script's finished ranks aborted at exit (4 of 6 runs) while lowprec kept the destroyed group
  to interpreter finalization.
- ``test_script.py``'s checks (process control, ``split_between_processes``, RNG synchronisation,
  dataloader preparation and samplers, training on 2 processes against one, with split batches,
  bf16 and fp16, the breakpoint trigger), called in its order by tests/scripts/accelerate_test_script.py,
  which says why two are left out (internals of Accelerate's data loader and its shared state).
- ``test_distributed_data_loop.py``'s checks (even batches, ``join_uneven_inputs`` and its warnings,
  every sample once per epoch for a shuffled loader, a user's batch sampler and a ``BatchSampler``
  given as ``sampler=``), likewise through tests/scripts/accelerate_data_loop.py. It found two
  defects: a user's ``BatchSampler(RandomSampler(ds))`` drew a permutation per process (samples
  repeated and lost), and a ``BatchSampler`` as ``sampler=`` was refused.

Each run must also have reached lowprec's code (the shim's marker), so a rebinding that silently
fell back to Accelerate's own objects fails here. (``test_sync.py`` passes too, checked by hand; its
gradient-synchronisation checks are those of Accelerate's ``test_grad_sync.py``, which the
conformance suite runs: left out for the suite's time.)
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import accelerate
import pytest

from torchrun_util import run_torchrun

HERE = Path(__file__).resolve().parent
SITECUSTOMIZE = "import accelerate_shim  # noqa: F401\n"


SCRIPTS = Path(accelerate.__file__).parent / "test_utils" / "scripts"


@pytest.mark.parametrize(
    "source",
    [
        SCRIPTS / "test_ops.py",
        HERE / "scripts" / "accelerate_test_script.py",
        HERE / "scripts" / "accelerate_data_loop.py",
    ],
    ids=["test_ops", "test_script", "test_distributed_data_loop"],
)
def test_accelerates_launched_script_passes_on_lowprec(tmp_path, source):
    shutil.copy(HERE / "accelerate_shim.py", tmp_path / "accelerate_shim.py")
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    reached = tmp_path / "reached"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "LOWPREC_", "FSDP_"))}
    env.update(
        PYTHONPATH=os.pathsep.join([str(tmp_path), str(HERE.parent / "src")]),
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        LOWPREC_REACHED=str(reached),
    )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "0", str(source)]
    run_torchrun(cmd, lambda p: reached.exists(), env=env, timeout=240, cwd=str(tmp_path))
