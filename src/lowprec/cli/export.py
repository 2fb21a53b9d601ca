"""``lowprec export RUN_OR_CHECKPOINT --format hf-fp8|compressed-tensors --out DIR``: the parser (the
run: :mod:`lowprec.cli.runners.export`)."""

from __future__ import annotations

import argparse

NAME = "export"
HELP = "write a trained run or checkpoint in an FP8 format inference engines load"

FORMATS = ("hf-fp8", "compressed-tensors")  # lowprec.export.FORMATS, without importing torch here


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        NAME,
        help=HELP,
        description=HELP + ". Layers trained in high precision stay bf16 "
        "and are listed in the config's ignore list; trained scales are kept where the "
        "recipe's weight cast is the format's (blockwise -> hf-fp8; tensorwise, rowwise, "
        "blockwise, mxfp8, nvfp4 -> compressed-tensors per tensor, channel, block, MXFP8, NVFP4).",
    )
    p.add_argument(
        "path", metavar="RUN_OR_CHECKPOINT", help="a `lowprec train` output_dir or one of its checkpoint-N directories"
    )
    p.add_argument(
        "--format",
        required=True,
        choices=FORMATS,
        help="hf-fp8 (transformers fine-grained FP8, 128x128 "
        "blocks) or compressed-tensors (FP8 per tensor / channel / block, MXFP8, NVFP4)",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="the directory to write (created)")
    p.add_argument(
        "--requantize",
        action="store_true",
        help="quantize once with the format's rule where the recipe's own scales cannot be kept "
        "(mxfp8, nvfp4 -> hf-fp8)",
    )
    return p
