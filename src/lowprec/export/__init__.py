"""lowprec.export: a trained model to the FP8 layouts inference engines load (and, for mxfp8 /
nvfp4 runs, compressed-tensors' MXFP8 / NVFP4 schemes with the trained microscaled weights).

    from lowprec.export import export_model
    report = export_model(model, "out/fp8", format="hf-fp8")     # or "compressed-tensors"
    print(report)                                                # trained scales or not, what stayed bf16, logit gap

``lowprec export RUN_OR_CHECKPOINT --format hf-fp8 --out DIR`` does the same for a ``lowprec
train`` output directory or one of its checkpoints (:func:`export_run`).
"""

from lowprec.export.casts import FORMATS
from lowprec.export.fp8_base import load_fp8_base
from lowprec.export.model import ExportReport, export_model
from lowprec.export.source import export_after_training, export_run

__all__ = ["FORMATS", "ExportReport", "export_model", "export_run", "export_after_training", "load_fp8_base"]
