"""``python -m lowprec.cli._torchrun <torchrun args>``: torchrun, ending in one lowprec line.

When a worker dies, torchrun ends with a 40-line ``ChildFailedError`` traceback that names
neither the cause in plain words nor what to do next. This runs torchrun's own ``run`` and turns
that ending into one line: which rank failed first, its exit cause (exit code or signal), and
the command that continues (``LOWPREC_CONTINUE_COMMAND``, set by ``lowprec train`` /
``lowprec launch``). The exit code is the failed worker's (128 + N for signal N).
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Optional, Sequence

__all__ = ["main", "describe_exit", "CONTINUE_VAR"]

CONTINUE_VAR = "LOWPREC_CONTINUE_COMMAND"


def describe_exit(code: int) -> str:
    """``exit code 1`` / ``killed by SIGKILL (signal 9)``."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name} (signal {-code})" + (" (out of memory, or killed by hand?)" if -code == 9 else "")
    return f"exit code {code}"


def _continue_hint() -> str:
    cmd = os.environ.get(CONTINUE_VAR)
    return f"; to continue: {cmd}" if cmd else ""


def main(argv: Optional[Sequence[str]] = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        run(args)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        code = failure.exitcode
        print(
            f"lowprec: rank {rank} (local rank {failure.local_rank}, pid {failure.pid}) failed first: "
            f"{describe_exit(code)}; the other workers were stopped{_continue_hint()}",
            file=sys.stderr,
        )
        return 128 - code if code < 0 else (code or 1)
    except (SignalException, KeyboardInterrupt) as exc:
        sig = getattr(exc, "sigval", signal.SIGINT)
        print(f"lowprec: interrupted ({signal.Signals(sig).name}); the workers were stopped{_continue_hint()}",
              file=sys.stderr)
        return 128 + int(sig)
    return 0


if __name__ == "__main__":
    sys.exit(main())
