"""Which lowprec modules one Float8Linear forward passes through: the shape of the engine as a
call stack, per recipe, on CPU (real tensors) and traced as a CUDA GPU (meta tensors,
``fp8.trace_as``: the path the GPU dispatch takes, nothing launched).

Counted with ``sys.setprofile`` over the second forward of a converted ``nn.Linear(256, 256)`` (the first of eight)
under ``fp8.autocast()`` (the first one makes the one-time decisions: probes, self-checks), no
backward. Per run:

- ``modules``: the lowprec modules with at least one Python function called (the package
  ``__init__`` files included where a function in them runs);
- ``deepest_chain``: the longest run of *different* lowprec modules on the stack at one time,
  counting a module once per entry (``linear -> linear_fn -> linear`` is 3) and the chain itself;
- ``calls_between_modules``: calls whose caller is in another lowprec module than the callee.

Nothing here is a timing. ``python benchmarks/forward_path.py`` writes
``benchmarks/results/forward_path.json``."""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import device_name, write_json  # noqa: E402

from lowprec import fp8  # noqa: E402
from lowprec.fp8.gemm.capability import trace_as  # noqa: E402

SRC = str(Path(fp8.__file__).resolve().parents[1])  # .../src/lowprec
RECIPES = ("tensorwise", "delayed", "rowwise", "rowwise_with_gw_hp", "blockwise", "mxfp8", "nvfp4")


def _module(frame) -> str | None:
    path = frame.f_code.co_filename
    if not path.startswith(SRC):
        return None
    rel = path[len(SRC) + 1 : -3].replace("/", ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


class PathCounter:
    """Records the lowprec modules on the Python call stack while active (see module docstring)."""

    def __init__(self) -> None:
        self.modules: Counter[str] = Counter()
        self.between = 0
        self.deepest: list[str] = []
        self._stack: list[str | None] = []

    def __call__(self, frame, event, arg) -> None:
        if event == "call":
            mod = _module(frame)
            caller = next((m for m in reversed(self._stack) if m is not None), None)
            self._stack.append(mod)
            if mod is None:
                return
            self.modules[mod] += 1
            if caller is not None and caller != mod:
                self.between += 1
            chain = self._chain()
            if len(chain) > len(self.deepest):
                self.deepest = chain
        elif event == "return" and self._stack:
            self._stack.pop()

    def _chain(self) -> list[str]:
        out: list[str] = []
        for m in self._stack:
            if m is not None and (not out or out[-1] != m):
                out.append(m)
        return out

    def result(self) -> dict:
        return {
            "modules": len(self.modules),
            "deepest_chain": len(self.deepest),
            "chain": self.deepest,
            "calls_between_modules": self.between,
            "calls_per_module": dict(sorted(self.modules.items())),
        }


def count(recipe: str, traced: bool) -> dict:
    device = "meta" if traced else "cpu"
    # eight layers, the first one counted: recipes that keep their last layers in high precision
    # (nvfp4's high_precision_last) convert it too
    model = torch.nn.Sequential(*(torch.nn.Linear(256, 256, bias=False, device=device) for _ in range(8)))
    fp8.convert(model, recipe=recipe, skip_first_last=False)
    layer = model[0]
    assert type(layer).__name__ != "Linear", f"{recipe}: the layer was not converted"
    x = torch.randn(64, 256, device=device, dtype=torch.bfloat16, requires_grad=True)
    with fp8.autocast():
        layer(x)  # one-time decisions
        counter = PathCounter()
        sys.setprofile(counter)
        try:
            layer(x)
        finally:
            sys.setprofile(None)
    return counter.result()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--recipes", nargs="*", default=list(RECIPES))
    args = ap.parse_args()
    results = []
    for recipe in args.recipes:
        results.append({"recipe": recipe, "path": "cpu", **count(recipe, False)})
        sm = (10, 0) if recipe in ("mxfp8", "nvfp4") else (9, 0)
        try:
            with trace_as(sm=sm):
                traced = count(recipe, True)
            results.append({"recipe": recipe, "path": f"traced as sm_{sm[0]}{sm[1]}", **traced})
        except Exception as exc:  # noqa: BLE001 - recorded, never invented
            results.append({"recipe": recipe, "path": f"traced as sm_{sm[0]}{sm[1]}", "error": repr(exc)[:300]})
        for r in results[-2:]:
            print(f"{r['recipe']:>20} {r['path']:>16}: ", end="")
            print(r.get("error") or f"{r['modules']} modules, deepest chain {r['deepest_chain']}")
    payload = {
        "device": f"{device_name(torch.device('cpu'))}; traced rows: meta tensors as CUDA, nothing launched",
        "layer": "fp8.convert(nn.Linear(256, 256)), x (64, 256) bf16, the second forward, no backward",
        "results": results,
    }
    write_json(payload, args.out, "forward_path.json")


if __name__ == "__main__":
    main()
