"""Minimal reproducer of the exit-time SIGABRT (plain torch + gloo, torchrun, no lowprec).

    torchrun --standalone --nproc_per_node 2 benchmarks/stress/gloo_exit_abort.py [--mode M]

Modes (what each rank does before returning to the interpreter's exit):
  fsdp2      a tiny model under FSDP2, 3 steps, destroy_process_group
  allreduce  3 all_reduce calls, destroy_process_group
  nodestroy  fsdp2 without destroy_process_group
  exit       fsdp2 + destroy, then flush and os._exit(0) (skips interpreter finalization)
  gc         fsdp2 + destroy + gc.collect() + join every non-main Python thread
  nowait     an async all_reduce whose tensor is dropped unwaited, no destroy: a gloo worker
             thread frees the tensor (its Python object, so it takes the GIL) while the
             interpreter finalizes
  delmodel   fsdp2, then del model/optimizer/loss + gc.collect() before destroy_process_group
``--os_exit``: any mode, then flush stdio and ``os._exit(0)`` instead of returning (no finalization).
Prints the live threads (Python and OS-level) just before returning when LIST_THREADS=1.
"""

import argparse
import gc
import os
import sys
import threading

import torch
import torch.distributed as dist


def os_threads() -> list[str]:
    tdir = f"/proc/{os.getpid()}/task"
    names = []
    for tid in sorted(os.listdir(tdir)):
        with open(f"{tdir}/{tid}/comm") as f:
            names.append(f.read().strip())
    return names


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", default="fsdp2")
    p.add_argument("--os_exit", action="store_true")
    a = p.parse_args()
    mode = a.mode
    if a.os_exit:
        import atexit

        atexit.register(lambda: (sys.stdout.flush(), sys.stderr.flush(), os._exit(0)))  # first registered: runs last
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if mode == "nowait":
        t = torch.ones(1 << 20)
        dist.all_reduce(t, async_op=True)
        del t
        print(f"rank {rank} done", flush=True)
        return
    if mode == "allreduce":
        for _ in range(3):
            t = torch.ones(4)
            dist.all_reduce(t)
    else:
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(3):
            loss = model(torch.randn(8, 16)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
    if mode == "delmodel":
        del model, opt, loss
        gc.collect()
    if mode != "nodestroy":
        dist.destroy_process_group()
    if mode == "gc":
        gc.collect()
        for t in threading.enumerate():
            if t is not threading.main_thread():
                t.join(timeout=5)
    if os.environ.get("LIST_THREADS"):
        print(
            f"rank {rank} python threads: {[t.name for t in threading.enumerate()]}; os threads: {os_threads()}",
            flush=True,
        )
    print(f"rank {rank} done", flush=True)
    if os.environ.get("LIST_THREADS"):
        import atexit

        atexit.register(lambda: print(f"rank {rank} at exit: os threads {os_threads()}", flush=True))
    if mode == "exit":
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
