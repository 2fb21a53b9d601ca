"""Destroyed process groups are kept until exit (lowprec.group_lifetime): a gloo group's destructor
running right after a collective can deadlock the process (docs/LOG.md, 2026-11-28). Outside
``lowprec launch`` they are let go by an atexit handler, before interpreter finalization, where
their threads aborted finished processes (docs/LOG.md, 2026-11-29)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch
import torch.distributed as dist

from lowprec import group_lifetime


def test_destroys_keep_the_groups_and_the_patch_covers_torchs_own(tmp_path, monkeypatch):
    # the patch is process-wide: undone after the test
    monkeypatch.setattr(dist, "destroy_process_group", dist.destroy_process_group)
    monkeypatch.setattr(dist.distributed_c10d, "destroy_process_group", dist.distributed_c10d.destroy_process_group)
    monkeypatch.setattr(group_lifetime, "_torch_destroy", None)
    monkeypatch.setattr(group_lifetime, "_retired", [])
    monkeypatch.setattr(group_lifetime, "_at_exit", {"registered": True, "release": True})
    assert not dist.is_initialized()

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "a"), 1), rank=0, world_size=1)
    first = dist.group.WORLD
    dist.all_reduce(torch.ones(1))
    group_lifetime.destroy_group()  # lowprec's own destroy
    assert not dist.is_initialized() and group_lifetime._retired == [first]

    group_lifetime.retain_destroyed_groups()
    group_lifetime.retain_destroyed_groups()  # once is enough: a second call changes nothing
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "b"), 1), rank=0, world_size=1)
    second = dist.group.WORLD
    dist.all_reduce(torch.ones(1))
    dist.destroy_process_group()  # torch's name, as a user script or Accelerate calls it
    assert not dist.is_initialized() and group_lifetime._retired == [first, second]
    assert dist.destroy_process_group.__wrapped__ is group_lifetime._torch_destroy
    assert group_lifetime._at_exit["release"] is False  # a launched rank keeps them to its os._exit


def test_retained_groups_are_let_go_at_exit_before_finalization(tmp_path):
    script = textwrap.dedent(
        f"""
        import atexit
        left = []
        atexit.register(lambda: print("retained at the end:", len(left[0]._retired), flush=True))
        import torch, torch.distributed as dist
        from lowprec import group_lifetime
        left.append(group_lifetime)
        dist.init_process_group("gloo", store=dist.FileStore({str(tmp_path / "s")!r}, 1), rank=0, world_size=1)
        dist.all_reduce(torch.ones(1))
        group_lifetime.destroy_group()
        print("retained after destroy:", len(group_lifetime._retired), flush=True)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "retained after destroy: 1" in out.stdout and "retained at the end: 0" in out.stdout, out.stdout
