"""The trainer's data for instruction, chat and pre-tokenized datasets (and any packed data):
config keys -> :class:`~lowprec.train.examples.DataSource` list -> examples -> loaders.

Plain ``completion`` text without packing keeps the token-stream path (``data.build_datasets``),
whose golden loss curves and resume format predate this module."""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

from lowprec.train.data import TokenBatches, build_datasets
from lowprec.train.examples import DataSource, ExampleBatches, build_examples
from lowprec.train.hf_files import dataset_split_files, locate_dataset
from lowprec.train.hf_model import load_run_tokenizer
from lowprec.utils.parallelism import data_shard
from lowprec.train.data_files import ROW_EXTENSIONS, is_saved_dataset, read_rows
from lowprec.train.chat_templates import template_text
from lowprec.train.prompts import PromptOptions

__all__ = ["uses_examples", "data_sources", "example_loaders", "run_data", "DATA_KEYS"]

logger = logging.getLogger("lowprec")


def _files(d: Any, i: int) -> tuple[list[str], Any]:
    """The files entry ``i`` of ``datasets:`` reads and the split to read them with: a cached hub
    dataset's split files (:func:`dataset_split_files`), a directory's data files, or the path."""
    hub = locate_dataset(d.path, f"datasets.{i}.path")
    if hub is not None:
        return dataset_split_files(hub, d.split, f"datasets.{i}", d.name), None
    if d.name is not None:
        raise ValueError(
            f"datasets.{i}.name: {d.name!r} picks a config of a hub dataset (path: org/name, in the local "
            f"cache); {d.path!r} is a local path: drop name"
        )
    if os.path.isdir(d.path) and not is_saved_dataset(d.path):
        paths = sorted(os.path.join(r, f) for r, _, fs in os.walk(d.path) for f in fs if f.endswith(ROW_EXTENSIONS))
        if not paths:
            raise ValueError(f"datasets.{i}: directory {d.path!r} holds no {'/'.join(ROW_EXTENSIONS)} files")
        return paths, d.split
    return [d.path], d.split


def _is_pretokenized(d: Any, i: int) -> bool:
    """An entry without ``type:`` holds pre-tokenized rows when its first row has input_ids."""
    path = d.path
    if path.endswith(".txt") or path.startswith("builtin:") or (os.path.isdir(path) and not is_saved_dataset(path)):
        return False
    paths, split = _files(d, i)
    first = next(iter(read_rows(paths[0], split)), (None, {}))[1]
    return "input_ids" in first


def _resolved_type(d: Any, i: int) -> str:
    if d.type is not None:
        return d.type
    return "pretokenized" if _is_pretokenized(d, i) else "completion"


def uses_examples(cfg: Any) -> bool:
    return (
        bool(cfg.sample_packing)
        or any(_resolved_type(d, i) != "completion" for i, d in enumerate(cfg.datasets))
        or any(
            d.path.endswith(ROW_EXTENSIONS[1:])
            or is_saved_dataset(d.path)
            or d.split
            or locate_dataset(d.path, f"datasets.{i}.path")
            for i, d in enumerate(cfg.datasets)
        )
    )


def data_sources(cfg: Any, tokenizer: Any) -> list:
    out = []
    for i, d in enumerate(cfg.datasets):
        if d.path.startswith("builtin:"):
            raise ValueError(
                f"datasets.{i}: {d.path} is plain text; sample_packing and typed datasets need local files"
            )
        kind = _resolved_type(d, i)
        template = ""
        if kind == "chat_template":
            own = getattr(getattr(tokenizer, "_tok", None), "chat_template", None)
            template = template_text(
                d.chat_template or cfg.chat_template, own, d.chat_template_jinja or cfg.chat_template_jinja
            )
        opt = PromptOptions(
            type=kind,
            field=d.field,
            train_on_inputs=cfg.train_on_inputs,
            chat_template=template,
            field_messages=d.field_messages,
            role_key=d.role_key,
            content_key=d.content_key,
            **({"roles": d.roles} if d.roles else {}),
            roles_to_train=tuple(d.roles_to_train),
            train_on_eos=d.train_on_eos,
            drop_system_message=d.drop_system_message,
            eot_tokens=tuple(cfg.eot_tokens or ()),
        )
        paths, split = _files(d, i)
        out.append(DataSource(tuple(paths), split, opt, f"datasets.{i}"))
    return out


def example_loaders(cfg: Any, tokenizer: Any, acc: Any):
    """(train loader, validation loader or None) of :class:`ExampleBatches`."""
    with acc.main_process_first():  # rank 0 tokenizes and fills the cache; the others read it
        train, val = build_examples(
            data_sources(cfg, tokenizer),
            tokenizer,
            cfg.sequence_len,
            cfg.val_set_size,
            cfg.seed,
            cfg.dataset_prepared_path,
        )
    pack = bool(cfg.sample_packing)
    common = dict(
        seq_len=cfg.sequence_len,
        pad_id=tokenizer.pad_id,
        seed=cfg.seed,
        rank=acc.process_index,
        world_size=acc.num_processes,
        pad_to_sequence_len=bool(cfg.pad_to_sequence_len),
    )
    loader = ExampleBatches(train, cfg.micro_batch_size, pack=pack, **common)
    val_loader = None
    if val is not None:
        eval_pack = pack if cfg.eval_sample_packing is None else bool(cfg.eval_sample_packing)
        val_loader = ExampleBatches(val, cfg.micro_batch_size, pack=eval_pack, shuffle=False, drop_last=False, **common)
    if acc.is_main_process:
        logger.info(
            "lowprec: data %s: %d train examples (%d tokens, %d trained), %d validation examples, %s, key %s",
            train.name,
            len(train),
            train.n_tokens,
            train.n_trained,
            0 if val is None else len(val),
            f"packed into {loader.n_rows} rows of {cfg.sequence_len}" if pack else "one example per row",
            train.fingerprint,
        )
    return loader, val_loader


# data.py's parameter names -> the YAML keys (and flag) a user can change, for its error messages
DATA_KEYS = {
    "seq_len": "sequence_len",
    "max_bytes": "dataset_max_bytes",
    "val_fraction": "val_set_size",
    "batch_size": "micro_batch_size",
    "world_size": "--num_processes",
    "text_field": "datasets[].field",
}


def run_data(cfg: Any, acc: Any):
    """Tokenizer, training batches (this rank's share) and validation batches (or None)."""

    tokenizer = load_run_tokenizer(cfg)
    if uses_examples(cfg):  # instruction / chat / pre-tokenized data, or packing
        return (tokenizer, *example_loaders(cfg, tokenizer, acc))
    with acc.main_process_first():
        train_ds, val_ds = build_datasets(
            cfg.dataset_paths,
            tokenizer,
            seq_len=cfg.sequence_len,
            max_bytes=cfg.dataset_max_bytes,
            val_fraction=cfg.val_set_size,
            seed=cfg.seed,
            text_field=cfg.text_field,
            names=DATA_KEYS,
        )

    # the processes of one tensor-parallel group read the same batches
    rank, world = data_shard(acc.parallelism_config, acc.process_index, acc.num_processes, acc.device.type)
    batches = functools.partial(
        TokenBatches,
        batch_size=cfg.micro_batch_size,
        seq_len=cfg.sequence_len,
        seed=cfg.seed,
        rank=rank,
        world_size=world,
    )
    loader = batches(train_ds, names=DATA_KEYS)
    val_loader = None
    if val_ds is not None:
        val_loader = batches(val_ds, shuffle=False, names={**DATA_KEYS, "batch_size": "micro_batch_size (validation)"})
    if acc.is_main_process:
        logger.info(
            "lowprec: data %s: %d train tokens, %d validation tokens, fingerprint %s",
            train_ds.name,
            train_ds.n_tokens,
            0 if val_ds is None else val_ds.n_tokens,
            train_ds.fingerprint,
        )
    return tokenizer, loader, val_loader
