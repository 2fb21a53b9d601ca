"""Trainer keys for distributed training: FSDP2 and DeepSpeed."""

from __future__ import annotations

import os
from typing import Any, Literal, Optional, Union

from pydantic import Field, field_validator, model_validator

from lowprec.train.config.base import StrictModel
from lowprec.config.json_file import read_json_object

__all__ = ["FSDPConfig", "DistributedKeys"]


class FSDPConfig(StrictModel):
    """``fsdp_config:`` (FSDP2, ``torch.distributed.fsdp.fully_shard``). Axolotl's keys."""

    reshard_after_forward: bool = Field(default=True, description="free gathered weights after forward (ZeRO-3 style)")
    transformer_layer_cls_to_wrap: str = Field(
        default="LlamaDecoderLayer", description="module class sharded as its own unit (one all-gather per block)"
    )
    auto_wrap_policy: Literal["TRANSFORMER_BASED_WRAP"] = Field(
        default="TRANSFORMER_BASED_WRAP", description="TRANSFORMER_BASED_WRAP (the only policy with FSDP2 here)"
    )
    offload_params: Literal[False] = Field(
        default=False, description="CPU offload of parameters (not supported: false)"
    )
    state_dict_type: Literal["FULL_STATE_DICT", "SHARDED_STATE_DICT"] = Field(
        default="FULL_STATE_DICT",
        description="FULL_STATE_DICT: checkpoints hold full (gathered) tensors; "
        "SHARDED_STATE_DICT: each process writes its shards (torch.distributed.checkpoint), loadable on "
        "any number of processes",
    )


class DistributedKeys(StrictModel):
    fsdp_version: Optional[int] = Field(
        default=None, description="2: shard the model with FSDP2 (under --num_processes N)"
    )
    fsdp_config: Optional[FSDPConfig] = Field(default=None, description="FSDP2 settings (needs fsdp_version: 2)")
    tensor_parallel_size: int = Field(
        default=1,
        ge=1,
        description="tensor parallel processes per model replica (Axolotl's key; the built-in "
        "model's _tp_plan; FP8 layers need fp8_recipe: tensorwise); the other processes shard with FSDP2",
    )
    sequence_parallel: bool = Field(
        default=False,
        description="Megatron-style sequence parallelism inside each tensor-parallel group (needs "
        "tensor_parallel_size > 1): norms and the residual stream on sequence slices, attention/MLP inputs all-gathered "
        "in FP8 under fp8; not Axolotl's sequence_parallel_degree (context-parallel attention)",
    )
    ep_size: int = Field(
        default=1,
        ge=1,
        description="expert parallelism: the FP8 experts of an MoE model (builtin:moe-tiny, transformers' fused "
        "experts) sharded over this many consecutive processes (a divisor of --num_processes; with more processes, each "
        "group of ep_size is a replica and the expert gradients are averaged over them), tokens dispatched in FP8 "
        "(fp8: true; tensorwise or rowwise, other recipes dispatch in bf16); the other weights train under DDP, or FSDP2 with fsdp_version: 2; "
        "torchtitan's expert_parallel_degree is accepted for it",
    )
    ep_combine: Literal["hp", "bf16", "fp8"] = Field(
        default="hp",
        description="with ep_size > 1: the wire format of the expert outputs going back to their tokens' processes "
        "(and of the dispatch gradient): hp (their own dtype, bf16 under bf16 training), bf16, or fp8 (E4M3 + a "
        "scale per row: 0.52x bf16 bytes, 0.6 dB less output SQNR)",
    )
    deepspeed: Optional[Union[str, dict[str, Any]]] = Field(
        default=None, description="DeepSpeed config: a JSON file path or an inline mapping"
    )

    @model_validator(mode="before")
    @classmethod
    def _ep_alias(cls, v: Any) -> Any:
        """torchtitan's ``expert_parallel_degree``: the same key as ``ep_size`` (Accelerate's)."""
        if isinstance(v, dict) and "expert_parallel_degree" in v:
            v = dict(v)
            alias = v.pop("expert_parallel_degree")
            if "ep_size" in v and v["ep_size"] != alias:
                raise ValueError(
                    f"ep_size: {v['ep_size']} and expert_parallel_degree: {alias} are one setting under two names; keep one"
                )
            v["ep_size"] = alias
        return v

    @field_validator("deepspeed")
    @classmethod
    def _deepspeed(cls, v: Optional[Union[str, dict[str, Any]]]) -> Optional[Union[str, dict[str, Any]]]:
        if isinstance(v, str) and not os.path.isfile(v):
            raise ValueError(f"DeepSpeed config file {v!r} not found; give a JSON file path or an inline mapping")
        if isinstance(v, str):  # read now: a broken file would otherwise fail inside every worker
            try:
                read_json_object(v)
            except ValueError as exc:
                raise ValueError(f"DeepSpeed config file: {exc}") from None
        return v

    @field_validator("fsdp_version")
    @classmethod
    def _fsdp_version(cls, v: Optional[int]) -> Optional[int]:
        if v is not None and v != 2:
            raise ValueError(f"{v} is not supported; lowprec shards with FSDP2 only: set fsdp_version: 2")
        return v
