"""Out-of-memory helpers: ``find_executable_batch_size`` retries a function with a smaller batch
size after an out-of-memory error (Accelerate's decorator and its 0.9 shrink factor)."""

from __future__ import annotations

import functools
import gc
import inspect
from typing import Any, Callable, Optional

import torch

__all__ = ["find_executable_batch_size", "should_reduce_batch_size", "release_memory", "clear_device_cache"]

_OOM_MESSAGES = (
    "CUDA out of memory.",  # CUDA OOM
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",  # CUDNN SNAFU
    "DefaultCPUAllocator: can't allocate memory",  # CPU OOM
    "CUDA error: out of memory",
    "out of memory.",  # "<DEVICE> out of memory." (XPU, NPU, ... and CPU, Accelerate's wording)
)


def clear_device_cache(garbage_collection: bool = False) -> None:
    if garbage_collection:
        gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def release_memory(*objects: Any) -> list:
    """Drop the references passed (returns a list of ``None``, one per object) and free caches."""
    released: list = list(objects)
    for i in range(len(released)):
        released[i] = None
    clear_device_cache(garbage_collection=True)
    return released


def should_reduce_batch_size(exception: BaseException) -> bool:
    """Whether ``exception`` is an out-of-memory error (retrying smaller may succeed)."""
    if isinstance(exception, torch.cuda.OutOfMemoryError):
        return True
    return (
        isinstance(exception, RuntimeError)
        and len(exception.args) == 1
        and any(m in str(exception.args[0]) for m in _OOM_MESSAGES)
    )


def find_executable_batch_size(
    function: Optional[Callable] = None,
    starting_batch_size: int = 128,
    reduce_batch_size_fn: Optional[Callable[[], int]] = None,
):
    """Decorator: calls ``function(batch_size, *args)``, shrinking ``batch_size`` to 90% after each
    out-of-memory error until it runs; other errors propagate."""
    if function is None:
        return functools.partial(
            find_executable_batch_size,
            starting_batch_size=starting_batch_size,
            reduce_batch_size_fn=reduce_batch_size_fn,
        )
    batch_size = starting_batch_size
    if reduce_batch_size_fn is None:

        def reduce_batch_size_fn() -> int:
            return int(batch_size * 0.9)

    @functools.wraps(function)
    def decorator(*args: Any, **kwargs: Any):
        nonlocal batch_size
        clear_device_cache(garbage_collection=True)
        params = list(inspect.signature(function).parameters)
        if len(params) < len(args) + 1:
            given = ", ".join(f"{p}={v}" for p, v in zip(params[1:], args[1:]))
            raise TypeError(
                f"Batch size was passed into `{function.__name__}` as the first argument when called. "
                f"Remove it, the decorator passes it: `{function.__name__}({given})`"
            )
        while True:
            if batch_size == 0:
                raise RuntimeError("No executable batch size found, reached zero.")
            try:
                return function(batch_size, *args, **kwargs)
            except Exception as e:  # noqa: BLE001 - re-raised unless it is an out-of-memory error
                if not should_reduce_batch_size(e):
                    raise
                clear_device_cache(garbage_collection=True)
                batch_size = reduce_batch_size_fn()

    return decorator
