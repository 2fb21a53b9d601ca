"""``accelerate launch`` options that are not launch settings: what lowprec does with each.

Every option of Accelerate's ``accelerate launch`` parser is accepted by ``lowprec launch``
(tests/test_cli_launch.py enumerates Accelerate's own parser). The launch settings
(``--mixed_precision``, ``--fp8_*``, ``--fsdp_*`` ...) are in ``cli/_flags.py``; the rest is here,
one row each, as one of:

- an effect on how the processes start: torchrun's own options (:data:`TORCHRUN_OPTIONS`),
  ``--num_cpu_threads_per_process`` (``OMP_NUM_THREADS``), ``--dynamo_mode`` / ``--dynamo_use_fullgraph`` /
  ``--dynamo_use_dynamic`` (``ACCELERATE_DYNAMO_*``, read by ``TorchDynamoPlugin``), ``--debug``
  (``ACCELERATE_DEBUG_MODE``), ``--quiet``, ``--multi_gpu``, ``--no_python``, ``--rdzv_backend``;
- refused (:data:`REFUSED`): it asks for something lowprec does not run (TPU, Megatron-LM);
- ignored (:data:`IGNORED`): it tunes something lowprec does not run; launch accepts it and
  notes once which option is ignored and why.

The YAML keys of the same names (``debug``, ``rdzv_backend``, ``enable_cpu_affinity``, ``tpu_*``,
FSDP1 keys ...) take the same rows (``config/launch_config.py``). Pure data, no torch, no pydantic.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "TORCHRUN_OPTIONS",
    "REFUSED",
    "IGNORED",
    "SWITCHES",
    "APPENDED",
    "ignored_note",
    "unless_default",
]

# torchrun's options of the same meaning (run under torchrun only: several processes or machines)
TORCHRUN_OPTIONS: dict[str, type] = {
    "tee": str,
    "log_dir": str,
    "role": str,
    "rdzv_conf": str,
    "max_restarts": int,
    "monitor_interval": float,
}

REFUSED: dict[str, str] = {
    "tpu": "lowprec does not run on TPU (XLA); drop it (GPUs: --multi_gpu, CPUs: --cpu)",
    "use_megatron_lm": "Megatron-LM is not run by lowprec; shard with --use_fsdp and --tp_size, or --use_deepspeed",
    "downcast_bf16": "downcast_bf16 is a TPU option; lowprec does not run on TPU: remove it",
}

_TPU = "a TPU option; lowprec does not run on TPU"
_FSDP1 = "an FSDP1 option; FSDP2 (fully_shard), which lowprec runs, has no such setting"
_DS_LAUNCHER = (
    "an option of DeepSpeed's multi-machine launcher; lowprec starts each machine under torchrun "
    "(run lowprec launch on each with --machine_rank)"
)
_CP_SP = "a context/sequence parallelism option; lowprec runs neither (their sizes must be 1)"
_MEGATRON = "a Megatron-LM option (read with --use_megatron_lm only, which lowprec does not run)"

IGNORED: dict[str, str] = {
    "tpu_use_cluster": _TPU,
    "tpu_use_sudo": _TPU,
    "tpu_env": _TPU,
    "vm": _TPU,
    "env": _TPU + " (the variables it sets go to TPU pod workers)",
    "enable_cpu_affinity": "NUMA CPU affinity of GPU processes is not implemented in lowprec",
    "main_training_function": "read by Accelerate's notebook and TPU launchers only",
    "use_parallelism_config": "lowprec applies the --parallelism_config_* sizes whenever they are given",
    "aws_access_key_id": "a SageMaker option; lowprec launches on this machine only",
    "aws_secret_access_key": "a SageMaker option; lowprec launches on this machine only",
    "mpirun_hostfile": "several CPU processes start under torchrun in lowprec, not mpirun",
    "dynamo_use_regional_compilation": "regional compilation is not implemented in lowprec; the whole model compiles",
    "fsdp_backward_prefetch": _FSDP1,
    "fsdp_forward_prefetch": _FSDP1,
    "fsdp_use_orig_params": _FSDP1,
    "fsdp_sync_module_states": _FSDP1,
    "fsdp_activation_checkpointing_offload": "activation offloading is not implemented in lowprec's FSDP2",
    "zero3_save_16bit_model": "nothing in lowprec reads it",
    "offload_optimizer_nvme_path": "lowprec does not pass it to DeepSpeed; set the nvme path in --deepspeed_config_file",
    "offload_param_nvme_path": "lowprec does not pass it to DeepSpeed; set the nvme path in --deepspeed_config_file",
    "deepspeed_hostfile": _DS_LAUNCHER,
    "deepspeed_exclusion_filter": _DS_LAUNCHER,
    "deepspeed_inclusion_filter": _DS_LAUNCHER,
    "deepspeed_multinode_launcher": _DS_LAUNCHER,
    "deepspeed_moe_layer_cls_names": "lowprec's DeepSpeed setup does not read it",
    "parallelism_config_cp_backend": _CP_SP,
    "parallelism_config_cp_comm_strategy": _CP_SP,
    "parallelism_config_sp_backend": _CP_SP,
    "parallelism_config_sp_seq_length": _CP_SP,
    "parallelism_config_sp_seq_length_is_variable": _CP_SP,
    "parallelism_config_sp_attn_implementation": _CP_SP,
}
IGNORED.update(
    {
        f"megatron_lm_{name}": _MEGATRON
        for name in (
            "tp_degree",
            "use_custom_fsdp",
            "no_load_optim",
            "eod_mask_loss",
            "overlap_cpu_optimizer_d2h_h2d",
            "no_save_optim",
            "optimizer_cpu_offload",
            "use_precision_aware_optimizer",
            "decoder_last_pipeline_num_layers",
            "pp_degree",
            "num_micro_batches",
            "sequence_parallelism",
            "recompute_activations",
            "use_distributed_optimizer",
            "gradient_clipping",
            "recompute_granularity",
            "recompute_method",
            "recompute_num_layers",
            "attention_backend",
            "expert_model_parallel_size",
            "context_parallel_size",
            "attention_dropout",
            "hidden_dropout",
            "attention_softmax_in_fp32",
            "expert_tensor_parallel_size",
            "calculate_per_token_loss",
            "use_rotary_position_embeddings",
        )
    }
)

# options that take no value (the rest take one; APPENDED ones may repeat)
SWITCHES = frozenset(
    {
        "tpu",
        "use_megatron_lm",
        "downcast_bf16",
        "tpu_use_sudo",
        "enable_cpu_affinity",
        "use_parallelism_config",
        "dynamo_use_regional_compilation",
        "dynamo_use_fullgraph",
        "dynamo_use_dynamic",
    }
)
APPENDED = frozenset({"vm", "env"})

# Accelerate's defaults (its wizard writes them into every config file): no note for these
_DEFAULTS: dict[str, Any] = {
    "main_training_function": "main",
    "fsdp_use_orig_params": True,
    "fsdp_sync_module_states": True,
    "fsdp_backward_prefetch": "BACKWARD_PRE",
    "deepspeed_multinode_launcher": "standard",
    "parallelism_config_cp_backend": "torch",
    "parallelism_config_cp_comm_strategy": "allgather",
    "parallelism_config_sp_backend": "deepspeed",
    "parallelism_config_sp_attn_implementation": "sdpa",
}


def unless_default(name: str, value: Any) -> bool:
    """Whether a config file's ``name: value`` is worth a note (not empty, false or Accelerate's default)."""
    if value in (None, False, "", [], "no", "false", "none", "NONE"):
        return False
    return str(value).lower() != str(_DEFAULTS.get(name, object())).lower()


def ignored_note(names: list[str], where: str) -> list[str]:
    """One note per reason: ``--tpu_use_sudo, --vm: ignored: a TPU option; ...``."""
    by_why: dict[str, list[str]] = {}
    for name in names:
        by_why.setdefault(IGNORED[name], []).append(name)
    return [f"{', '.join(where.format(n) for n in group)}: ignored: {why}" for why, group in by_why.items()]
