"""Expert replicas: more processes than ``ep_size``.

With ``W`` processes and ``ep_size`` ``P < W`` (``P`` dividing ``W``), the processes form ``W / P``
expert-parallel groups of ``P`` consecutive ranks (:meth:`ParallelismConfig.ep_group`); each group
holds every expert once, sharded as :mod:`lowprec.distributed.expert_parallel` shards them, and
dispatches its own tokens inside the group. The processes at the same place in every group
(ranks ``r, r + P, r + 2P, ...``: :meth:`ParallelismConfig.ep_replica_group`) hold the same
experts, each trained on its group's tokens: after a backward that syncs gradients their expert
gradients are averaged over those ``W / P`` replicas (:class:`ExpertReplicas`, one all-reduce per
gradient dtype). The owners' side of backward already scales by ``1 / P`` (DDP's averaging inside
a group), so each expert's gradient is the average over all ``W`` processes, as DDP gives the
other weights, and the replicas stay equal step after step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["ExpertReplicas"]


@dataclass
class ExpertReplicas:
    """This process's expert Parameters and the group of processes holding the same ones."""

    group: Any
    params: list[torch.nn.Parameter]

    def reduce(self) -> None:
        """Average the expert gradients over the replicas: each dtype's gradients flattened into
        one buffer, one all-reduce, written back. A Parameter without a gradient (its module got
        no call) takes part with zeros, so every replica sends the same sizes."""
        size = dist.get_world_size(self.group)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in self.params:
            if not p.requires_grad:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for grads in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.group)
            flat.div_(size)
            start = 0
            for g in grads:
                g.copy_(flat[start : start + g.numel()].view_as(g))
                start += g.numel()
