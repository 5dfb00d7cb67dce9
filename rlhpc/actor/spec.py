"""What the training side reads from the run config: the sections it uses, nothing else."""

from __future__ import annotations

from dataclasses import dataclass

from rlhpc.config import ActorConfig, AlgoConfig, Config
from rlhpc.wire.lora import POLICY_ADAPTER


@dataclass(frozen=True)
class ActorSpec:
    """The config an actor rank is built from (sent to every rank as it is)."""

    actor: ActorConfig
    algo: AlgoConfig
    seed: int
    deterministic: bool
    weight_bucket_mb: int  # rollout.update_weight_buffer_mb: the weight-sync bucket size
    log_level: str  # logging.level: each rank is a process of its own
    # rollout.partial_rollout: a weight push pauses generation with "retract", keeping requests in flight
    weight_pause_mode: str = "abort"
    # rollout.max_new_tokens: the constant of algo.loss_agg_mode = seq-mean-token-sum-norm
    max_response_len: int = 1
    # actor.lr_decay_steps, or the run's optimizer steps (0: unknown; only a constant schedule runs then)
    lr_decay_steps: int = 0
    # actor.lora.push = adapter: where rank 0 writes each push's adapter (RunDir.lora_push; on the
    # run dir's shared file system, so engines on every node read it). None: full weights pushed
    lora_push_dir: str | None = None
    # rollout.quantization: "fp8": each push sends the weights quantized to block FP8, as the
    # engines hold them (rlhpc.weights.fp8); None: in the trainer's dtype
    push_quantization: str | None = None
    # the name the engines serve the pushed adapter under (rlhpc.wire.lora.POLICY_ADAPTER; on a
    # shared fleet, the run's own)
    lora_adapter: str = POLICY_ADAPTER
    # rollout.fleet: the engines serve other runs' adapters too, so a push neither pauses them
    # (it would abort the others' requests) nor sets their one weight version (the run keeps its own)
    shared_engines: bool = False

    @classmethod
    def from_config(
        cls,
        cfg: Config,
        num_rollout: int | None = None,
        lora_push_dir: str | None = None,
        lora_adapter: str = POLICY_ADAPTER,
    ) -> ActorSpec:
        """``num_rollout``: the run's rollouts (the driver's count, derived from the data when
        rollout.num_rollout is null): where a decaying learning rate ends by default.
        ``lora_push_dir``: the run's ``RunDir.lora_push``, used when actor.lora pushes adapters."""
        rollouts = num_rollout or cfg.rollout.num_rollout or 0
        return cls(
            actor=cfg.actor,
            algo=cfg.algo,
            seed=cfg.seed,
            deterministic=cfg.deterministic,
            weight_bucket_mb=cfg.rollout.update_weight_buffer_mb,
            log_level=cfg.logging.level,
            weight_pause_mode="retract" if cfg.rollout.partial_rollout else "abort",
            max_response_len=cfg.rollout.max_new_tokens,
            lr_decay_steps=cfg.actor.lr_decay_steps or rollouts * cfg.actor.num_steps_per_rollout,
            push_quantization=cfg.rollout.quantization,
            lora_push_dir=lora_push_dir if cfg.actor.lora is not None and cfg.actor.lora.push == "adapter" else None,
            lora_adapter=lora_adapter,
            shared_engines=cfg.rollout.fleet is not None,
        )

    @property
    def needs_reference(self) -> bool:
        return self.algo.needs_reference

    @property
    def tp_size(self) -> int:
        """Tensor-parallel size: ranks of one TP group train on the same data."""
        return self.actor.megatron.tensor_model_parallel_size if self.actor.backend == "megatron" else 1

    @property
    def pp_size(self) -> int:
        """Pipeline-parallel size: the stages of one model replica train on the same data."""
        return self.actor.megatron.pipeline_model_parallel_size if self.actor.backend == "megatron" else 1
