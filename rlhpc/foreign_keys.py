"""verl's and slime's names for rlhpc's config keys: the one table that the config's "did you mean"
reads (``rlhpc.config``: an unknown key that is verl's or slime's is answered with rlhpc's) and
that docs/guides/coming-from-verl.md shows (``markdown_table``; ``python -m
rlhpc.cli.config_reference`` writes it there, a test keeps it current).

verl's keys are its Hydra config's (``actor_rollout_ref.rollout.n``); one typed without its
leading sections (``rollout.n``) is found too. slime's are its command-line flags
(``--n-samples-per-prompt``), found as typed or with underscores (``n_samples_per_prompt``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ForeignKey:
    framework: str  # "verl" or "slime"
    key: str  # as that framework spells it
    rlhpc: str | None  # rlhpc's key; None: nothing to set (see note)
    note: str = ""


def _verl(key: str, rlhpc: str | None, note: str = "") -> ForeignKey:
    return ForeignKey("verl", key, rlhpc, note)


def _slime(key: str, rlhpc: str | None, note: str = "") -> ForeignKey:
    return ForeignKey("slime", key, rlhpc, note)


ARO = "actor_rollout_ref"
KEYS: list[ForeignKey] = [
    _verl("data.train_files", "data.train_file", "one file (a list of files: concatenate them)"),
    _verl("data.val_files", "data.eval_file", "or several named sets: eval.sets.NAME.file"),
    _verl("data.prompt_key", "data.prompt_key", "the same; verl's default is prompt too"),
    _verl("data.reward_fn_key", None, "verl's compute_score gets the row's data_source column as it is"),
    _verl("data.train_batch_size", "rollout.rollout_batch_size", "prompts per rollout"),
    _verl("data.max_prompt_length", "data.max_prompt_tokens", "longer prompts are dropped at load, counted"),
    _verl("data.max_response_length", "rollout.max_new_tokens", "tokens per reply"),
    _verl("data.return_raw_chat", None, "a chat prompt is always kept as messages (row.messages)"),
    _verl(f"{ARO}.model.path", "model.path", ""),
    _verl(f"{ARO}.model.lora_rank", "actor.lora.rank", "LoRA on the torch actor (docs/guides/lora.md)"),
    _verl(f"{ARO}.model.lora_alpha", "actor.lora.alpha", ""),
    _verl(f"{ARO}.model.target_modules", "actor.lora.target_modules", "all-linear or peft module names, as verl's"),
    _verl(f"{ARO}.actor.optim.lr", "actor.lr", ""),
    _verl(f"{ARO}.actor.optim.weight_decay", "actor.weight_decay", ""),
    _verl(f"{ARO}.actor.grad_clip", "actor.grad_clip", ""),
    _verl(
        f"{ARO}.actor.ppo_mini_batch_size",
        "actor.num_steps_per_rollout",
        "optimizer steps per rollout = ppo_epochs x data.train_batch_size / ppo_mini_batch_size",
    ),  # fmt: skip
    _verl(f"{ARO}.actor.ppo_micro_batch_size_per_gpu", "actor.micro_batch_size", "samples per forward on one GPU"),
    _verl(f"{ARO}.actor.ppo_max_token_len_per_gpu", "actor.max_tokens_per_micro_batch", ""),
    _verl(f"{ARO}.actor.use_dynamic_bsz", "actor.max_tokens_per_micro_batch", "set a token budget to use one"),
    _verl(
        f"{ARO}.actor.ppo_epochs", "actor.num_steps_per_rollout", "counted in optimizer steps (see ppo_mini_batch_size)"
    ),
    _verl(f"{ARO}.actor.clip_ratio", "algo.eps_clip", "and algo.eps_clip_high for the upper bound"),
    _verl(f"{ARO}.actor.clip_ratio_low", "algo.eps_clip", ""),
    _verl(f"{ARO}.actor.clip_ratio_high", "algo.eps_clip_high", ""),
    _verl(f"{ARO}.actor.loss_agg_mode", "algo.loss_agg_mode", "the same four modes"),
    _verl(f"{ARO}.actor.entropy_coeff", "algo.entropy_coef", ""),
    _verl(f"{ARO}.actor.use_kl_loss", "algo.kl_coef", "a KL term in the loss is on when algo.kl_coef > 0"),
    _verl(f"{ARO}.actor.kl_loss_coef", "algo.kl_coef", ""),
    _verl(f"{ARO}.actor.kl_loss_type", "algo.kl_estimator", "k1, k2, k3, low_var_kl"),
    _verl(f"{ARO}.actor.policy_loss.loss_mode", "algo.policy_loss", "ppo_clip (vanilla), gspo, cispo"),
    _verl(f"{ARO}.actor.strategy", "actor.backend", "fsdp: torch (DDP), megatron: megatron"),
    _verl(f"{ARO}.actor.megatron.tensor_model_parallel_size", "actor.megatron.tensor_model_parallel_size", ""),
    _verl(f"{ARO}.actor.megatron.pipeline_model_parallel_size", "actor.megatron.pipeline_model_parallel_size", ""),
    _verl(f"{ARO}.actor.megatron.expert_model_parallel_size", "actor.megatron.expert_model_parallel_size", ""),
    _verl(f"{ARO}.rollout.name", "rollout.backend", "sglang (or cpu, the CPU engine)"),
    _verl(f"{ARO}.rollout.n", "rollout.n_samples_per_prompt", "samples per prompt (the GRPO group)"),
    _verl(f"{ARO}.rollout.temperature", "rollout.temperature", ""),
    _verl(f"{ARO}.rollout.top_p", "rollout.top_p", ""),
    _verl(f"{ARO}.rollout.top_k", "rollout.top_k", ""),
    _verl(f"{ARO}.rollout.response_length", "rollout.max_new_tokens", ""),
    _verl(f"{ARO}.rollout.tensor_model_parallel_size", "cluster.rollout_gpus_per_engine", "GPUs per engine"),
    _verl(f"{ARO}.rollout.gpu_memory_utilization", "rollout.sglang.mem_fraction_static", ""),
    _verl(f"{ARO}.rollout.quantization", "rollout.quantization", "fp8: 128 x 128 block FP8, algo.tis on"),
    _verl(f"{ARO}.rollout.val_kwargs.n", "eval.n_samples_per_prompt", "pass@k up to n"),
    _verl(f"{ARO}.rollout.val_kwargs.temperature", "eval.temperature", ""),
    _verl(f"{ARO}.rollout.multi_turn.max_assistant_turns", "rollout.max_turns", ""),
    _verl(f"{ARO}.rollout.multi_turn.tool_config_path", "rollout.tools", "typed Python functions: module:function"),
    _verl(f"{ARO}.rollout.agent.agent_loop_config_path", "rollout.agent", "or rollout.generate_fn (module:function)"),
    _verl("algorithm.adv_estimator", "algo.advantage_estimator", "grpo, rloo, reinforce_plus_plus(_baseline)"),
    _verl("algorithm.norm_adv_by_std_in_grpo", "algo.normalize_std", ""),
    _verl("algorithm.use_kl_in_reward", "algo.kl_in_reward", "with algo.kl_coef"),
    _verl("algorithm.kl_ctrl.kl_coef", "algo.kl_coef", "with algo.kl_in_reward: true for verl's KL in the reward"),
    _verl("algorithm.filter_groups.enable", "rollout.dynamic_sampling.filter", "nonzero_std, or module:function"),
    _verl("custom_reward_function.path", "data.reward", "module:function, verl's compute_score as it is"),
    _verl("custom_reward_function.name", "data.reward", "module:function"),
    _verl("reward_model.model.path", "reward_model.path", "a classifier, or kind: judge"),
    _verl("trainer.nnodes", "cluster.num_nodes", "or jobs/submit.py --nodes"),
    _verl("trainer.n_gpus_per_node", "cluster.gpus_per_node", "or jobs/submit.py --gpus-per-node"),
    _verl("trainer.total_epochs", "rollout.num_epoch", ""),
    _verl("trainer.total_training_steps", "rollout.num_rollout", ""),
    _verl("trainer.save_freq", "checkpoint.save_interval", "rollouts between saves"),
    _verl("trainer.test_freq", "eval.interval", "rollouts between evaluations"),
    _verl(
        "trainer.val_before_train",
        "eval.interval",
        "rlhpc evaluates before the first rollout when eval.interval is set",
    ),
    _verl("trainer.resume_mode", "checkpoint.resume", "auto, or never"),
    _verl("trainer.project_name", "logging.wandb_project", ""),
    _verl("trainer.logger", "logging.wandb_mode", "offline, online or disabled"),
    _verl("trainer.default_local_dir", None, "jobs/submit.py --run-dir: checkpoints go to RUN_DIR/checkpoints"),
    _slime("--hf-checkpoint", "model.path", ""),
    _slime("--prompt-data", "data.train_file", ""),
    _slime("--input-key", "data.prompt_key", ""),
    _slime("--label-key", "data.label_key", ""),
    _slime("--apply-chat-template", "data.chat_template", "auto: the tokenizer's own (the default)"),
    _slime("--rollout-max-prompt-len", "data.max_prompt_tokens", ""),
    _slime("--custom-rm-path", "data.reward", "module:function"),
    _slime("--rm-type", "data.reward", "rlhpc.rewards:gsm8k, :math, :exact, or module:function"),
    _slime("--num-rollout", "rollout.num_rollout", ""),
    _slime("--num-epoch", "rollout.num_epoch", ""),
    _slime("--rollout-batch-size", "rollout.rollout_batch_size", ""),
    _slime("--n-samples-per-prompt", "rollout.n_samples_per_prompt", ""),
    _slime("--rollout-max-response-len", "rollout.max_new_tokens", ""),
    _slime("--rollout-temperature", "rollout.temperature", ""),
    _slime("--rollout-top-p", "rollout.top_p", ""),
    _slime("--rollout-top-k", "rollout.top_k", ""),
    _slime("--rollout-stop", "rollout.stop", ""),
    _slime("--global-batch-size", "actor.num_steps_per_rollout", "steps = rollout_batch_size x n / global_batch_size"),
    _slime("--micro-batch-size", "actor.micro_batch_size", ""),
    _slime("--use-dynamic-batch-size", "actor.max_tokens_per_micro_batch", "set a token budget to use one"),
    _slime("--max-tokens-per-gpu", "actor.max_tokens_per_micro_batch", ""),
    _slime("--lr", "actor.lr", ""),
    _slime("--advantage-estimator", "algo.advantage_estimator", ""),
    _slime("--eps-clip", "algo.eps_clip", ""),
    _slime("--eps-clip-high", "algo.eps_clip_high", ""),
    _slime("--kl-loss-coef", "algo.kl_coef", ""),
    _slime("--kl-loss-type", "algo.kl_estimator", ""),
    _slime("--entropy-coef", "algo.entropy_coef", ""),
    _slime("--use-tis", "algo.tis", ""),
    _slime("--opd-kl-coef", "algo.distill_coef", "with a teacher section"),
    _slime("--actor-num-gpus-per-node", "cluster.actor_num_gpus", "the actor's GPUs in all"),
    _slime("--rollout-num-gpus", "cluster.rollout_num_gpus", ""),
    _slime("--rollout-num-gpus-per-engine", "cluster.rollout_gpus_per_engine", ""),
    _slime("--colocate", "cluster.colocate", ""),
    _slime("--tensor-model-parallel-size", "actor.megatron.tensor_model_parallel_size", ""),
    _slime("--pipeline-model-parallel-size", "actor.megatron.pipeline_model_parallel_size", ""),
    _slime("--expert-model-parallel-size", "actor.megatron.expert_model_parallel_size", ""),
    _slime("--custom-generate-function-path", "rollout.generate_fn", "module:function, (row, engine) -> Trajectory"),
    _slime("--dynamic-sampling-filter-path", "rollout.dynamic_sampling.filter", ""),
    _slime("--over-sampling-batch-size", "rollout.dynamic_sampling.over_sampling_batch_size", ""),
    _slime("--partial-rollout", "rollout.partial_rollout", "with rollout.max_staleness >= 1"),
    _slime("--eval-interval", "eval.interval", ""),
    _slime("--eval-prompt-data", "eval.sets.NAME.file", "one set per NAME"),
    _slime("--n-samples-per-eval-prompt", "eval.n_samples_per_prompt", ""),
    _slime("--save-interval", "checkpoint.save_interval", ""),
    _slime("--wandb-project", "logging.wandb_project", ""),
]


def _slime_form(text: str) -> str:
    return text.lstrip("-").replace("-", "_")


def lookup(typed: str) -> list[ForeignKey]:
    """The entries ``typed`` (an unknown dotted key) is: verl's key itself or its tail after
    whole sections (``rollout.n``), or slime's flag with or without its dashes."""
    out = []
    for k in KEYS:
        if k.framework == "verl" and (k.key == typed or k.key.endswith(f".{typed}")):
            out.append(k)
        elif k.framework == "slime" and _slime_form(k.key) == _slime_form(typed):
            out.append(k)
    return out


def section_of(typed: str) -> list[ForeignKey]:
    """The entries under ``typed`` when it is one of verl's sections (``actor_rollout_ref``)."""
    return [k for k in KEYS if k.framework == "verl" and k.key.startswith(f"{typed}.")]


GUIDE = "docs/guides/coming-from-verl.md"


def hint(typed: str, section: bool = True) -> str | None:
    """The fix for an unknown key ``typed`` that is verl's or slime's (``section``: or one of
    verl's sections); None if it is neither."""
    found = lookup(typed)
    if found:
        said = []
        for k in found:
            where = f"rlhpc's {k.rlhpc}" if k.rlhpc else "nothing to set in rlhpc"
            said.append(f"{k.framework}'s {k.key} is {where}" + (f": {k.note}" if k.note else ""))
        return "; ".join(dict.fromkeys(said)) + f". Every key: {GUIDE}"
    under = section_of(typed) if section else []
    if under:
        shown = ", ".join(f"{k.key} -> {k.rlhpc or '-'}" for k in under[:4])
        return f"{typed} is verl's section; rlhpc names its keys apart: {shown} and more. Every key: {GUIDE}"
    return None


def markdown_table() -> str:
    """The table as the guide shows it."""
    lines = ["| framework | their key | rlhpc | note |", "|---|---|---|---|"]
    for k in KEYS:
        rlhpc = f"`{k.rlhpc}`" if k.rlhpc else "—"
        lines.append(f"| {k.framework} | `{k.key}` | {rlhpc} | {k.note} |")
    return "\n".join(lines)
