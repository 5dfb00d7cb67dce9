"""What the training side reads from the run config: the sections it uses, nothing else."""

from __future__ import annotations

from dataclasses import dataclass

from rlhpc.config import ActorConfig, AlgoConfig, Config


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

    @classmethod
    def from_config(cls, cfg: Config) -> ActorSpec:
        return cls(
            actor=cfg.actor,
            algo=cfg.algo,
            seed=cfg.seed,
            deterministic=cfg.deterministic,
            weight_bucket_mb=cfg.rollout.update_weight_buffer_mb,
            log_level=cfg.logging.level,
            weight_pause_mode="retract" if cfg.rollout.partial_rollout else "abort",
            max_response_len=cfg.rollout.max_new_tokens,
        )

    @property
    def needs_reference(self) -> bool:
        """The KL penalty is on: ranks keep a frozen copy of the initial model."""
        return self.algo.kl_coef > 0

    @property
    def tp_size(self) -> int:
        """Tensor-parallel size: ranks of one TP group train on the same data."""
        return self.actor.megatron.tensor_model_parallel_size if self.actor.backend == "megatron" else 1
