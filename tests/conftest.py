import os
import signal
import tempfile

import pytest
import torch

# Two CI cores, several test processes: keep each one single-threaded and deterministic.
torch.set_num_threads(int(os.environ.get("LOWPREC_TEST_THREADS", "1")))
# Per-machine measurements (the CPU FP8 GEMM probe) go to one folder shared by every test
# process and subprocess of this machine, as they would for a user, but not to the user's home.
os.environ.setdefault("LOWPREC_CACHE_HOME", os.path.join(tempfile.gettempdir(), f"lowprec-test-cache-{os.getuid()}"))


@pytest.fixture
def seed(request):
    """A fresh seed per test (derived from its name), so data is random but reproducible."""
    import zlib

    s = zlib.crc32(request.node.nodeid.encode()) % (2**31)
    torch.manual_seed(s)
    return s


def sqnr(ref: torch.Tensor, test: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB, computed in float64."""
    ref, test = ref.detach().double(), test.detach().double()
    noise = (ref - test).pow(2).sum()
    return float(10 * torch.log10(ref.pow(2).sum() / noise.clamp_min(1e-300)))


def assert_within_gemm_bound(got, ref, a, b, *, output_roundings: int, scale_roundings: int = 0) -> None:
    """``got`` and ``ref`` are two kernels' results for ``dequant(a) @ dequant(b)``.

    The documented bound (lowprec/fp8/gemm/cpu.py): the same exact products summed in another
    order (at most ``K * eps32 * (|A| @ |B|)``), plus ``output_roundings`` roundings of the
    output to bf16 (each at most one bf16 ulp, ``2**-7`` relative) on top of the reference's,
    plus ``scale_roundings`` float32 roundings where the two apply scales that are not powers of
    two in different places (the dequantized operands against a scale epilogue: each ``eps32 *
    (|A| @ |B|)``). Computed in float64 from the operands, so it holds on any CPU's summation order.
    """
    da, db = a.dequantize().double(), b.dequantize().double()
    k = da.shape[1]
    magnitude = da.abs() @ db.abs()
    bound = (k + scale_roundings) * torch.finfo(torch.float32).eps * magnitude
    if output_roundings or got.dtype == torch.bfloat16 or ref.dtype == torch.bfloat16:
        bound = bound + (output_roundings + 1) * 2.0**-7 * ref.double().abs()
    err = (got.double() - ref.double()).abs()
    worst = (err - bound).max().item()
    assert worst <= 0, f"kernels differ beyond the documented bound by {worst:.3e}"


@pytest.fixture(autouse=True)
def _no_leftover_process_group():
    """A test that built an in-process Accelerator (FSDP2 / DeepSpeed in one process) leaves a
    default process group behind; tests that fork workers must not inherit it."""
    yield
    import torch.distributed as dist

    from lowprec.group_lifetime import forget_deepspeed_groups

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        forget_deepspeed_groups()  # DeepSpeed's groups cached from that group: the next engine's fail


# The files whose tests take the longest (each over ~40 s of one core on CI's 2-core machine,
# most of it in processes they launch), longest first. They run before the rest: pytest-xdist
# hands tests out in order, so the suite ends on short tests and neither worker idles while the
# other finishes a long one. Only the order changes; every test still runs.
LONG_FIRST = (
    "test_train_ep.py",
    "test_accelerate_conformance.py",
    "test_fp8_nvfp4_kernels_interpret.py",
    "test_examples_accelerate.py",
    "test_fp8_kernels_interpret.py",
    "test_benchmarks.py",
    "test_trainer_accelerator.py",
    "test_msamp_deepspeed.py",
    "test_fp8_kernels_compile.py",
    "test_expert_parallel.py",
    "test_integrations_transformers.py",
    "test_train_run.py",
    "test_examples_transformers.py",
    "test_gpu_command.py",
    "test_fp8_compile.py",
    "test_accelerate_scripts.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: file order kept within
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        # the marker, not ``"gpu" in item.keywords``: keywords hold the names of the folders
        # above the test too, so a checkout in a folder named "gpu" skipped every test
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _restore_lowprec_logger():
    """``lowprec train`` run in-process sets up the "lowprec" logger for a terminal (its own
    handler, propagate off); every test starts and ends with the logger as a fresh process has
    it, so caplog sees its records even after a module- or session-scoped fixture trained (a
    per-test save/restore would keep such a fixture's settings for the rest of the worker)."""
    import logging

    log = logging.getLogger("lowprec")

    def pristine():
        log.handlers[:], log.propagate, log.level, log.disabled = [], True, logging.NOTSET, False

    pristine()
    yield
    pristine()


@pytest.fixture
def ds_env(monkeypatch):
    """One in-process DeepSpeed rank on its CPU accelerator: torchrun's variables for a world of
    one (a fresh rendezvous port), no launch settings from the shell or another test."""
    from tests.torchrun_util import free_port

    for name in list(os.environ):
        if name.startswith(("ACCELERATE_", "LOWPREC_", "FSDP_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    for name, value in (
        ("LOCAL_RANK", "0"),
        ("RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("LOCAL_WORLD_SIZE", "1"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", str(free_port())),
    ):
        monkeypatch.setenv(name, value)


def terminal_sigint() -> None:
    """``preexec_fn`` for a child process a test interrupts with SIGINT: SIGINT at its default, as
    under a terminal. A test runner started in the background (``nohup ... &``) has SIGINT ignored,
    and an ignored signal is inherited by children: they would never see the Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture
def sigint_as_in_a_terminal():
    """Python's own SIGINT handler in this process for the test (see :func:`terminal_sigint`),
    the previous disposition restored afterwards."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)
