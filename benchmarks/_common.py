"""Shared helpers for benchmarks: timing (warm-up, CUDA events, median), saved-tensor bytes,
and the JSON envelope (device, torch version, date, exact command). torch only."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        return f"{torch.cuda.get_device_name(device)} (sm_{cap[0]}{cap[1]})"
    return (
        f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads"
    )


def time_fn(fn, device: torch.device, warmup: int = 3, iters: int = 10) -> float:
    """Median milliseconds of ``fn()`` after ``warmup`` calls; CUDA events on GPU."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


@contextmanager
def count_saved_bytes(exclude: list[torch.Tensor] | None = None):
    """Bytes autograd saves for backward inside the block, by distinct storage.

    Tensors that share storage with ``exclude`` (the layer's Parameters, which exist anyway)
    are not counted: what is counted is the memory backward adds.
    """
    excluded = {t.untyped_storage().data_ptr() for t in (exclude or [])}
    seen: dict[int, int] = {}
    result = {"bytes": 0}

    def pack(t):
        if isinstance(t, torch.Tensor) and t.layout == torch.strided:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in excluded:
                seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield result
    result["bytes"] = sum(seen.values())


def status_kib(field: str) -> int:
    """A ``/proc/self/status`` field in KiB (``VmRSS``, ``RssAnon``, ``VmHWM``)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


@contextmanager
def rss_peaks():
    """Peaks of the process's memory during the block, in bytes above the values before it, into
    the yielded dict on exit: ``rss_anon_peak_delta_bytes`` (``RssAnon`` sampled every 2 ms by a
    thread: memory allocated, not page cache), ``rss_anon_after_delta_bytes`` (after the block;
    the C allocator keeps some freed memory) and ``rss_peak_delta_bytes`` (``VmHWM``, reset
    through ``/proc/self/clear_refs`` before: mapped file pages count while resident)."""
    out: dict = {}
    anon: list[int] = []
    with open("/proc/self/clear_refs", "w") as f:  # resets the peak resident set (VmHWM) to the current one
        f.write("5")
    rss0, anon0 = status_kib("VmRSS"), status_kib("RssAnon")
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.002):
            anon.append(status_kib("RssAnon"))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield out
    finally:
        done.set()
        sampler.join()
        now = status_kib("RssAnon")
        out["rss_peak_delta_bytes"] = (status_kib("VmHWM") - rss0) * 1024
        out["rss_anon_peak_delta_bytes"] = (max(anon + [now]) - anon0) * 1024
        out["rss_anon_after_delta_bytes"] = (now - anon0) * 1024


def replace_json(path: Path, payload: dict, indent: int = 2) -> None:
    """``payload`` as ``path``, written to ``path`` with the suffix ``.tmp`` then renamed: a reader
    (or a part killed at its budget) finds the previous whole file or the new one."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=indent) + "\n")
    os.replace(tmp, path)


def write_json(payload: dict, out: str | None, default_name: str) -> Path:
    device = payload.get("device", "")
    envelope = {
        "command": " ".join(shlex.quote(a) for a in [sys.executable.rsplit("/", 1)[-1], *sys.argv]),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        **payload,
    }
    path = Path(out) if out else Path(__file__).parent / "results" / default_name
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_json(path, envelope)
    print(f"wrote {path} ({device})")
    return path


def collect_rows(out: Path, result: dict, jobs, hide: str) -> None:
    """Run ``jobs`` (``(label, thunk)``: ``label`` a dict naming the row) into ``result["rows"]``,
    printing each row (without its ``hide`` key) and rewriting ``out`` after each (atomically), so
    a run stopped at its budget keeps what it measured. A job that raises is a row with its
    error; the others go on."""
    for label, thunk in jobs:
        try:
            row = thunk()
        except Exception as e:  # noqa: BLE001 - a row that cannot run is reported, the others go on
            row = {**label, "error": f"{type(e).__name__}: {str(e)[:800]}"}
        print(json.dumps({k: v for k, v in row.items() if k != hide}), flush=True)
        result["rows"].append(row)
        replace_json(out, result, indent=1)


def cpu_alloc_peak(fn, busiest_thread_only: bool = False) -> int:
    """Peak of the CPU allocator's running total during ``fn()``, replayed from torch.profiler's
    memory events in time order (temporaries freed inside one op are missed). With
    ``busiest_thread_only`` only the thread with the most allocations (the one that ran ``fn``)
    counts: gloo's threads allocate too, and made the totals of identical runs vary by up to 10%."""
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events, threads = [], Counter()
    for e in prof.events():
        b = e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage
        if b:
            events.append((e.time_range.start, b, e.thread))
            threads[e.thread] += 1
    if busiest_thread_only and threads:
        main = threads.most_common(1)[0][0]
        events = [ev for ev in events if ev[2] == main]
    events.sort(key=lambda ev: ev[0])
    cur = peak = 0
    for _, b, _ in events:
        cur += b
        peak = max(peak, cur)
    return peak


def end_rank() -> None:
    """End a spawned or forked gloo rank whose results are written: flush and leave without
    interpreter finalization, where torch's gloo threads can abort a finished process ("terminate
    called without an active exception"; `lowprec launch` ranks leave the same way). No atexit
    handlers: a forked rank holds its parent's (a TemporaryDirectory's cleanup among them), and
    multiprocessing's own child exit skips them too."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_and_load(worker, world: int, *args):
    """``worker(rank, world, port, *args, out)`` on ``world`` spawned processes (fork can deadlock
    a threaded parent); returns what rank 0 ``torch.save``d to ``out`` (read back weights-only)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        out = f"{d}/r.pt"
        mp.start_processes(worker, args=(world, free_port(), *args, out), nprocs=world, start_method="spawn")
        return torch.load(out, weights_only=True)


def run_child(script: str, *args: str) -> dict:
    """``python script --child *args`` in a fresh process (a peak-memory measurement of its own);
    the JSON object on its last line of output."""
    run = subprocess.run([sys.executable, script, "--child", *args], capture_output=True, text=True, check=True)
    return json.loads(run.stdout.strip().splitlines()[-1])
