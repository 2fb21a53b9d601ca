"""Reliability table 1b: tampered sharded (DCP) checkpoints execute nothing.

A sharded checkpoint holds DCP's ``.metadata`` (a pickle), ``__{rank}_0.distcp`` files (tensor
items and byte items, each a ``torch.save`` blob at an offset the metadata records) and
lowprec's per-run files (JSON, safetensors). Every kind is replaced by a payload that creates a
marker file when unpickled: ``__reduce__`` to ``os.system``, protocol-4 dotted names that walk
from an allowed module to ``subprocess.Popen``, ``io.FileIO`` or ``eval``. Each payload is
first shown to run when loaded the way DCP loads it (the control rows), so the table can fail.
Loading must be refused with one line naming the file, on every process, with one process and
with two, and the markers must never appear.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import re
import shutil
import subprocess
import textwrap

import pytest
import torch

from lowprec.checkpoint.sharded import SafeFileSystemReader, SafeLoadPlanner
from lowprec.errors import CheckpointError

WALK_MODULE = "torch.distributed.checkpoint.metadata"  # allowed module; its attributes reach torch, os, io ...
POPEN = "torch._strobelight.cli_function_profiler.subprocess.Popen"


class Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _unicode(text: str) -> bytes:
    raw = text.encode()
    return b"\x8c" + bytes([len(raw)]) + raw  # SHORT_BINUNICODE


def call_payload(module: str, name: str, args: tuple, opcode: str = "STACK_GLOBAL") -> bytes:
    """A protocol-4 pickle of ``module``/``name`` resolved by pickle (dotted names walk
    attributes), called with ``args``."""
    push_args = pickle.dumps(args, protocol=2)[2:-1]  # the opcodes that build the tuple
    if opcode == "STACK_GLOBAL":
        head = _unicode(module) + _unicode(name) + b"\x93"
    else:  # the text opcode, which protocol 4 also resolves through dotted names
        head = b"c" + module.encode() + b"\n" + name.encode() + b"\n"
    return b"\x80\x04" + head + push_args + b"R."


def metadata_payloads(marker: str) -> dict[str, bytes]:
    real = _tiny_metadata()
    real.storage_meta = Evil(marker)  # real metadata, one entry swapped for a payload
    return {
        "reduce-os.system": pickle.dumps(Evil(marker)),
        "walk-popen": call_payload(WALK_MODULE, POPEN, (["touch", marker],)),
        "walk-fileio-global": call_payload(
            "torch.distributed.checkpoint.filesystem", "io.FileIO", (marker, "w"), opcode="GLOBAL"
        ),
        "walk-eval": call_payload(WALK_MODULE, "torch.builtins.eval", (f"__import__('os').system('touch {marker}')",)),
        "builtins.eval": call_payload("builtins", "eval", (f"__import__('os').system('touch {marker}')",)),
        "torch-walk-popen": call_payload("torch", POPEN.split(".", 1)[1], (["touch", marker],)),
        "pathlib-walk-os.system": call_payload("pathlib", "os.system", (f"touch {marker}",)),
        "nested-in-real-metadata": pickle.dumps(real),
    }


def _tiny_metadata():
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex

    return Metadata(
        state_dict_metadata={"lr": BytesStorageMetadata()},
        storage_data={MetadataIndex("lr"): _StorageInfo("__0_0.distcp", 0, 1)},
    )


def _settle(value) -> None:
    if isinstance(value, subprocess.Popen):
        value.wait()  # the control: let the spawned `touch` finish before looking for its marker
    elif isinstance(value, io.IOBase):
        value.close()


@pytest.mark.parametrize("name", list(metadata_payloads("m")))
def test_metadata_payloads_are_live_when_unpickled(tmp_path, name):
    """Control: DCP's own reader (pickle.load) runs every payload of the table."""
    marker = tmp_path / "MARKER"
    _settle(pickle.loads(metadata_payloads(str(marker))[name]))
    assert marker.exists(), name


@pytest.mark.parametrize("name", list(metadata_payloads("m")))
def test_metadata_payload_is_refused_before_it_runs(tmp_path, name):
    marker = tmp_path / "MARKER"
    (tmp_path / ".metadata").write_bytes(metadata_payloads(str(marker))[name])
    with pytest.raises(CheckpointError) as info:
        SafeFileSystemReader(str(tmp_path)).read_metadata()
    assert not marker.exists(), f"{name}: the payload ran"
    assert re.search(r"\.metadata is not DCP metadata \(it names .*refused", str(info.value)), str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("path", ["../outside.distcp", "/etc/passwd", "sub/__0_0.distcp"])
def test_metadata_pointing_outside_its_directory_is_refused(tmp_path, path):
    md = _tiny_metadata()
    md.storage_data = {k: dataclasses.replace(v, relative_path=path) for k, v in md.storage_data.items()}
    (tmp_path / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointError, match="points outside its directory"):
        SafeFileSystemReader(str(tmp_path)).read_metadata()


def test_allowed_globals_are_exact_pairs_without_dots():
    from lowprec.checkpoint.sharded import _allowed_globals

    allowed = _allowed_globals()
    assert all("." not in name for _, name in allowed)
    assert not any(
        callable(v) and not isinstance(v, type)
        for k, v in allowed.items()
        if k != ("torch.serialization", "_get_layout")
    )  # classes only, but the layout lookup


# ----------------------------------------------------------------------------- .distcp items, no processes
def replace_item(sharded_dir: str, fqn: str, blob: bytes, file: str | None = None) -> str:
    """Rewrite the ``.distcp`` file holding ``fqn`` (the entry in ``file`` if given) with ``blob``
    in place of that item, and the metadata with the new offsets, as an attacker with write access
    would. Returns the file's name."""
    with open(os.path.join(sharded_dir, ".metadata"), "rb") as f:
        md = pickle.load(f)  # our own test checkpoint: trusted
    target = next(i for i, s in md.storage_data.items() if i.fqn == fqn and file in (None, s.relative_path))
    name = md.storage_data[target].relative_path
    with open(os.path.join(sharded_dir, name), "rb") as f:
        data = f.read()
    entries = sorted(((i, s) for i, s in md.storage_data.items() if s.relative_path == name), key=lambda e: e[1].offset)
    out = bytearray()
    for index, info in entries:
        piece = blob if index == target else data[info.offset : info.offset + info.length]
        md.storage_data[index] = dataclasses.replace(info, offset=len(out), length=len(piece))
        out += piece
    with open(os.path.join(sharded_dir, name), "wb") as f:
        f.write(bytes(out))
    with open(os.path.join(sharded_dir, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    return name


def evil_blob(marker: str) -> bytes:
    buf = io.BytesIO()
    torch.save({"p": Evil(marker)}, buf)
    return buf.getvalue()


def _dcp_checkpoint(directory: str) -> dict:
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.arange(6.0), "group": {"lr": 0.1, "betas": (0.9, 0.99), "fused": None}}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(directory), no_dist=True)
    return state


def _load(directory: str, planner=None) -> dict:
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.zeros(6), "group": {"lr": 0.0, "betas": (0.0, 0.0), "fused": False}}
    dcp.load(state, storage_reader=SafeFileSystemReader(directory), planner=planner, no_dist=True)
    return state


def test_byte_items_load_with_the_safe_planner(tmp_path):
    saved = _dcp_checkpoint(str(tmp_path))
    assert _load(str(tmp_path), SafeLoadPlanner())["group"] == saved["group"]


@pytest.mark.parametrize("fqn", ["group.lr", "w"])
def test_tampered_distcp_item_runs_nothing(tmp_path, fqn):
    from torch.distributed.checkpoint.api import CheckpointException

    from lowprec.checkpoint.sharded import _first_failure

    _dcp_checkpoint(str(tmp_path))
    marker = tmp_path / "MARKER"
    name = replace_item(str(tmp_path), fqn, evil_blob(str(marker)))
    if fqn == "group.lr":  # control: DCP's default planner unpickles byte items with weights_only=False
        _load(str(tmp_path))
        assert marker.exists()
        marker.unlink()
    with pytest.raises(CheckpointException) as info:  # DCP bundles each process's exception
        _load(str(tmp_path), SafeLoadPlanner())
    assert not marker.exists()
    own = _first_failure(info.value)
    assert isinstance(own, CheckpointError) and "\n" not in str(own)
    assert f"{name}" in str(own) and "posix.system" in str(own) and "refused" in str(own), str(own)


# ----------------------------------------------------------------------------- one and two processes
WORKER = textwrap.dedent(
    """
    import json, os, sys
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    from lowprec import Accelerator
    from lowprec.errors import CheckpointError
    from lowprec.kwargs import FullyShardedDataParallelPlugin, NativeRecipeKwargs

    mode, out_dir = sys.argv[1], sys.argv[2]
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    acc = Accelerator(mixed_precision="fp8", fsdp_plugin=plugin,
                      kwargs_handlers=[NativeRecipeKwargs(recipe="delayed", overrides={"amax_history_len": 4})])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dl = DataLoader(TensorDataset(torch.randn(16, 16)), batch_size=8 // world)
    model, opt, dl = acc.prepare(model, opt, dl)
    report = {}
    if mode == "save":
        (x,) = next(iter(dl))
        acc.backward(model(x).float().pow(2).mean())
        opt.step()
        acc.save_state(os.path.join(out_dir, "ckpt"))
    else:
        with open(os.path.join(out_dir, "cases.json")) as f:
            cases = json.load(f)
        for case, directory in cases.items():
            try:
                acc.load_state(directory)
                report[case] = "loaded"
            except CheckpointError as exc:
                report[case] = str(exc)
            acc.wait_for_everyone()
    with open(os.path.join(out_dir, f"{mode}_rank{rank}.json"), "w") as f:
        json.dump(report, f)
    acc.end_training()
    """
)


def _launch(tmp_path, mode: str, nproc: int) -> None:
    from tests.test_checkpoint_sharded import launch

    launch(tmp_path, mode, nproc, worker=WORKER)


def _cases(tmp_path, nproc: int) -> dict[str, tuple[str, str]]:
    """case -> (tampered copy, the file name the refusal must name); every file kind of the checkpoint."""
    ckpt = tmp_path / "ckpt"
    cases = {"untampered": (str(ckpt), "")}

    def copy(case: str) -> str:
        target = tmp_path / "cases" / case
        shutil.copytree(ckpt, target)
        return str(target)

    for payload, blob in metadata_payloads(str(tmp_path / "MARKER-metadata")).items():
        d = copy(f"metadata-{payload}")
        with open(os.path.join(d, "sharded_0", ".metadata"), "wb") as f:
            f.write(blob)
        cases[f"metadata-{payload}"] = (d, ".metadata")
    d = copy("distcp-byte-item")
    name = replace_item(
        os.path.join(d, "sharded_0"), "optimizer.param_groups.0.lr", evil_blob(str(tmp_path / "MARKER-b"))
    )
    cases["distcp-byte-item"] = (d, name)
    for r in range(nproc):  # a tensor chunk in each process's own file
        d = copy(f"distcp-tensor-rank{r}")
        name = replace_item(
            os.path.join(d, "sharded_0"),
            "model.0.weight",
            evil_blob(str(tmp_path / f"MARKER-t{r}")),
            file=f"__{r}_0.distcp",
        )
        cases[f"distcp-tensor-rank{r}"] = (d, name)
    per_run = ["lowprec_state.json", "dataloader_0.json"]
    per_rank = [f"{stem}{r}.safetensors" for stem in ("random_states_", "buffers_0_rank") for r in range(nproc)]
    for stem in ("random_states_", "buffers_0_rank"):  # every process's copy, so every process refuses
        d = copy(stem.rstrip("_"))
        for r in range(nproc):
            target = os.path.join(d, f"{stem}{r}.safetensors")
            os.remove(target)
            torch.save({"p": Evil(str(tmp_path / f"MARKER-{stem}{r}"))}, target)
        cases[stem.rstrip("_")] = (d, stem)  # each process names its own file
    for name in per_run:
        d = copy(name)
        os.remove(os.path.join(d, name))
        torch.save({"p": Evil(str(tmp_path / f"MARKER-{name}"))}, os.path.join(d, name))
        cases[name] = (d, name)
    assert set(os.listdir(ckpt)) == set(per_run) | set(per_rank) | {"sharded_0"}  # every file kind is a row
    return cases


@pytest.mark.parametrize("nproc", [1, 2])
def test_tampered_sharded_checkpoint_runs_nothing_on_any_process(tmp_path, nproc):
    _launch(tmp_path, "save", nproc)
    cases = _cases(tmp_path, nproc)
    (tmp_path / "cases.json").write_text(json.dumps({c: d for c, (d, _) in cases.items()}))
    _launch(tmp_path, "load", nproc)
    markers = sorted(p.name for p in tmp_path.glob("MARKER*"))
    assert not markers, f"tampered files ran their code: {markers}"
    for r in range(nproc):
        report = json.loads((tmp_path / f"load_rank{r}.json").read_text())
        assert report.pop("untampered") == "loaded"  # the allow-lists admit what DCP writes
        assert set(report) == set(cases) - {"untampered"}
        for case, message in report.items():
            assert message != "loaded", f"rank {r}: {case} was accepted"
            assert cases[case][1] in message and "\n" not in message, (r, case, message)
