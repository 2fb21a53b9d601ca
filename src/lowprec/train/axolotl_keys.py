"""Axolotl's config keys that lowprec's schema does not implement, each with what to use instead.

Real Axolotl configs carry dozens of keys, many set to nothing (``wandb_project:``). This table
makes every key Axolotl documents (its config reference, v0.x schema, read 2026-11) known:

* a key of the schema (:class:`lowprec.train.config.TrainConfig`) is implemented;
* a key here set to null, or to Axolotl's own default (``load_in_8bit: false``), asks for
  nothing and is dropped;
* a key here set to anything else is a one-line error naming it as an Axolotl key lowprec does
  not support and what to use instead (exit code 2);
* any other key is unknown: an error with "did you mean" (pydantic's ``extra="forbid"``).

``OWNED_BY_MODELS`` are the model-loading and adapter keys that the model/adapter work
implements in ``config/model.py`` / ``config/adapter.py``; once a key is a schema field, the
table no longer applies to it.
"""

from __future__ import annotations

from typing import Any, Optional

__all__ = [
    "AXOLOTL_DEFAULTS",
    "UNSUPPORTED",
    "DATASET_UNSUPPORTED",
    "OWNED_BY_MODELS",
    "screen_top_level",
    "screen_dataset_entry",
    "all_axolotl_keys",
]


def _keys(text: str) -> tuple[str, ...]:
    return tuple(text.split())


# key group -> (why / what to use instead). Messages read "<key>: an Axolotl key lowprec does not support (<msg>)".
_GROUPS: dict[str, tuple[str, tuple[str, ...]]] = {
    "models": (
        "model and tokenizer loading beyond base_model, model_type, tokenizer_config, tokenizer_type and "
        "trust_remote_code; give a local Hugging Face directory (or a cached hub id) in base_model",
        _keys(
            "base_model_config cls_model_config tokenizer_config tokenizer_use_fast tokenizer_legacy "
            "tokenizer_use_mistral_common tokenizer_type processor_type processor_kwargs tokenizer_save_jinja_files "
            "trust_remote_code experimental_skip_move_to_device use_kernels model_quantization_config "
            "model_quantization_config_kwargs use_onebitllms model_config model_kwargs model_type model_revision "
            "resize_token_embeddings_to_32x mean_resizing_embeddings shrink_embeddings embeddings_skip_upcast "
            "reinit_weights attn_implementation device_map max_memory gpu_memory_limit low_cpu_mem_usage "
            "is_falcon_derived_model is_llama_derived_model is_mistral_derived_model is_qwen_derived_model "
            "added_tokens_overrides fix_untrained_tokens save_safetensors"
        ),
    ),
    "adapters": (
        "this adapter option is not supported; adapter: lora reads lora_r, lora_alpha, lora_dropout, "
        "lora_target_modules, lora_target_linear, lora_target_parameters, lora_modules_to_save, lora_fan_in_fan_out and merge_lora",
        _keys(
            "adapter lora_model_dir lora_r lora_alpha lora_fan_in_fan_out lora_target_modules "
            "lora_target_linear lora_modules_to_save lora_rank_pattern lora_alpha_pattern lora_dropout "
            "peft_layers_to_transform peft_layers_pattern peft peft_use_dora peft_use_rslora peft_layer_replication "
            "peft_init_lora_weights peft_trainable_token_indices peft_ensure_weight_tying peft_autocast_adapter_dtype "
            "qlora_sharded_model_loading lora_on_cpu merge_lora merge_method loraplus_lr_ratio loraplus_lr_embedding "
            "lora_mlp_kernel lora_qkv_kernel lora_o_kernel lora_embedding_kernel"
        ),
    ),
    "quantized loading": (
        "8-bit (bitsandbytes) and GPTQ weight loading are not supported; drop it (4 bits: adapter: qlora with load_in_4bit: true; "
        "lowprec's own low precision is fp8: true on the Linear GEMMs)",
        _keys("load_in_8bit load_in_4bit gptq bnb_config_kwargs quantize_moe_experts qat quantization"),
    ),
    "trackers": (
        "experiment trackers; lowprec writes metrics.jsonl, loss.png and TensorBoard events (use_tensorboard: true)",
        _keys(
            "use_wandb wandb_name wandb_run_id wandb_mode wandb_project wandb_entity wandb_watch wandb_log_model "
            "use_mlflow mlflow_tracking_uri mlflow_experiment_name mlflow_run_name hf_mlflow_log_artifacts use_comet "
            "comet_api_key comet_workspace comet_project_name comet_experiment_key comet_mode comet_online "
            "comet_experiment_config use_trackio trackio_project_name trackio_run_name trackio_space_id "
            "use_otel_metrics otel_metrics_host otel_metrics_port profiler_steps profiler_steps_start "
            "include_tokens_per_second include_tkps debug"
        ),
    ),
    "hub": (
        "lowprec never uploads or downloads; the model is written to output_dir, copy or upload it yourself",
        _keys("hub_model_id hub_strategy hub_revision push_dataset_to_hub hf_use_auth_token"),
    ),
    "attention": (
        "lowprec's models run attention through torch's scaled_dot_product_attention, which picks flash "
        "kernels on a GPU by itself; drop the key",
        _keys(
            "xformers_attention sdp_attention flex_attention flex_attn_compile_kwargs flash_attention "
            "flash_attn_cross_entropy flash_attn_fuse_mlp flash_optimum sage_attention eager_attention "
            "gemma4_hybrid_attn_impl large_head_attention flash_attn_d512 sdpa_varlen fused_attn_kernel "
            "experts_implementation scaling_softmax scaling_softmax_factor scaling_softmax_bias s2_attention "
            "flash_attn_rms_norm heads_k_stride ring_attn_func"
        ),
    ),
    "preference and RL training": (
        "lowprec trains causal language models with supervised labels only (no DPO/KTO/ORPO/GRPO/reward models)",
        _keys(
            "rl trl vllm ebft reward_model process_reward_model center_rewards_coefficient num_labels "
            "dpo_use_weighting dpo_label_smoothing precompute_ref_log_probs dpo_use_liger_kernel dpo_padding_free "
            "dpo_loss_type dpo_loss_weights dpo_beta dpo_use_logits_to_keep dpo_generate_during_eval dpo_norm_loss "
            "rpo_alpha orpo_alpha simpo_gamma cpo_alpha kto_desirable_weight kto_undesirable_weight rl_beta "
            "trainer_cls plugins"
        ),
    ),
    "parallelism": (
        "lowprec shards with FSDP2 (fsdp_version: 2 + fsdp_config) or DeepSpeed (deepspeed:), launched with "
        "`lowprec train CONFIG.yaml --num_processes N`, which also sets ranks and world size",
        _keys(
            "fsdp fsdp_final_state_dict_type dp_shard_size dp_replicate_size sequence_parallel_degree "
            "context_parallel_size deepcompile device world_size local_rank ddp ddp_timeout "
            "ddp_bucket_cap_mb ddp_broadcast_buffers ddp_find_unused_parameters accelerator_config use_ray "
            "ray_run_name ray_num_workers resources_per_worker fp32_norms fp32_norm_classes"
        ),
    ),
    "optimizer variants": (
        "lowprec's optimizers are adamw_torch, adamw_torch_fused and sgd with one learning rate; drop the key",
        _keys(
            "optim_args optim_target_modules torchdistx_path lr_scheduler_kwargs lr_quadratic_warmup "
            "cosine_min_lr_ratio cosine_constant_lr_ratio lr_div_factor lr_groups adam_epsilon adam_epsilon2 "
            "adam_beta3 embedding_lr embedding_lr_scale dion_lr dion_momentum dion_rank_fraction dion_rank_multiple_of "
            "qgalore_rank qgalore_update_proj_gap qgalore_scale qgalore_proj_type qgalore_proj_quant qgalore_proj_bits "
            "qgalore_proj_group_size qgalore_cos_threshold qgalore_gamma_proj qgalore_queue_size relora "
            "relora_prune_ratio relora_prune_method relora_cpu_offload jagged_restart_steps jagged_restart_warmup_steps "
            "jagged_restart_anneal_steps lisa_n_layers lisa_step_interval lisa_layers_attribute neftune_noise_alpha "
            "noisy_embedding_alpha use_eaft eaft_alpha eaft_k"
        ),
    ),
    "batching": (
        "lowprec sizes batches with micro_batch_size x gradient_accumulation_steps x processes; set those",
        _keys(
            "batch_size eval_batch_size auto_find_batch_size group_by_length curriculum_sampling "
            "multipack_real_batches batch_flattening"
        ),
    ),
    "data preparation": (
        "lowprec reads local files listed in datasets: (type completion/alpaca/input_output/chat_template or "
        "pre-tokenized) and caches them in dataset_prepared_path; drop the key",
        _keys(
            "test_datasets shuffle_merged_datasets shuffle_before_merging_datasets dataset_shard_num "
            "dataset_shard_idx skip_prepare_dataset num_dataset_shards_to_save pretraining_dataset dataset_processes "
            "dataset_num_proc dataset_exact_deduplication dataset_keep_in_memory dataloader_pin_memory "
            "dataloader_num_workers dataloader_prefetch_factor dataloader_drop_last remove_unused_columns "
            "excess_length_strategy eval_sequence_len min_sample_len max_prompt_len sample_packing_group_size "
            "sample_packing_bin_size sample_packing_sequentially sample_packing_mp_start_method pad_to_multiple_of "
            "use_pose pose_split_on_token_ids pose_max_context_len pose_num_chunks pretrain_multipack_buffer_size "
            "pretrain_multipack_attn pretraining_sample_concatenation streaming streaming_multipack_buffer_size "
            "max_packed_sequence_len chat_template_kwargs default_system_message is_preprocess preprocess_iterable "
            "total_num_tokens total_supervised_tokens sample_packing_eff_est axolotl_config_path image_size "
            "image_resize_algorithm role_boundaries freeze_mm_modules"
        ),
    ),
    "evaluation and saving": (
        "lowprec evaluates validation loss every eval_steps (or evals_per_epoch) and checkpoints every save_steps "
        "(or saves_per_epoch); drop the key",
        _keys(
            "evaluation_strategy eval_strategy save_strategy save_first_step load_best_model_at_end save_only_model "
            "do_causal_lm_eval eval_causal_lm_metrics do_bench_eval bench_dataset bench_split metric_for_best_model "
            "greater_is_better gradio_title gradio_share gradio_server_name "
            "gradio_server_port gradio_max_new_tokens gradio_temperature dynamic_checkpoint"
        ),
    ),
    "sample generation": (
        "lowprec samples greedy generations at each evaluation with eval_table_size and eval_max_new_tokens "
        "(Axolotl's earlier keys); use those",
        _keys(
            "generate_samples num_generation_samples generation_max_new_tokens generation_temperature "
            "generation_top_p generation_top_k generation_prompt_ratio generation_do_sample"
        ),
    ),
    "memory savers": (
        "lowprec saves memory with gradient_checkpointing: true, fp8: true and FSDP2; drop the key",
        _keys(
            "selective_checkpointing activation_offloading layer_offloading unfrozen_parameters gc_steps "
            "torch_empty_cache_steps gc_collect_steps tiled_mlp tiled_mlp_num_shards tiled_mlp_use_original_mlp "
            "chunked_cross_entropy chunked_cross_entropy_num_chunks llama4_linearized_experts"
        ),
    ),
    "precision aliases": (
        "spell precision as bf16 / fp16 / fp8 (true, false, auto), as lowprec's schema does",
        _keys("bfloat16 float16 float32 rope_scaling"),
    ),
    "resuming": (
        "use resume_from_checkpoint: auto (continues from the latest checkpoint in output_dir, a fresh run "
        "when there is none)",
        _keys("auto_resume_from_checkpoints"),
    ),
    "compile options": (
        "torch_compile: true compiles with torch's default backend and mode; drop the key",
        _keys("torch_compile_backend torch_compile_mode torch_compile_options"),
    ),
}

UNSUPPORTED: dict[str, str] = {k: msg for msg, keys in _GROUPS.values() for k in keys}
OWNED_BY_MODELS = frozenset(_GROUPS["models"][1] + _GROUPS["adapters"][1] + _GROUPS["quantized loading"][1])

# Axolotl's defaults for keys above whose default is not null: set to it, the key asks for nothing.
AXOLOTL_DEFAULTS: dict[str, Any] = {
    "tokenizer_save_jinja_files": True,
    "experimental_skip_move_to_device": True,
    "save_safetensors": True,
    "lora_dropout": 0.0,
    "merge_method": "memory_efficient",
    "shuffle_merged_datasets": True,
    "skip_prepare_dataset": False,
    "sample_packing_group_size": 100000,
    "sample_packing_bin_size": 200,
    "pretrain_multipack_attn": True,
    "load_best_model_at_end": False,
    "save_only_model": False,
    "include_tkps": True,
    "ray_num_workers": 1,
    "dataloader_drop_last": False,
    "trust_remote_code": False,
    "num_generation_samples": 3,
    "generation_max_new_tokens": 50,
    "generation_temperature": 0.7,
    "generation_prompt_ratio": 0.5,
    "generation_do_sample": True,
    "eval_table_size": 0,
}

# dataset entry keys (Axolotl's SFTDataset) that DatasetSpec does not implement
DATASET_UNSUPPORTED: dict[str, str] = {
    **{
        k: "lowprec reads local files (path: data.jsonl, or Axolotl's path: json with data_files: data.jsonl) "
        "and hub datasets already in the local cache (path: org/name, name: its config, split:), as they are"
        for k in _keys("data_files revision trust_remote_code shards shards_idx preprocess_shards")
    },
    **{
        k: "use type: chat_template with field_messages / message_property_mappings"
        for k in _keys("conversation input_format field_human field_model")
    },
    **{
        k: "tool calls, reasoning traces and per-message training flags are not supported; mask with roles_to_train"
        for k in _keys(
            "field_tools field_thinking template_thinking_key message_field_training "
            "message_field_training_detail split_thinking train_on_eot logprobs_field temperature"
        )
    },
    "input_transform": "transform the rows before training (write a new .jsonl)",
}


def _inert(key: str, value: Any) -> bool:
    default = AXOLOTL_DEFAULTS.get(key)
    return value is None or value == default or (value is False and default in (None, False))


def _error(key: str, where: str, msg: str) -> ValueError:
    return ValueError(f"{where}{key}: an Axolotl key lowprec does not support ({msg})")


def screen_top_level(
    data: dict[str, Any], fields: set[str], nullable: set[str], notes: Optional[dict[str, str]] = None
) -> tuple[dict[str, Any], dict[str, str]]:
    """(``data`` without the keys that ask for nothing, {inert key: note}). Asking for nothing:
    null keys (a schema key whose null has no meaning of its own -- not in ``nullable`` -- takes
    its default), Axolotl keys at null or Axolotl's default, and keys the rest of the config makes
    inert (``notes``: {key: note} from :func:`lowprec.train.config.inert.inert_keys`). Raises for an Axolotl
    key that asks for something lowprec does not do. Unknown keys pass through, null or not: the
    schema rejects them with "did you mean"."""
    notes = dict(notes or {})
    out = {}
    for key, value in data.items():
        if key in notes:
            continue
        if key in UNSUPPORTED and key not in fields:
            if not _inert(key, value):
                raise _error(key, "", UNSUPPORTED[key])
        elif not (value is None and key in fields and key not in nullable):
            out[key] = value
    return out, notes


def screen_dataset_entry(entry: Any, fields: set[str]) -> Any:
    """The same for one ``datasets:`` entry; null values mean unset there too."""
    if not isinstance(entry, dict):
        return entry
    out = {}
    for key, value in entry.items():
        if value is None and key in fields | set(DATASET_UNSUPPORTED):
            continue
        if key not in fields and key in DATASET_UNSUPPORTED and value is not False:
            raise _error(key, "", DATASET_UNSUPPORTED[key])  # pydantic prefixes datasets.<i>
        if key in fields or key not in DATASET_UNSUPPORTED:
            out[key] = value
    return out


def all_axolotl_keys() -> frozenset[str]:
    """Every top-level key this table knows (for tests: nothing Axolotl documents is unknown)."""
    return frozenset(UNSUPPORTED)
