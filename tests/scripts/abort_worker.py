"""A launched rank that writes its output, then aborts (SIGABRT) before or after finishing.

``python abort_worker.py OUT_DIR WHEN``: writes ``OUT_DIR/rank<R>.txt``, then by ``WHEN``:
``before``  rank 1 calls ``os.abort()`` inside the script (its work has not returned);
``after``   rank 1 aborts during interpreter finalization, as gloo's exit-time race does (an object
            whose ``__del__`` aborts, held by a module that finalization tears down);
``none``    no abort.
No process group: the launcher's verdict does not depend on one, and the test stays fast.
"""

import os
import sys
import types

out_dir, when = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
    f.write("done\n")


class _AbortWhenFinalized:
    def __del__(self, _abort=os.abort):  # bound now: os may be torn down by then
        _abort()


if rank == 1 and when == "before":
    os.abort()
if rank == 1 and when == "after":
    holder = types.ModuleType("_abort_at_exit")
    holder.obj = _AbortWhenFinalized()
    sys.modules["_abort_at_exit"] = holder
    del holder
print(f"rank {rank} finished", flush=True)
