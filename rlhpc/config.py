"""Typed run configuration: one dataclass per component, loaded from YAML + ``--set`` overrides.

The resolved config is the single source of truth for a run: it is written to
``RUN_DIR/config.yaml`` before anything starts, and every component receives the section it
needs as an explicit argument (no global ``args``).

Each section checks its own values when it is built (``Section.__post_init__``); ``validate``
holds the rules that read more than one section or the files the config names. The checks that
need the code a config names (its reward, task, environment, judge, layout, memory plan) are where
that code is, and ``rlhpc.preflight`` runs them all, in order, with these: an entry point loads a
config with ``rlhpc.preflight.load_config``. This module imports nothing of rlhpc but its errors
and the table of verl's and slime's key names (``rlhpc.foreign_keys``), and neither torch nor
transformers: the login node reads configs too.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import logging
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml

from rlhpc import foreign_keys
from rlhpc.errors import ConfigError

# ---------------------------------------------------------------- sections


class Section:
    """Base of every config section: checks the section's values whenever one is constructed.

    ``SECTION`` is the section's dotted place in :class:`Config`, so an error names the full key
    (``rollout.temperature = -1.0 must be >= 0``) whether the section came from YAML or from code.
    """

    SECTION: ClassVar[str] = ""

    def __post_init__(self) -> None:
        hints = _hints(type(self))
        for f in dataclasses.fields(self):
            _check_value(getattr(self, f.name), hints[f.name], self.key(f.name))
        self.check()

    def check(self) -> None:
        """The section's own rules: ranges, counts, rules between its fields."""

    def key(self, name: str) -> str:
        # _where: the place _build constructed it at (eval.sets.NAME), where a class has many
        where = getattr(self, "_where", None) or self.SECTION
        return f"{where}.{name}" if where else name

    def _refuse(self, name: str, rule: str, fix: str) -> typing.NoReturn:
        raise ConfigError(f"{self.key(name)} = {getattr(self, name)!r} {rule}", fix)

    def _at_least(self, low: int | float, *names: str, fix: str = "") -> None:
        """Each of ``names`` is >= ``low``; None (unset) passes."""
        for name in names:
            value = getattr(self, name)
            if value is not None and value < low:
                self._refuse(name, f"must be >= {low}", fix or f"set {self.key(name)} to at least {low}")

    def _above(self, low: float, *names: str, fix: str = "") -> None:
        """Each of ``names`` is > ``low``; None (unset) passes."""
        for name in names:
            if getattr(self, name) is not None and not getattr(self, name) > low:
                self._refuse(name, f"must be > {low}", fix or f"set {self.key(name)} to a value above {low}")


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _check_value(value: Any, tp: Any, where: str) -> None:
    """Rules every field obeys: floats are finite, Literal fields hold one of their choices."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{where} = {value} is not a finite number", f"give {where} a finite value")
    if isinstance(value, (tuple, list)):
        for i, v in enumerate(value):
            _check_value(v, Any, f"{where}[{i}]")
    if typing.get_origin(tp) is Literal:
        _check_literal(value, tp, where)


def _check_literal(value: Any, tp: Any, where: str) -> None:
    if value not in typing.get_args(tp):
        raise ConfigError(f"{where} = {value!r} is not one of {_type_name(tp)}", f"set {where} to one of those")


@dataclass
class ClusterConfig(Section):
    """How many GPUs each group gets, and how the job's GPUs are shared between them."""

    SECTION: ClassVar[str] = "cluster"

    num_nodes: int = 1  # nodes of the allocation (jobs/submit.py --nodes)
    gpus_per_node: int = 2  # on a machine without GPUs these are declared to Ray, not real
    # None (the default): the split of the whole allocation that ``split`` documents.
    actor_num_gpus: int | None = None
    rollout_num_gpus: int | None = None  # GPUs of the rollout engines (None: the split above)
    rollout_gpus_per_engine: int = 1  # GPUs per engine: its tensor-parallel size
    colocate: bool = False  # actor and engines share the same GPUs
    offload: bool = False  # free engine memory during training (and the actor's during generation)
    ray_start_timeout_s: float = 300.0  # all nodes must join Ray within this, or the job fails naming them
    replace_lost_nodes: bool = True  # Slurm: a one-node job per lost node, whose Ray worker rejoins the run
    # A Slurm heterogeneous job: the actor on num_nodes x gpus_per_node (component 0), the engines
    # on rollout_nodes x rollout_gpus_per_node (component 1), from rollout_partition. None: one
    # homogeneous allocation that both groups share.
    rollout_nodes: int | None = None
    rollout_gpus_per_node: int | None = None  # None: gpus_per_node
    rollout_partition: str | None = None  # None: the job's own partition
    # The reward model's component (issue 30): reward_nodes x reward_gpus_per_node from
    # reward_partition, a third component after the rollout's (needs rollout_nodes and reward_model).
    reward_nodes: int | None = None
    reward_gpus_per_node: int | None = None  # None: gpus_per_node
    reward_partition: str | None = None  # None: the job's own partition
    # Staged start (rlhpc/runtime/staging.py): a node-local path ($VARS expanded on the node) the
    # base model and the checkpoint resumed from are copied to before anything loads them. None: off.
    stage_dir: str | None = None
    stage_with: Literal["auto", "sbcast", "copy"] = "auto"  # auto: sbcast where Slurm has it
    # Memory of one GPU in GiB (nvidia-smi's memory.total / 1024; an H100 80GB reports 79.6).
    # Set: the dry run and submission refuse a layout whose estimate (rlhpc/cluster/memory.py,
    # docs/guides/scale.md "Will it fit?") exceeds it. None: unknown, the plan is shown only.
    gpu_memory_gb: float | None = None
    # The GPU kind, for the dry run's step-time estimate and the fastest layout it suggests
    # (rlhpc/cluster/timing.py, docs/guides/scale.md "How long will a step take?"); there its
    # memory stands in for gpu_memory_gb where that is unset (only gpu_memory_gb makes a
    # submission refuse a layout). None: no time estimate.
    gpu_kind: Literal["A100", "H100", "H200", "B200"] | None = None

    @property
    def heterogeneous(self) -> bool:
        return self.rollout_nodes is not None

    @property
    def rollout_node_gpus(self) -> int:
        """GPUs per node of the rollout component (het jobs), else of every node."""
        return self.rollout_gpus_per_node if self.rollout_gpus_per_node is not None else self.gpus_per_node

    @property
    def reward_node_gpus(self) -> int:
        """GPUs per node of the reward component (het jobs with reward_nodes), else of every node."""
        return self.reward_gpus_per_node if self.reward_gpus_per_node is not None else self.gpus_per_node

    @property
    def component_nodes(self) -> tuple[int, ...]:
        """Nodes of each component: (actor, rollout[, reward]) in a heterogeneous job, else (num_nodes,)."""
        if not self.heterogeneous:
            return (self.num_nodes,)
        return (self.num_nodes, self.rollout_nodes or 0, *((self.reward_nodes,) if self.reward_nodes else ()))

    @property
    def component_gpus(self) -> tuple[int, ...]:
        """GPUs per node of each component, as ``component_nodes``."""
        if not self.heterogeneous:
            return (self.gpus_per_node,)
        return (self.gpus_per_node, self.rollout_node_gpus, *((self.reward_node_gpus,) if self.reward_nodes else ()))

    @property
    def total_nodes(self) -> int:
        return sum(self.component_nodes)

    @property
    def node_gpus(self) -> tuple[int, ...]:
        """GPUs of each node of the allocation, in order: the actor component first (het jobs)."""
        return tuple(g for n, g in zip(self.component_nodes, self.component_gpus) for _ in range(n))

    @property
    def total_gpus(self) -> int:
        return sum(self.node_gpus)

    def split(self, tp: int = 1, reserved: int = 0) -> tuple[int, int]:
        """(actor GPUs, rollout GPUs): the values set, and for those left unset (None) the default
        split of the whole allocation, the one place it is decided:

        - disaggregated: the engines get half of the GPUs, rounded down to whole engines (at least
          one engine); the actor gets the rest, rounded down to whole tensor-parallel groups (``tp``);
          one of the two set: the other gets what is left, rounded the same way;
        - colocated: the actor gets every GPU (whole TP groups), the engines as many whole engines
          as fit on the actor's GPUs.

        - heterogeneous (``rollout_nodes`` set): each group takes its own component, the actor all
          of component 0 (whole TP groups), the engines as many whole engines as component 1 holds.

        The embedded default (1 node x 2 GPUs) is 1 actor rank + 1 engine; 2 x 4 is 4 + 4.
        ``reserved``: GPUs of a third group (``reward_model.num_gpus``), taken off the total first;
        in a heterogeneous job with ``reward_nodes`` that group has a component of its own instead.
        """
        total, per = self.total_gpus - reserved, self.rollout_gpus_per_engine
        actor, rollout = self.actor_num_gpus, self.rollout_num_gpus
        if self.heterogeneous:
            actor = actor if actor is not None else self.num_nodes * self.gpus_per_node // tp * tp
            own = (self.rollout_nodes or 0) * self.rollout_node_gpus
            return actor, rollout if rollout is not None else max(per, own // per * per)
        if self.colocate:
            actor = actor if actor is not None else total // tp * tp
            return actor, rollout if rollout is not None else max(per, actor // per * per)
        if rollout is None:
            room = total // 2 if actor is None else total - actor
            rollout = max(per, room // per * per)
        if actor is None:
            actor = max(0, total - rollout) // tp * tp
        return actor, rollout

    def used_gpus(self, reserved: int = 0) -> int:
        """GPUs the layout takes: the actor's and the rollout's (colocated: shared) and ``reserved``."""
        actor, rollout = self.split(reserved=reserved)
        return (actor if self.colocate else actor + rollout) + reserved

    def idle_gpus(self, reserved: int = 0) -> int:
        """GPUs of the allocation that neither the actor nor an engine (nor a reward engine) uses."""
        return self.total_gpus - self.used_gpus(reserved)

    def check(self) -> None:
        # The GPU layout reads only cluster.* keys, so its rules live here.
        counts = ("num_nodes", "gpus_per_node", "actor_num_gpus", "rollout_num_gpus", "rollout_gpus_per_engine")
        for name in (*counts, "rollout_nodes", "rollout_gpus_per_node", "reward_nodes", "reward_gpus_per_node"):
            self._at_least(1, name, fix=f"set {self.key(name)} to a positive count")
        self._above(0, "ray_start_timeout_s", fix=f"give {self.key('ray_start_timeout_s')} seconds, e.g. 300")
        if self.gpu_memory_gb is not None:
            self._above(0, "gpu_memory_gb", fix="give one GPU's memory in GiB (e.g. 80), or null for unknown")
        if self.stage_dir is not None and not self.stage_dir.startswith(("/", "~", "$")):
            raise ConfigError(
                f"{self.key('stage_dir')} = {self.stage_dir!r} is not an absolute path",
                "give a node-local directory such as /tmp, /local/scratch/$USER or $TMPDIR (expanded on each node)",
            )
        self._check_components()
        self._check_split()

    def _check_components(self) -> None:
        """The keys of a heterogeneous job's components come with the components they describe."""
        if self.heterogeneous:
            self._check_heterogeneous()
        elif self.rollout_gpus_per_node is not None or self.rollout_partition is not None:
            key = "rollout_gpus_per_node" if self.rollout_gpus_per_node is not None else "rollout_partition"
            raise ConfigError(
                f"{self.key(key)} is set but cluster.rollout_nodes is not: the engines have no nodes of their own",
                "set cluster.rollout_nodes (--rollout-nodes N) for a heterogeneous job, or drop the key",
            )
        if self.reward_nodes is None and (self.reward_gpus_per_node is not None or self.reward_partition is not None):
            key = "reward_gpus_per_node" if self.reward_gpus_per_node is not None else "reward_partition"
            raise ConfigError(
                f"{self.key(key)} is set but cluster.reward_nodes is not: the reward model has no nodes of its own",
                "set cluster.reward_nodes (--reward-nodes N) for a reward component, or drop the key",
            )
        if self.reward_nodes is not None and not self.heterogeneous:
            raise ConfigError(
                "cluster.reward_nodes without cluster.rollout_nodes: the reward model's component is the third "
                "of a heterogeneous job, after the actor's and the engines'",
                "set cluster.rollout_nodes too (--rollout-nodes N), or drop cluster.reward_nodes: the reward "
                "engines then take GPUs of the one allocation",
            )

    def _check_split(self) -> None:
        """The actor and the engines fit the job's GPUs, each engine a whole number of GPUs."""
        actor, rollout = self.split()
        if rollout % self.rollout_gpus_per_engine:
            raise ConfigError(
                f"cluster.rollout_num_gpus = {rollout} is not a multiple of "
                f"cluster.rollout_gpus_per_engine = {self.rollout_gpus_per_engine}",
                "make the rollout GPUs a whole number of engines",
            )
        total = self.total_gpus
        if actor < 1:
            raise ConfigError(
                f"the job has {total} GPUs (cluster.num_nodes={self.num_nodes} x cluster.gpus_per_node="
                f"{self.gpus_per_node}): none left for the actor after {rollout} rollout GPUs",
                "ask for more nodes/GPUs, or set cluster.rollout_num_gpus / cluster.rollout_gpus_per_engine lower",
            )
        if self.colocate:
            if rollout > actor:
                raise ConfigError(
                    f"colocate: cluster.rollout_num_gpus = {rollout} > cluster.actor_num_gpus = {actor}",
                    "in colocate mode the engines live on the actor's GPUs: use at most as many rollout GPUs",
                )
            needed = actor
        else:
            needed = actor + rollout
        if needed > total:
            raise ConfigError(
                f"the layout needs {needed} GPUs (actor {actor} + rollout {rollout}"
                f"{', colocated' if self.colocate else ''}) but the job has {total} "
                f"(cluster.num_nodes={self.num_nodes} x cluster.gpus_per_node={self.gpus_per_node})",
                "ask for more nodes/GPUs, or shrink cluster.actor_num_gpus / cluster.rollout_num_gpus",
            )
        per, node = self.rollout_gpus_per_engine, self.rollout_node_gpus
        if per > node and per % node:
            name = "rollout_gpus_per_node" if self.heterogeneous else "gpus_per_node"
            raise ConfigError(
                f"cluster.rollout_gpus_per_engine = {per} spans nodes unevenly ({name} = {node})",
                f"use a divisor or a multiple of cluster.{name}",
            )

    def _check_heterogeneous(self) -> None:
        """Each group lives on its own component: nothing is shared, each must fit its own."""
        if self.colocate or self.offload:
            key = "colocate" if self.colocate else "offload"
            raise ConfigError(
                f"{self.key(key)} with cluster.rollout_nodes: in a heterogeneous job the actor and the engines "
                "have nodes of their own, there is no GPU to share",
                f"drop {self.key(key)}, or cluster.rollout_nodes for one allocation both groups share",
            )
        for key in ("rollout_partition", "reward_partition"):
            if getattr(self, key) is not None and not re.fullmatch(r"[\w.-]+", getattr(self, key)):
                self._refuse(key, "is not a partition name", "give the name sinfo lists, e.g. gen")
        actor, rollout = self.split()
        for group, used, nodes, per_node, keys in (
            ("actor", actor, self.num_nodes, self.gpus_per_node, "cluster.num_nodes x cluster.gpus_per_node"),
            ("rollout", rollout, self.rollout_nodes, self.rollout_node_gpus,
             "cluster.rollout_nodes x cluster.rollout_gpus_per_node"),
        ):  # fmt: skip
            if used > nodes * per_node:
                raise ConfigError(
                    f"cluster.{group}_num_gpus = {used} but its component has {nodes * per_node} GPUs ({keys})",
                    f"ask for more nodes/GPUs for the {group}, or lower cluster.{group}_num_gpus",
                )


@dataclass
class TinyModelConfig(Section):
    """A randomly initialised model small enough to train on two CPU cores (built by rlhpc.model)."""

    SECTION: ClassVar[str] = "model.tiny"

    # The HF model type: Llama, Qwen2 (qkv bias), Qwen3 (QK-norm), Qwen3-MoE (QK-norm, routed experts),
    # Qwen2.5-VL (a vision-language model: a two-block vision tower, images in prompts; tokenizer bpe).
    architecture: Literal["llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_5_vl"] = "llama"
    # "char": one token per character, with a BOS. "bpe": a byte-level BPE trained on the tasks'
    # text, shaped as Qwen's ships (no BOS, ChatML special tokens and chat template, every byte).
    tokenizer: Literal["char", "bpe"] = "char"
    hidden_size: int = 64  # the model's width
    intermediate_size: int = 256  # the MLP's width
    num_hidden_layers: int = 2  # transformer layers
    num_attention_heads: int = 4  # query heads
    num_key_value_heads: int = 2  # key/value heads (grouped-query attention)
    max_position_embeddings: int = 128  # the context length in tokens (prompt and response)
    # qwen3_moe only: routed experts per layer, experts per token and each expert's ffn size.
    num_experts: int = 4
    num_experts_per_tok: int = 2  # experts each token is routed to
    moe_intermediate_size: int = 64  # each expert's MLP width
    seed: int = 0  # the random weights' (and the bpe tokenizer's) seed

    def check(self) -> None:
        sizes = (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
            "num_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
        )
        self._at_least(1, *sizes)
        if self.architecture == "qwen2_5_vl" and self.tokenizer != "bpe":
            self._refuse(
                "tokenizer",
                "has no chat template or vision tokens, which the qwen2_5_vl architecture needs",
                "set model.tiny.tokenizer: bpe",
            )
        if self.num_experts_per_tok > self.num_experts:
            self._refuse(
                "num_experts_per_tok",
                f"is above {self.key('num_experts')} = {self.num_experts}",
                "route each token to at most as many experts as a layer has",
            )
        if self.hidden_size % self.num_attention_heads:
            self._refuse(
                "hidden_size",
                f"is not divisible by {self.key('num_attention_heads')} = {self.num_attention_heads}",
                "make the hidden size a multiple of the number of attention heads",
            )
        head_size = self.hidden_size // self.num_attention_heads
        if head_size % 2:
            raise ConfigError(
                f"{self.key('hidden_size')} / {self.key('num_attention_heads')} = {head_size} is odd: "
                "rotary embeddings need an even head size",
                "choose an even hidden_size / num_attention_heads, e.g. hidden_size 64 with 4 heads",
            )
        if self.num_attention_heads % self.num_key_value_heads:
            self._refuse(
                "num_attention_heads",
                f"is not divisible by {self.key('num_key_value_heads')} = {self.num_key_value_heads}",
                "grouped-query attention shares each key/value head among a whole number of heads",
            )


@dataclass
class ModelConfig(Section):
    """The initial policy: an HF directory (``path``) or a tiny random model built at submit."""

    SECTION: ClassVar[str] = "model"

    # Exactly one of the two; ``validate`` checks that (a bare ModelConfig() is a valid default).
    path: str | None = None
    tiny: TinyModelConfig | None = None


@dataclass
class DataConfig(Section):
    """Prompts and the reward function. Without files, the task generates its own data."""

    SECTION: ClassVar[str] = "data"

    task: str = (
        "digit_sum"  # a built-in task (rlhpc.data.tasks): digit_sum, reverse, guess (multi-turn), code (sandboxed)
    )
    # .jsonl, .json, .parquet or a datasets.save_to_disk directory (rlhpc.data.files)
    train_file: str | None = None
    eval_file: str | None = None  # the eval set's file, read as train_file is (None: the task's own eval rows)
    prompt_key: str = "prompt"  # where a row's prompt is (text or chat messages); dotted for nested fields
    label_key: str = "answer"  # where its label is (verl's files: reward_model.ground_truth)
    # Where a row's images are (verl's: images; a list of bytes, paths or {"bytes", "path"}), one
    # <image> in its prompt messages per image; a file without the column is text only (docs/guides/multimodal.md).
    image_key: str = "images"
    num_train: int = 100  # rows the task generates for training (without train_file)
    num_eval: int = 100  # rows the task generates for evaluation (without eval_file)
    # Longer prompts are dropped at load, counted in the log (None: the model's context length
    # minus the split's max_new_tokens, so no request can be refused for its length).
    max_prompt_tokens: int | None = None
    # Chat-message prompts: "auto" renders them with the tokenizer's own template, a path with
    # that Jinja file; "none" refuses them. Text prompts are sent as they are.
    chat_template: str = "auto"
    system_prompt: str | None = None  # first, where a chat prompt has no system message
    reward: str | None = None  # "module:function" overriding the task's reward; needed with files
    # A reward that raises: "raise" stops the run naming the function and the sample; "zero"
    # scores the sample 0 and counts it (reward/errors).
    reward_errors: Literal["raise", "zero"] = "raise"
    # A remote grader (data.reward: http://host:port/path): each call's limit, calls at once, and
    # a file holding its key (sent as a bearer token).
    reward_timeout_s: float = 60.0
    reward_concurrency: int = 16  # remote grader calls at once
    reward_key_file: str | None = None  # a file holding the remote grader's key, sent as a bearer token
    # > 0: a local data.reward runs in this many processes of its own, each call cut at
    # reward_timeout_s (0: in the driver, unbounded; for cheap rewards)
    reward_workers: int = 0
    # The rule reward's weight in score = reward_weight x rule + reward_model.weight x reward model
    # (only a reward_model section makes the sum; without one the rule reward is the score).
    reward_weight: float = 1.0
    seed: int = 0  # the seed the task generates its rows from

    def check(self) -> None:
        self._at_least(1, "num_train", "num_eval", "reward_concurrency")
        self._at_least(0, "reward_workers", fix="use 0 to score in the driver, or a number of processes")
        if self.reward_workers and (self.reward is None or self.reward.startswith(("http://", "https://"))):
            self._refuse(
                "reward_workers",
                "runs a data.reward of your own (module:function) in processes, but none is set",
                "set data.reward: my_module:my_reward, or data.reward_workers: 0",
            )
        if not self.reward_timeout_s > 0:
            self._refuse("reward_timeout_s", "must be > 0", "give each remote reward call a limit in seconds, e.g. 60")
        if self.max_prompt_tokens is not None:
            self._at_least(1, "max_prompt_tokens", fix="set a positive token count, or null for the model's context")


@dataclass
class RewardTinyModelConfig(TinyModelConfig):
    """A tiny random reward model built at submit (tests): a one-label classifier, or for
    ``reward_model.kind: judge`` a causal LM."""

    SECTION: ClassVar[str] = "reward_model.tiny"


@dataclass
class JudgeSamplingConfig(Section):
    """The generative judge's own sampling params (``reward_model.kind: judge``), apart from the
    rollout's: by default greedy and short, as a grader's verdict wants. Each sample's judgement
    also has its own seed, so a ``deterministic: true`` run judges alike on rerun."""

    SECTION: ClassVar[str] = "reward_model.sampling"

    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # 1.0: off
    max_new_tokens: int = 64  # the judge's reply at most
    top_k: int = -1  # -1: off
    min_p: float = 0.0  # 0: off
    repetition_penalty: float = 1.0  # 1: off
    stop: list[str] = field(default_factory=list)  # stop strings

    def check(self) -> None:
        self._at_least(0, "temperature", fix="use 0 for greedy decoding, or e.g. 1.0 to sample")
        if not 0 < self.top_p <= 1:
            self._refuse("top_p", "must be in (0, 1]", "use 1.0 for no nucleus filter")
        self._at_least(1, "max_new_tokens")
        _check_sampling_knobs(self)


# The built-in judge (``rlhpc.rollout.judge``): asks for a score in [0, 10] and reads it back / 10.
DEFAULT_JUDGE_PROMPT = "rlhpc.rollout.judge:score_prompt"
DEFAULT_JUDGE_PARSE = "rlhpc.rollout.judge:parse_score"


@dataclass
class RewardModelConfig(Section):
    """A frozen reward model on GPUs of its own (issue 30), served by engines that never get
    weight pushes; its score mixes in as ``weight`` x that score. Two kinds:

    - ``classifier``: a sequence-classification model (HF ``*ForSequenceClassification``, one
      label). Each sample's prompt + response, rendered with the reward model's chat template, is
      scored through SGLang's ``/classify`` route.
    - ``judge``: a chat model (HF ``*ForCausalLM``) asked for a verdict: ``judge_prompt(sample)``
      writes the messages, the engines generate the answer on ``/generate`` with ``sampling``,
      and ``judge_parse(text)`` reads the score out of it."""

    SECTION: ClassVar[str] = "reward_model"

    # Exactly one of the two: an HF directory, or a tiny random model built at submit (tests):
    # a classifier for kind classifier, a causal LM on the tiny tokenizer for kind judge.
    path: str | None = None
    tiny: RewardTinyModelConfig | None = None
    # classifier: a *ForSequenceClassification's score; judge: a chat model's verdict, parsed
    kind: Literal["classifier", "judge"] = "classifier"
    backend: Literal["cpu", "sglang"] = "cpu"  # its engines: cpu (the CPU engine server) or sglang
    num_gpus: int = 1  # the reward group's GPUs, a third group beside the actor's and the rollout's
    gpus_per_engine: int = 1  # each reward engine's TP
    weight: float = 1.0  # of the reward model's score in the sum (data.reward_weight: the rule reward's)
    batch_size: int = 64  # samples per /classify (or, for a judge, /generate) request
    # A classifier scores each /generate request's samples as soon as it is answered, while the rest generate;
    # false: once the rollout's generation is done (the same batches, so the same scores). A judge: always after.
    overlap: bool = True
    mem_fraction_static: float = 0.8  # SGLang: no KV cache to grow, so most of the GPU may hold weights
    extra_args: list[str] = field(default_factory=list)  # passed to sglang.launch_server as they are
    # kind judge: "module:function"s, judge_prompt(sample: Sample) -> list of chat messages and
    # judge_parse(text: str) -> float; None: the built-in ones (a score from 0 to 10, read / 10)
    judge_prompt: str | None = None
    judge_parse: str | None = None  # see judge_prompt
    sampling: JudgeSamplingConfig = field(default_factory=JudgeSamplingConfig)

    def check(self) -> None:
        if (self.path is None) == (self.tiny is None):
            model = "*ForSequenceClassification" if self.kind == "classifier" else "chat (*ForCausalLM)"
            raise ConfigError(
                "reward_model needs exactly one of reward_model.path and reward_model.tiny",
                f"point reward_model.path at an HF {model} directory, or use reward_model.tiny",
            )
        if self.kind == "classifier":
            for name in ("judge_prompt", "judge_parse"):
                if getattr(self, name) is not None:
                    self._refuse(name, "is for a generative judge", "drop it, or set reward_model.kind: judge")
        self._at_least(1, "num_gpus", "gpus_per_engine", "batch_size")
        if self.num_gpus % self.gpus_per_engine:
            self._refuse(
                "num_gpus",
                f"is not a multiple of {self.key('gpus_per_engine')} = {self.gpus_per_engine}",
                "make the reward GPUs a whole number of engines",
            )
        if not 0 < self.mem_fraction_static < 1:
            self._refuse("mem_fraction_static", "must be in (0, 1)", "give SGLang a share of each GPU, e.g. 0.8")

    @property
    def num_engines(self) -> int:
        return self.num_gpus // self.gpus_per_engine

    @property
    def prompt_spec(self) -> str:
        return self.judge_prompt or DEFAULT_JUDGE_PROMPT

    @property
    def parse_spec(self) -> str:
        return self.judge_parse or DEFAULT_JUDGE_PARSE


@dataclass
class TeacherTinyModelConfig(TinyModelConfig):
    """A tiny random causal LM built at submit as the teacher (tests): give it the policy's
    tokenizer (``model.tiny``'s ``tokenizer`` and, for bpe, ``seed``) so the token ids agree."""

    SECTION: ClassVar[str] = "teacher.tiny"


@dataclass
class TeacherConfig(Section):
    """A frozen teacher on GPUs of its own (issue 30), a group placed like the reward model's:
    engines that never get weight pushes score each trained response token (its logprob under
    the teacher, through SGLang's ``return_logprob`` with ``logprob_start_len``), for on-policy
    distillation (``algo.distill_coef``) or a KL penalty to the teacher (``algo.kl_target``).
    The teacher must share the policy's tokenizer: its logprobs are of the policy's token ids."""

    SECTION: ClassVar[str] = "teacher"

    path: str | None = None  # exactly one of path (an HF causal LM directory) and tiny
    tiny: TeacherTinyModelConfig | None = None
    backend: Literal["cpu", "sglang"] = "cpu"  # its engines: cpu (the CPU engine server) or sglang
    num_gpus: int = 1  # the teacher group's GPUs, after the actor's, the rollout's and the reward model's
    gpus_per_engine: int = 1  # each teacher engine's TP
    batch_size: int = 64  # samples per /generate request (each a prefill: prompt + response, no new token)
    mem_fraction_static: float = 0.8  # SGLang: prefills only, so most of the GPU may hold weights
    extra_args: list[str] = field(default_factory=list)  # passed to sglang.launch_server as they are

    def check(self) -> None:
        if (self.path is None) == (self.tiny is None):
            raise ConfigError(
                "teacher needs exactly one of teacher.path and teacher.tiny",
                "point teacher.path at an HF causal LM directory with the policy's tokenizer, or use teacher.tiny",
            )
        self._at_least(1, "num_gpus", "gpus_per_engine", "batch_size")
        if self.num_gpus % self.gpus_per_engine:
            self._refuse(
                "num_gpus",
                f"is not a multiple of {self.key('gpus_per_engine')} = {self.gpus_per_engine}",
                "make the teacher GPUs a whole number of engines",
            )
        if not 0 < self.mem_fraction_static < 1:
            self._refuse("mem_fraction_static", "must be in (0, 1)", "give SGLang a share of each GPU, e.g. 0.8")

    @property
    def num_engines(self) -> int:
        return self.num_gpus // self.gpus_per_engine


@dataclass
class SGLangConfig(Section):
    """Options of the SGLang servers (``rollout.backend: sglang``); TP = cluster.rollout_gpus_per_engine."""

    SECTION: ClassVar[str] = "rollout.sglang"

    mem_fraction_static: float = 0.7  # GPU memory for weights + KV cache (colocate: leave room for the actor)
    router: bool = True  # put sglang_router in front of the engines for generation (CPU engines too)
    extra_args: list[str] = field(default_factory=list)  # passed to sglang.launch_server as they are

    def check(self) -> None:
        if not 0 < self.mem_fraction_static < 1:
            self._refuse(
                "mem_fraction_static",
                "must be in (0, 1)",
                "give SGLang a share of each GPU, e.g. 0.7 (colocate: leave room for the actor, e.g. 0.4)",
            )
        if any(a.split("=", 1)[0] == "--skip-tokenizer-init" for a in self.extra_args):
            self._refuse(
                "extra_args",
                "asks SGLang to skip its tokenizer, so its answers carry no text",
                "remove --skip-tokenizer-init: rewards score the engines' own detokenized responses",
            )


MAX_STOP_STRINGS = 32  # SGLang's MAX_STOP_COUNT (sampling_params.py)


def _check_sampling_knobs(section: Section) -> None:
    """SGLang's ranges (SamplingParams.verify) for a section's top_k, min_p, repetition_penalty and
    stop; None (unset) passes. Refused here, at submit, not by every engine at the first request."""
    top_k, min_p, rep, stop = section.top_k, section.min_p, section.repetition_penalty, section.stop
    if top_k is not None and top_k != -1 and top_k < 1:
        section._refuse("top_k", "must be -1 (off) or at least 1", "use -1 to sample from the whole vocabulary")
    if min_p is not None and not 0 <= min_p <= 1:
        section._refuse("min_p", "must be in [0, 1]", "use 0.0 for no min-p filter")
    if rep is not None and not 0 < rep <= 2:
        section._refuse("repetition_penalty", "must be in (0, 2]", "use 1.0 for no repetition penalty")
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(x, str) and x for x in stop):
            section._refuse("stop", "must be a list of non-empty strings", 'write e.g. ["</answer>"]')
        if len(stop) > MAX_STOP_STRINGS:
            section._refuse("stop", f"has more than SGLang's {MAX_STOP_STRINGS} stop strings", "keep at most 32")


@dataclass
class DynamicSamplingConfig(Section):
    """Drop prompt groups that cannot teach anything and generate more prompts to refill the batch.

    ``filter`` keeps a group (a prompt's ``n_samples_per_prompt`` samples) when it returns True:
    the built-in ``"nonzero_std"`` keeps groups whose rewards differ (all-equal rewards give zero
    advantage, so no gradient), or any importable ``"module:function"`` taking a
    ``rlhpc.data.dynamic_sampling.Group``. Each round generates ``over_sampling_batch_size``
    prompts until ``rollout.rollout_batch_size`` groups are kept, at most ``max_rounds`` rounds
    (then the batch is filled up with dropped groups, and ``dynamic_sampling/short`` says how many).
    The extra prompts are a pure function of (seed, rollout id, round), so reruns and resumes match.
    """

    SECTION: ClassVar[str] = "rollout.dynamic_sampling"

    filter: str | None = None  # None: off
    over_sampling_batch_size: int | None = None  # prompts per round; None: rollout.rollout_batch_size
    max_rounds: int = 4  # generation rounds at most per rollout; short of a full batch, dropped groups fill it

    def check(self) -> None:
        self._at_least(
            1, "over_sampling_batch_size", fix="generate at least rollout.rollout_batch_size prompts per round"
        )
        self._at_least(1, "max_rounds", fix="allow at least 1 round, e.g. 4")


@dataclass
class RolloutConfig(Section):
    SECTION: ClassVar[str] = "rollout"

    backend: Literal["cpu", "sglang"] = "cpu"  # the engines: cpu (the CPU engine server, no GPU) or sglang
    num_rollout: int | None = None  # None: derived from num_epoch and the data size
    num_epoch: int = 1  # passes over the training data (when num_rollout is None)
    rollout_batch_size: int = 32  # prompts per rollout
    n_samples_per_prompt: int = 8  # responses per prompt: the GRPO group
    max_new_tokens: int = 4  # tokens per reply at most
    temperature: float = 1.0  # sampling temperature of training rollouts
    top_p: float = 1.0  # nucleus sampling (1.0: off); eval uses it too
    # SGLang's sampling params, sent only when set away from these no-op defaults
    # (docs/guides/losses.md, "Sampling"); eval has its own (eval.top_k, ...).
    top_k: int = -1  # -1: off
    min_p: float = 0.0  # 0: off
    repetition_penalty: float = 1.0  # > 1 discourages tokens already generated
    stop: list[str] = field(default_factory=list)  # stop strings (the text is cut before one, its tokens kept)
    # DAPO's overlong filtering: a sample cut at max_new_tokens (finish reason "length"; for
    # multi-turn episodes, one cut by max_turns / max_episode_tokens) gets loss mask 0.
    overlong_filter: bool = False
    update_weight_buffer_mb: int = 512  # bucket size for weight sync
    # FP8 rollout (verl's and Cosmos-RL's rollout.quantization; docs/guides/moe.md#fp8-rollout):
    # the trained engines serve the policy with its layer projections in block FP8 (128 x 128
    # blocks, float32 scales: how SGLang loads FP8 checkpoints), from a copy of the model
    # quantized at the first start, and every push sends the trainer's weights quantized the
    # same way (half the bytes of bf16). The trainer keeps its precision; algo.tis turns on.
    quantization: Literal["fp8"] | None = None
    # Seconds an engine may take to start and answer /health (later is a start-up failure, named).
    # null: 120 s for the CPU engine, 600 s for SGLang (CUDA graph capture, cold JIT caches), plus
    # 30 s per GB of the model's weight files
    # (a 7B model in bf16, 15 GB: 1050 s on SGLang)
    engine_startup_timeout_s: float | None = None
    # Seconds one /generate request may take before its engine counts as dead. null: 600 s plus
    # 0.1 s per token of the largest max_new_tokens the request asks for (32768 tokens: about 1 h 5 min)
    generate_timeout_s: float | None = None
    max_engine_restarts: int = 3  # per engine: a dead/unhealthy engine is restarted and re-synced
    # Asynchronous pipeline: generation may run up to this many rollouts ahead of training, so
    # rollout r is generated with weights no older than version r - max_staleness (the weights
    # after training rollout r - max_staleness - 1). 0: the synchronous loop (generate, train,
    # push, repeat). >= 1 needs a disaggregated layout (the engines generate while the actor
    # trains). With `deterministic: true` the lag is fixed: rollout r uses exactly version
    # max(0, r - max_staleness), so results do not depend on timing and resume is exact.
    max_staleness: int = 0
    # Partial rollouts (needs max_staleness >= 1): a weight push does not wait for the rollout in
    # flight; its requests pause (SGLang's pause mode "retract"), the weights change, they go on.
    # Each token records the weight version it was sampled with. Not with `deterministic: true`:
    # where a push lands in a generation depends on timing.
    partial_rollout: bool = False
    # A shared engine fleet to attach to instead of starting engines (docs/guides/lora.md, "Many
    # runs, one fleet"): the fleet file (SWEEP_DIR/fleet.json) a `--shared-fleet` sweep writes and
    # sets for each of its tasks. The run serves its adapter under its run dir's name there
    # (needs actor.lora.push: adapter). None: the run starts its own engines.
    fleet: str | None = None
    # Multi-turn episodes (docs/guides/multi-turn.md): "module:Class", an environment with
    # reset(row) -> messages and step(reply) -> (messages, reward, done); None: single-turn (or
    # the data.task's own environment, for a multi-turn task such as guess).
    env: str | None = None
    max_turns: int = 4  # replies per episode; an episode still running after them is cut (truncated)
    # Response tokens per episode (the replies and the observations between them); an episode
    # whose next observation would not leave room for a token more is cut (truncated).
    max_episode_tokens: int = 256
    # Tools in episodes (docs/guides/multi-turn.md#tools): "module:function"s, typed Python
    # functions whose OpenAI schemas (from their signatures) the chat template lists; a reply
    # that calls any goes to them instead of the environment's step. Without rollout.env (and a
    # single-turn data.task) an episode ends at its first reply without calls, scored by data.reward.
    tools: list[str] = field(default_factory=list)
    # "module:function" reading a reply's tool calls: (text) -> rlhpc.wire.tool_calls.ParsedOutput
    # or a list of ParsedCall; the default reads Hermes/Qwen <tool_call> JSON blocks.
    tool_parser: str = "rlhpc.wire.tool_calls:parse_hermes"
    # Each call's limit in seconds; one still running after it answers "error: timed out after N s".
    tool_timeout_s: float = 30.0
    # Record every tool call's answer in RUN_DIR/tool_journal/ as it is made (fsynced once per
    # turn), and answer a resumed episode's calls from it instead of running them again, so a run
    # whose tools read the clock, the network or a sandbox's state resumes exactly (multi-turn guide).
    tool_journal: bool = True
    # Rollouts written as code (docs/guides/multi-turn.md#three-ways-in), instead of rollout.env:
    # "module:fn", (row, engine) -> rlhpc.rollout.trajectories.Trajectory (async def or def); its
    # engine.generate(input_ids, sampling) samples from the engines. The trajectory is checked:
    # the tokens it trains on (loss mask 1) must be the engines' own, with their logprobs.
    generate_fn: str | None = None
    # "module:fn", async def fn(row, base_url, api_key) -> float | None: OpenAI-client code pointed
    # at an endpoint rlhpc serves per episode in front of the engines; its calls, recorded token
    # for token, are the samples. None reward: data.reward scores the final transcript.
    agent: str | None = None
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    sglang: SGLangConfig = field(default_factory=SGLangConfig)

    def check(self) -> None:
        self._at_least(
            1, "num_rollout", fix="set rollout.num_rollout to a positive count, or null to derive it from num_epoch"
        )
        self._at_least(1, "num_epoch", "rollout_batch_size", "n_samples_per_prompt", "max_new_tokens")
        self._at_least(1, "update_weight_buffer_mb", "max_turns", "max_episode_tokens")
        self._above(0, "tool_timeout_s", fix="give rollout.tool_timeout_s seconds, e.g. 30")
        self._at_least(0, "temperature", fix="use 0 for greedy decoding, or e.g. 1.0 to sample")
        if not 0 < self.top_p <= 1:
            self._refuse("top_p", "must be in (0, 1]", "use 1.0 to sample from the whole distribution")
        _check_sampling_knobs(self)
        self._above(
            0,
            "engine_startup_timeout_s",
            "generate_timeout_s",
            fix="give seconds, or null for the formula it describes",
        )
        self._at_least(0, "max_engine_restarts", fix="set 0 to never restart an engine")
        self._at_least(
            0, "max_staleness", fix="set 0 for the synchronous loop, or 1 to overlap generation and training"
        )
        if self.partial_rollout and self.max_staleness < 1:
            self._refuse(
                "partial_rollout",
                "needs rollout.max_staleness >= 1 (in the synchronous loop no generation runs during a weight push)",
                "set rollout.max_staleness=1 (or more), or rollout.partial_rollout=false",
            )
        over = self.dynamic_sampling.over_sampling_batch_size
        if over is not None and over < self.rollout_batch_size:
            raise ConfigError(
                f"rollout.dynamic_sampling.over_sampling_batch_size = {over} < rollout.rollout_batch_size = "
                f"{self.rollout_batch_size}: a round must generate at least a batch of prompts",
                "raise over_sampling_batch_size (e.g. 2x rollout_batch_size) or leave it null",
            )


# The formulas of rollout.engine_startup_timeout_s and rollout.generate_timeout_s when null
STARTUP_BASE_S = {"cpu": 120.0, "sglang": 600.0}
STARTUP_S_PER_GB = 30.0
GENERATE_BASE_S = 600.0
GENERATE_S_PER_TOKEN = 0.1


def startup_timeout_s(rollout: RolloutConfig, weight_bytes: int) -> float:
    """How long an engine of ``rollout`` serving a model of ``weight_bytes`` may take to start."""
    if rollout.engine_startup_timeout_s is not None:
        return rollout.engine_startup_timeout_s
    return STARTUP_BASE_S[rollout.backend] + STARTUP_S_PER_GB * weight_bytes / 1e9


def generate_timeout_s(rollout: RolloutConfig, max_new_tokens: int) -> float:
    """How long a /generate request asking for up to ``max_new_tokens`` tokens may take."""
    if rollout.generate_timeout_s is not None:
        return rollout.generate_timeout_s
    return GENERATE_BASE_S + GENERATE_S_PER_TOKEN * max_new_tokens


DEFAULT_EVAL_SET = "default"  # the set of the old keys (data.eval_file, eval.*), logged as eval/reward, ...
# A set's metrics are eval/NAME/...: a name that is the first part of the default set's would be read as it
_RESERVED_SET_NAMES = ("reward", "response_len", "episode")
_SET_NAME = re.compile(r"[A-Za-z0-9_.-]+")


@dataclass
class EvalSetConfig(Section):
    """One named eval set (``eval.sets.NAME``). An unset key takes the value of the key that
    configures the default set: ``data.prompt_key``, ``eval.temperature``, ..."""

    SECTION: ClassVar[str] = "eval.sets"

    file: str | None = None  # None: the task's own generated eval split (data.num_eval rows)
    prompt_key: str | None = None  # None: data.prompt_key
    label_key: str | None = None  # None: data.label_key
    n_samples_per_prompt: int | None = None  # None: eval.n_samples_per_prompt
    temperature: float | None = None  # None: eval.temperature
    max_new_tokens: int | None = None  # None: eval.max_new_tokens, else rollout.max_new_tokens
    top_k: int | None = None  # None: eval.top_k (and so on for the three below)
    min_p: float | None = None  # None: eval.min_p
    repetition_penalty: float | None = None  # None: eval.repetition_penalty
    stop: list[str] | None = None  # None: eval.stop

    def check(self) -> None:
        self._at_least(1, "n_samples_per_prompt", fix=f"set {self.key('n_samples_per_prompt')} to at least 1")
        self._at_least(0, "temperature", fix="use 0 for greedy decoding, or e.g. 1.0 to sample")
        _check_sampling_knobs(self)
        self._at_least(1, "max_new_tokens", fix="set a positive count, or null to use eval.max_new_tokens")


@dataclass
class EvalConfig(Section):
    SECTION: ClassVar[str] = "eval"

    interval: int | None = None  # evaluate every N rollouts (and at epoch ends); None: never
    n_samples_per_prompt: int = 1  # > 1 (with temperature > 0): pass@k for k = 1, 2, 4, ... n and maj@n
    temperature: float = 0.0  # 0: greedy
    max_new_tokens: int | None = None  # None: rollout.max_new_tokens
    # SGLang's sampling params for eval, apart from rollout.*: the no-op defaults, as a
    # benchmark's protocol usually wants (top_p is rollout.top_p's).
    top_k: int = -1
    min_p: float = 0.0  # 0: off
    repetition_penalty: float = 1.0  # 1: off
    stop: list[str] = field(default_factory=list)  # stop strings
    pass_threshold: float = 1.0  # a sample passes (pass@k, maj@n) when its reward is at least this
    # Named eval sets, each logged as eval/NAME/mean, eval/NAME/pass@k, eval/NAME/maj@n. Empty:
    # one set from data.eval_file and the keys above, logged as eval/reward, eval/pass@k, ...
    sets: dict[str, EvalSetConfig] = field(default_factory=dict)

    def check(self) -> None:
        self._at_least(1, "interval", fix="set a positive interval, or null to disable eval")
        self._at_least(1, "n_samples_per_prompt")
        self._at_least(0, "temperature", fix="use 0 for greedy decoding, or e.g. 1.0 to sample")
        self._at_least(1, "max_new_tokens", fix="set a positive count, or null to use rollout.max_new_tokens")
        _check_sampling_knobs(self)
        for name, s in self.sets.items():
            if not _SET_NAME.fullmatch(name) or name in _RESERVED_SET_NAMES:
                raise ConfigError(
                    f"eval.sets has a set named {name!r}: a set's name is part of its metric names (eval/NAME/mean)",
                    "name it with letters, digits, _ . - only, and not "
                    f"{', '.join(_RESERVED_SET_NAMES)} (the default set's metrics), e.g. gsm8k",
                )
            s.check()  # again: a set's fields may have been assigned after it was built

    def resolved_sets(self, data: DataConfig, rollout: RolloutConfig) -> dict[str, EvalSetConfig]:
        """Every set evaluated, each key given (the old keys are the set ``DEFAULT_EVAL_SET``)."""
        sets = self.sets or {DEFAULT_EVAL_SET: EvalSetConfig(file=data.eval_file)}
        out = {}
        for name, s in sets.items():
            out[name] = dataclasses.replace(
                s,
                prompt_key=s.prompt_key or data.prompt_key,
                label_key=s.label_key or data.label_key,
                n_samples_per_prompt=s.n_samples_per_prompt or self.n_samples_per_prompt,
                temperature=self.temperature if s.temperature is None else s.temperature,
                max_new_tokens=s.max_new_tokens or self.max_new_tokens or rollout.max_new_tokens,
                top_k=self.top_k if s.top_k is None else s.top_k,
                min_p=self.min_p if s.min_p is None else s.min_p,
                repetition_penalty=self.repetition_penalty if s.repetition_penalty is None else s.repetition_penalty,
                stop=list(self.stop if s.stop is None else s.stop),
            )
        return out


def eval_split(set_name: str) -> str:
    """The split name a set's prompts are prepared and logged under (``eval`` for the default set)."""
    return "eval" if set_name == DEFAULT_EVAL_SET else f"eval/{set_name}"


@dataclass
class MegatronConfig(Section):
    """megatron-core options (``actor.backend: megatron``). DP = actor_num_gpus / (TP x PP)."""

    SECTION: ClassVar[str] = "actor.megatron"

    tensor_model_parallel_size: int = 1  # TP: each layer's weights split over this many ranks
    # Pipeline stages: the layers split evenly over this many ranks (it must divide the layers),
    # micro-batches run through them with megatron-core's 1F1B schedule. Each stage holds 1/PP
    # of the weights, gradients and optimizer state; the first keeps up to PP micro-batches'
    # activations in flight. The engines still get one model (the push gathers every stage).
    pipeline_model_parallel_size: int = 1
    # Virtual pipeline stages (megatron-core's interleaved 1F1B): each pipeline rank holds this
    # many chunks of layers / (PP x VP) layers, rank s the chunks s, s + PP, ... (it must divide
    # layers / PP; PP > 1). A smaller pipeline bubble for more point-to-point sends and, on the
    # first stage, 1 + (PP - 1) / (PP x VP) times the activations in flight. null: off. Dense
    # models only for now.
    virtual_pipeline_model_parallel_size: int | None = None
    # Shard optimizer state over data-parallel ranks. Its checkpoints resume at another DP size
    # but the same TP and PP sizes; the plain optimizer's reshard to any TP/PP/DP.
    use_distributed_optimizer: bool = False
    # bf16 weights, compute and weight pushes, with fp32 master weights and gradients. null: bf16
    # where the hardware has it (a CUDA GPU with bf16: Ampere and later), fp32 elsewhere (CPU,
    # gloo); the ranks log which. The memory plan, made for GPUs, counts bf16 unless false.
    bf16: bool | None = None
    # MoE models (qwen3_moe): experts split over this many ranks of the data-parallel group
    # (megatron's expert parallelism; it must divide DP and the number of experts).
    expert_model_parallel_size: int = 1
    # The router's load-balancing loss, added to the policy loss and logged as
    # moe_load_balancing_loss (unscaled). null: the model's router_aux_loss_coef (config.json).
    moe_router_load_balancing_type: Literal["aux_loss", "seq_aux_loss", "none"] = "aux_loss"
    moe_aux_loss_coeff: float | None = None  # the load-balancing loss's weight (None: the model's router_aux_loss_coef)
    # Full activation recompute (megatron-core's recompute_granularity "full", method "uniform",
    # one layer per chunk): only each layer's input is kept, the layer is recomputed in backward.
    recompute: bool = False

    def uses_bf16(self, device_has_bf16: bool) -> bool:
        """Whether the actor runs in bf16 on a device that has it or not: the one place ``bf16`` is read."""
        return device_has_bf16 if self.bf16 is None else self.bf16

    def check(self) -> None:
        self._at_least(1, "tensor_model_parallel_size", fix="use 1, 2, 4 or 8")
        self._at_least(1, "pipeline_model_parallel_size", fix="use 1 (no pipeline) or a divisor of the layers")
        self._at_least(1, "expert_model_parallel_size", fix="use 1 (no expert parallelism) or a divisor of the experts")
        vp = self.virtual_pipeline_model_parallel_size
        if vp is not None:
            self._at_least(
                2, "virtual_pipeline_model_parallel_size", fix="use null (off) or 2 or more chunks per stage"
            )
            if self.pipeline_model_parallel_size < 2:
                self._refuse(
                    "virtual_pipeline_model_parallel_size",
                    "needs pipeline_model_parallel_size > 1 (it splits each pipeline stage)",
                    "set actor.megatron.pipeline_model_parallel_size: 2 or more, or "
                    "virtual_pipeline_model_parallel_size: null",
                )
        self._at_least(0, "moe_aux_loss_coeff", fix="set 0 (no load-balancing loss) or a small value, e.g. 1e-3")


@dataclass
class LoraConfig(Section):
    """LoRA on the torch actor (docs/guides/lora.md): the model's weights stay frozen, low-rank
    adapters (``peft``'s) are trained beside them; the reference model is the same model with its
    adapters off. Unset (null, the default): full fine-tuning."""

    SECTION: ClassVar[str] = "actor.lora"

    rank: int = 16  # r: the adapters' rank (peft's r)
    alpha: float = 32.0  # the adapters' output is scaled by alpha / rank (peft's lora_alpha)
    # Dropout on the adapters' input in training forwards only (the no-grad and reference passes
    # run without it); 0 keeps the PPO ratio exactly 1 before the first step, as without LoRA.
    dropout: float = 0.0
    # Which linear layers get adapters, as peft names them: "all-linear" (every linear layer but
    # the output layer), or a list of module names matched at the end of the module path (e.g.
    # [q_proj, v_proj]); checked at submit against the model's weights.
    target_modules: str | list[str] = "all-linear"
    # How a push reaches the engines: "adapter", the adapter alone (its PEFT files, written under
    # the run dir and loaded by every engine, which serve it by name: megabytes, not the model),
    # or "merged", the merged full weights under the base model's names, for engines that cannot
    # serve adapters
    push: Literal["adapter", "merged"] = "adapter"

    def check(self) -> None:
        self._at_least(1, "rank", fix="give the adapters a positive rank, e.g. actor.lora.rank: 16")
        self._above(0, "alpha", fix="set actor.lora.alpha, e.g. twice the rank")
        if not 0 <= self.dropout < 1:
            self._refuse("dropout", "must be in [0, 1)", "set actor.lora.dropout: 0.0 (or e.g. 0.05)")
        if isinstance(self.target_modules, str) and self.target_modules != "all-linear":
            self._refuse(
                "target_modules",
                'is neither "all-linear" nor a list of module names',
                f"write actor.lora.target_modules: all-linear, or a list: [{self.target_modules}]",
            )
        if isinstance(self.target_modules, list) and not self.target_modules:
            self._refuse("target_modules", "names no module", "write all-linear, or e.g. [q_proj, v_proj]")

    def peft_kwargs(self) -> dict[str, Any]:
        """``peft.LoraConfig``'s arguments: the one place these keys become peft's."""
        return {
            "r": self.rank,
            "lora_alpha": self.alpha,
            "lora_dropout": self.dropout,
            "target_modules": self.target_modules,
        }


@dataclass
class ActorConfig(Section):
    SECTION: ClassVar[str] = "actor"

    # torch: PyTorch DDP ranks; megatron: megatron-core TP x PP x DP (actor.megatron)
    backend: Literal["torch", "megatron"] = "torch"
    lr: float = 1e-3  # AdamW's learning rate (the peak, with a schedule)
    weight_decay: float = 0.0  # AdamW's decoupled weight decay
    adam_betas: tuple[float, float] = (0.9, 0.999)  # AdamW's (beta1, beta2)
    adam_eps: float = 1e-8  # AdamW's epsilon
    grad_clip: float = 1.0  # the global gradient norm is clipped to this
    num_steps_per_rollout: int = 1  # optimizer steps (minibatches) per rollout batch
    micro_batch_size: int = 64  # samples per forward/backward on one rank
    # Micro-batches by tokens instead (docs/guides/losses.md, "Micro-batches and packing"):
    # null keeps micro_batch_size samples each; N puts a minibatch's samples in micro-batches of
    # at most N tokens (first-fit, longest first), which micro_batch_size then no longer bounds.
    max_tokens_per_micro_batch: int | None = None
    # With max_tokens_per_micro_batch, the PyTorch actor packs a micro-batch's samples into one
    # row (own position ids, block-diagonal attention, no padding); false, or the megatron actor
    # (megatron-core packs only with Transformer Engine), pads them: rows x longest <= N tokens.
    sequence_packing: bool = True
    # The rate of each optimizer step (rlhpc/actor/lr_schedule.py): a linear warmup to lr over
    # lr_warmup_steps, then constant, or a linear or cosine decay to min_lr at lr_decay_steps
    # (null: the run's last step, rollouts x num_steps_per_rollout). Resumes exactly.
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    lr_warmup_steps: int = 0  # optimizer steps of linear warm-up from 0 to lr
    lr_decay_steps: int | None = None  # optimizer steps of decay to min_lr (None: to the run's last step)
    min_lr: float = 0.0  # where linear and cosine decay end
    # Longest wait for one call on the training ranks (load, train, save, weight push, ...): a
    # rank silent for this long is taken as hung, the call fails naming it and the job requeues
    # (checkpoint.requeue_on_failure). Generous: a whole train step or checkpoint save must fit.
    call_timeout_s: float = 3600.0
    # After a stop request (preemption warning, time limit, Ctrl-C) a call gets at most this much
    # longer: a healthy train step and its save fit in it, and a hung rank still leaves time to
    # requeue within Slurm's default warning (--signal-grace 120). Below call_timeout_s to matter.
    stop_wait_s: float = 60.0
    # A vision-language model's vision tower (docs/guides/multimodal.md): false trains it with the
    # language model (verl's default); true keeps it as loaded (no gradients, no optimizer state).
    freeze_vision_tower: bool = False
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    # LoRA adapters instead of full fine-tuning (the torch actor; docs/guides/lora.md). null: off.
    lora: LoraConfig | None = None

    def check(self) -> None:
        # lr = 0 is allowed: a frozen policy is a baseline run (rollouts, rewards, evals unchanged).
        self._at_least(0, "lr", "weight_decay")
        for i, beta in enumerate(self.adam_betas):
            if not 0 <= beta < 1:
                raise ConfigError(
                    f"actor.adam_betas[{i}] = {beta!r} must be in [0, 1)", "write e.g. actor.adam_betas: [0.9, 0.999]"
                )
        self._above(0, "adam_eps", fix="set a small positive value, e.g. 1e-8")
        self._above(0, "grad_clip", fix="set the gradient-norm clip, e.g. 1.0")
        self._at_least(1, "num_steps_per_rollout", "micro_batch_size")
        self._at_least(
            1, "max_tokens_per_micro_batch", fix="set a token count, e.g. 8192, or null for micro_batch_size samples"
        )
        self._at_least(0, "lr_warmup_steps", "min_lr")
        self._at_least(1, "lr_decay_steps", fix="set a positive step count, or null for the run's last step")
        if self.min_lr > self.lr:
            self._refuse("min_lr", f"is above actor.lr = {self.lr!r}", "set actor.min_lr at or below actor.lr")
        if self.lr_decay_steps is not None and self.lr_decay_steps <= self.lr_warmup_steps:
            self._refuse(
                "lr_decay_steps",
                f"is not after the warmup (actor.lr_warmup_steps = {self.lr_warmup_steps})",
                "set actor.lr_decay_steps above actor.lr_warmup_steps, or null for the run's last step",
            )
        self._above(0, "call_timeout_s", fix="give actor.call_timeout_s seconds, e.g. 3600")
        self._above(0, "stop_wait_s", fix="give actor.stop_wait_s seconds, e.g. 60")
        if self.lora is not None and self.backend == "megatron":
            raise ConfigError(
                "actor.lora is set with actor.backend = megatron: the megatron actor has no LoRA yet "
                "(its layers are megatron-core's, which peft's adapters do not wrap)",
                "use actor.backend: torch for a LoRA run, or unset actor.lora (actor.lora: null) for megatron",
            )


@dataclass
class AlgoConfig(Section):
    SECTION: ClassVar[str] = "algo"

    # The definitions of these knobs, and the names verl, slime and OpenRLHF give them, are in
    # docs/guides/losses.md.
    advantage_estimator: Literal["grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"] = "grpo"
    normalize_std: bool = True  # GRPO: divide each group's advantages by its reward std (false: Dr. GRPO)
    # ppo_clip: token ratios clipped to [1 - eps_clip, 1 + eps_clip_high]; gspo: one ratio per
    # sample, clipped to [1 - gspo_eps_clip, 1 + gspo_eps_clip_high]; cispo: the token ratio
    # truncated at 1 + eps_clip_high and detached, times A * logprob.
    policy_loss: Literal["ppo_clip", "gspo", "cispo"] = "ppo_clip"
    # how token losses become the loss (docs/guides/losses.md)
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = (
        "token-mean"
    )
    eps_clip: float = 0.2  # ppo_clip: the ratio's lower bound is 1 - eps_clip
    # ppo_clip: the upper bound is 1 + eps_clip_high (DAPO's clip-higher); cispo's truncation
    eps_clip_high: float = 0.28
    # A sequence ratio moves far less than a token's, hence GSPO's much narrower range (its paper's).
    gspo_eps_clip: float = 3e-4
    gspo_eps_clip_high: float = 4e-4  # gspo: the sequence ratio's upper bound is 1 + this
    entropy_coef: float = 0.0  # > 0 subtracts coef * entropy (aggregated as the loss) from the loss
    kl_coef: float = 0.0  # > 0 adds a KL penalty to the reference model (loaded then)
    # the per-token KL estimate: k1, k2, k3 or low_var_kl (k3, clamped: rlhpc.algo.grpo)
    kl_estimator: Literal["k1", "k2", "k3", "low_var_kl"] = "k3"
    # Where the KL penalty goes: false, into the loss (per token, with its gradient); true, into
    # the reward before advantages: reward_i -= kl_coef * sum_t KL_t over sample i's response
    # tokens, KL_t of the policy about to be trained against the reference (no gradient).
    kl_in_reward: bool = False
    # Every N rollouts the reference becomes the current policy (reference resetting); 0: it
    # stays the initial model. The reference at the last reset is saved with each checkpoint.
    ref_update_interval: int = 0
    # Off-policy correction (truncated importance sampling): each token's loss is weighted by
    # min(pi_old / pi_engine, tis_clip), where pi_engine is the probability the engine sampled
    # it with (its own logprobs: older weights with rollout.max_staleness >= 1, and a different
    # implementation in any case) and pi_old the trainer's policy before the rollout's steps.
    # Reported: tis_clipfrac (share of tokens truncated) and tis_weight (mean weight).
    # null: on with rollout.quantization (FP8 engines sample from weights the trainer does not
    # hold: the correction verl, slime and NeMo-RL pair with FP8 rollout), off otherwise.
    tis: bool | None = None
    tis_clip: float = 2.0  # the truncation of the importance weight
    # Rollout routing replay ("R3", MoE models): the engines answer which experts each token
    # went to in every layer (SGLang's --enable-return-routed-experts), the rollout carries them,
    # and the actor's forwards (old-policy logprobs and training) route every token to the
    # engine's experts instead of choosing again: the trainer's logprobs are then those of the
    # engine's routing decisions (docs/guides/moe.md).
    routing_replay: bool = False
    # DAPO's soft overlong punishment: a response longer than rollout.max_new_tokens -
    # overlong_buffer tokens gets up to -overlong_penalty added to its reward, linearly over the
    # buffer, before advantages. 0: off.
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0  # the penalty at max_new_tokens (linear over the buffer)

    # On-policy distillation (issue 30; slime's --opd-kl-coef): each response token's advantage
    # loses distill_coef x (log pi_old - log pi_teacher), the per-token reverse KL to the teacher
    # section's model (logged as distill/kl). 0: off.
    distill_coef: float = 0.0
    # What the kl_coef penalty pulls toward: the initial model ("reference", loaded on the
    # actor), or the teacher's logprobs of the same tokens ("teacher", no reference copy).
    kl_target: Literal["reference", "teacher"] = "reference"

    @property
    def needs_reference(self) -> bool:
        """The KL penalty to a reference model is on: the actor keeps a frozen one (the initial
        model, or the policy at the last reset with ``ref_update_interval``)."""
        return self.kl_coef > 0 and self.kl_target == "reference"

    @property
    def needs_teacher(self) -> bool:
        """The loss reads the teacher's logprobs: distillation, or the KL penalty to the teacher."""
        return self.distill_coef > 0 or (self.kl_coef > 0 and self.kl_target == "teacher")

    @property
    def kl_loss_coef(self) -> float:
        """The KL term's weight in the loss: 0 when the penalty goes into the reward instead."""
        return 0.0 if self.kl_in_reward else self.kl_coef

    def check(self) -> None:
        self._at_least(0, "eps_clip", "eps_clip_high")
        self._at_least(0, "overlong_buffer", fix="set 0 for no overlong penalty, or a token count below max_new_tokens")
        self._at_least(0, "overlong_penalty", fix="set the largest penalty (a positive number, e.g. 1.0)")
        self._above(0, "tis_clip", fix="set the truncation of the importance weights, e.g. 2.0")
        self._at_least(0, "kl_coef", fix="set 0 for no KL penalty, or a positive weight")
        self._at_least(0, "ref_update_interval", fix="set 0 to keep the initial model as the reference")
        if self.kl_coef == 0 and self.kl_in_reward:
            self._refuse(
                "kl_in_reward",
                "is true but algo.kl_coef = 0: there is no KL penalty to put into the reward",
                "set algo.kl_coef to the penalty's weight (e.g. 0.01), or algo.kl_in_reward: false",
            )
        if self.kl_coef == 0 and self.ref_update_interval:
            self._refuse(
                "ref_update_interval",
                "is set but algo.kl_coef = 0: there is no reference model to reset",
                "set algo.kl_coef to the KL penalty's weight (e.g. 0.01), or algo.ref_update_interval: 0",
            )
        if self.kl_target == "teacher" and (self.kl_in_reward or self.ref_update_interval):
            self._refuse(
                "kl_target",
                "is teacher, with algo.kl_in_reward or algo.ref_update_interval, which act on the reference model",
                "use algo.kl_target: reference with those, or drop them to pull toward the teacher in the loss",
            )
        self._at_least(0, "distill_coef", fix="set 0 for no distillation, or a positive weight, e.g. 1.0")
        self._at_least(0, "gspo_eps_clip", "gspo_eps_clip_high")
        self._at_least(0, "entropy_coef", fix="set 0 for no entropy bonus, or a small positive weight, e.g. 0.001")


@dataclass
class CheckpointConfig(Section):
    SECTION: ClassVar[str] = "checkpoint"

    save_interval: int | None = 10  # save every N rollouts (and at epoch ends); None: only at the end
    keep_last: int = 2  # checkpoints kept; older ones are deleted once a newer one is complete
    # auto: resume from the run dir's newest valid checkpoint; never: start fresh (older ones
    # move to checkpoints/superseded-*, never resumed from or deleted)
    resume: Literal["auto", "never"] = "auto"
    max_restarts: int = 20  # requeues (preemption, time limit, failure) before the job is held
    max_starts_without_progress: int = 3  # restarts that train no rollout before the job is held
    requeue_on_failure: bool = True  # a crashed job requeues itself (bounded by the two limits above)
    # The loop waits only for the ranks' copy of their state to host memory; the files are written,
    # fsynced and committed in the background (at most one save in flight). The megatron actor's
    # save blocks either way.
    async_save: bool = True

    def check(self) -> None:
        self._at_least(1, "save_interval", fix="set a positive interval, or null to save only at the end")
        self._at_least(
            2,
            "keep_last",
            fix="keep at least two, so a damaged newest checkpoint still leaves one to resume from",
        )
        self._at_least(0, "max_restarts", fix="set 0 to hold the job at its first requeue")
        self._at_least(1, "max_starts_without_progress")


@dataclass
class SandboxConfig(Section):
    """Where model-written code runs (docs/guides/sandbox.md): the code reward
    (``rlhpc.rewards:code``), the ``python`` and ``bash`` tools (``rlhpc.sandbox:python``,
    ``rlhpc.sandbox:bash``) and your own code through ``rlhpc.sandbox.pool()``. A pool of warm
    sandboxes on the driver's node, each running one execution at a time in a fresh child."""

    SECTION: ClassVar[str] = "sandbox"

    # bwrap: bubblewrap with unprivileged user namespaces (Debian/Ubuntu/RHEL package "bubblewrap");
    # apptainer: "apptainer exec" of sandbox.image (for sites with Apptainer and no user
    # namespaces); subprocess: a plain process with the limits and no isolation at all (trusted code only).
    backend: Literal["bwrap", "apptainer", "subprocess"] = "bwrap"
    image: str | None = None  # apptainer: the image (.sif) the sandboxes run, with a Python 3.6+ inside
    # The interpreter that runs inside (standard library only, plus what binds add). null: python3
    # on the node (/usr/bin/python3), or python3 in the apptainer image. One outside /usr has its
    # prefix (the directory above its bin/) bound read-only.
    python: str | None = None
    binds: list[str] = field(default_factory=list)  # more host paths seen read-only inside (a venv with numpy)
    pool_size: int = 4  # warm sandboxes on the driver's node: executions at once
    wall_s: float = 10.0  # an execution's wall-clock limit; past it the code is killed ("timeout")
    cpu_s: float = 10.0  # CPU seconds per process of the code (RLIMIT_CPU)
    memory_mb: int = 1024  # address space per process of the code (RLIMIT_AS)
    processes: int = 64  # processes and threads of the code at once (RLIMIT_NPROC, in its own user namespace)
    # The private /tmp's size (a tmpfs: memory) and any file's largest size (RLIMIT_FSIZE).
    disk_mb: int = 64
    output_kb: int = 64  # stdout and stderr kept per execution; the rest is cut (and marked truncated)
    # An execution that failed for infrastructure (a sandbox that did not start, died, or was
    # starved by the node) runs again this many times in a fresh sandbox before its sample is
    # masked as failed-for-infrastructure (infra/failed).
    retries: int = 1
    # A time-out is the node's, not the code's, when the code's processes waited for a CPU
    # longer than this share of sandbox.wall_s and ran less than it.
    overload_share: float = 0.5

    def check(self) -> None:
        self._at_least(1, "pool_size", "memory_mb", "processes", "disk_mb", "output_kb")
        self._at_least(0, "retries", fix="set 0 to mask an execution's sample at its first infrastructure failure")
        self._above(0, "wall_s", "cpu_s", fix="give the limit in seconds, e.g. 10")
        if not 0 < self.overload_share < 1:
            self._refuse("overload_share", "must be in (0, 1)", "use e.g. 0.5: half of the wall limit spent waiting")
        if self.backend == "apptainer" and not self.image:
            self._refuse(
                "image",
                "is unset, but sandbox.backend = 'apptainer' runs an image",
                "set sandbox.image to a .sif with python3 (e.g. apptainer build py.sif docker://python:3.12-slim)",
            )
        for i, path in enumerate([*self.binds, *([self.python] if self.python else [])]):
            if not path.startswith("/"):
                where = f"binds[{i}]" if i < len(self.binds) else "python"
                raise ConfigError(f"{self.key(where)} = {path!r} is not an absolute path", "give the full path")


@dataclass
class LoggingConfig(Section):
    SECTION: ClassVar[str] = "logging"

    level: str = "INFO"  # the Python logging level of every process
    # offline: files in RUN_DIR/wandb (wandb sync later); online; disabled
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    wandb_project: str = "rlhpc"  # the wandb project the run logs to
    dump_rollouts: bool = True  # one HDF5 file per rollout id under RUN_DIR/rollouts/

    def check(self) -> None:
        # Every process hands this to logging as it is, so it must be a name logging knows.
        names = logging.getLevelNamesMapping()
        if self.level not in names:
            self._refuse("level", "is not a logging level", f"use one of: {', '.join(names)}")


@dataclass
class Config:
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    reward_model: RewardModelConfig | None = None  # None: no reward model (the rule reward alone)
    teacher: TeacherConfig | None = None  # None: no teacher (algo.distill_coef and kl_target: teacher need one)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)  # where model-written code runs
    seed: int = 1234  # the run's seed: model init, data order, every sample's sampling seed
    # Reruns and resumed runs give bit-identical weights (CPU); every engine honours its requests'
    # seeds (SGLang: --enable-deterministic-inference, slower: docs/architecture/engines.md)
    deterministic: bool = False
    # Who may read the run dir (checkpoints, dumps, logs, keys): "private", this user only (dirs
    # 0700, files 0600), or "group", readable by the user's group too (0750/0640; keys stay 0600).
    run_dir_access: Literal["private", "group"] = "private"


# ---------------------------------------------------------------- loading and typing


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp)).replace("NoneType", "null")


_EXPONENT_FLOAT = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)[eE][-+]?\d+")


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check ``value`` against the annotation ``tp``; return it (ints widen to floats)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except ConfigError as e:
                errors.append(e)
        raise errors[0]
    if origin is Literal:
        _check_literal(value, tp, where)
        return value
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(
                f"{where} must be a list of {len(args)} values, got {value!r}", f"write e.g. {where}: [0.9, 0.999]"
            )
        return tuple(_coerce(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if origin is list:
        (arg,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{where} must be a list, got {value!r}", f"write e.g. {where}: [a, b]")
        return [_coerce(v, arg, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        key_type, arg = typing.get_args(tp)
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a mapping, got {value!r}", f"write e.g. {where}: {{name: {{...}}}}")
        return {_coerce(k, key_type, f"{where} key"): _coerce(v, arg, f"{where}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, where)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str) and _EXPONENT_FLOAT.fullmatch(value.strip()):
        return float(value)  # YAML 1.1 (PyYAML) reads 1e-4 as a string; every user means the number
    if tp in (int, float, str, bool) and (type(value) is not tp):
        raise ConfigError(
            f"{where} must be {_type_name(tp)}, got {type(value).__name__} {value!r}",
            f"fix the value of {where} in the config file or --set",
        )
    return value


def _build(cls: type, data: Any, where: str) -> Any:
    """Type-check ``data`` against the dataclass ``cls`` and construct it (which runs its checks)."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{where or 'the config'} must be a mapping, got {type(data).__name__}", "check the YAML indentation"
        )
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else str(key)
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            fix = _foreign_hint(path, value) or (  # verl's or slime's name for one of ours
                f"did you mean {where + '.' if where else ''}{close[0]}?"
                if close
                else f"valid keys: {', '.join(names)}"
            )
            raise ConfigError(f"unknown config key {path!r}", fix)
        kwargs[key] = _coerce(value, hints[key], path)
    obj = cls.__new__(cls)
    obj._where = where  # before __init__: its checks name the key where it was read
    obj.__init__(**kwargs)
    return obj


def _foreign_hint(path: str, value: Any) -> str | None:
    """What rlhpc calls the unknown key ``path`` if it is verl's or slime's: by its own name, or
    (a section of verl's written out, ``actor_rollout_ref: {rollout: {n: 8}}``) by the keys under it."""
    leaves = [path]
    if isinstance(value, dict):
        leaves = []
        stack = [(path, value)]
        while stack:
            where, node = stack.pop(0)
            for k, v in node.items():
                if isinstance(v, dict):
                    stack.append((f"{where}.{k}", v))
                else:
                    leaves.append(f"{where}.{k}")
    hints = [h for leaf in leaves if (h := foreign_keys.hint(leaf, section=False))]
    if hints:
        return " ".join(dict.fromkeys(hints))
    return foreign_keys.hint(path)


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for p in parents:
        if node.get(p) is None:  # absent, or `tiny:` left empty in the YAML (= all defaults)
            node[p] = {}
        node = node[p]
        if not isinstance(node, dict):
            raise ConfigError(
                f"--set {dotted}: {p!r} is a value, not a section", "set the value itself, e.g. --set seed=1"
            )
    node[leaf] = value


def parse_override(text: str) -> tuple[str, Any]:
    """``"rollout.temperature=0.7"`` -> ``("rollout.temperature", 0.7)``; values are YAML."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise ConfigError(f"--set {text!r} is not KEY=VALUE", "write e.g. --set rollout.num_rollout=20")
    try:
        return key.strip(), yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(
            f"--set {text!r}: the value is not valid YAML ({e})", "quote it, e.g. --set 'data.reward=\"mod:fn\"'"
        ) from e


def _read_tree(p: Path) -> dict:
    """The YAML mapping in config file ``p``; every way it can be unreadable is a ConfigError."""
    if p.is_dir():
        raise ConfigError(f"config file {p} is a directory", "pass a YAML file to --config (see jobs/configs/)")
    if not p.is_file():
        raise ConfigError(
            f"config file {p} does not exist", "pass an existing YAML file to --config (see jobs/configs/)"
        )
    try:
        text = p.read_bytes().decode("utf-8")
    except OSError as e:
        raise ConfigError(f"config file {p} cannot be read: {e}", "check its permissions") from e
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"config file {p} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start})",
            "save it as UTF-8 YAML",
        ) from e
    try:
        tree = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {p} is not valid YAML: {e}", "fix the syntax at the line shown") from e
    if tree is None:
        return {}
    if not isinstance(tree, dict):
        raise ConfigError(
            f"config file {p} holds {'a list' if isinstance(tree, list) else 'a single value'}, "
            "not a mapping of sections",
            "write sections like `rollout:` with their keys indented below (see jobs/configs/)",
        )
    return tree


def load_tree(path: str | Path | None = None, overrides: list[str] = ()) -> dict:
    """Read YAML (optional) and apply ``--set`` overrides: the plain tree, not yet typed."""
    tree: dict = {} if path is None else _read_tree(Path(path))
    for item in overrides:
        key, value = parse_override(item)
        _set_dotted(tree, key, value)
    return tree


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Read YAML (optional), apply ``--set`` overrides, type-check and validate (the config's own
    rules: ``rlhpc.preflight.load_config`` adds the checks that need code)."""
    return config_from_dict(load_tree(path, overrides))


def config_to_dict(cfg: Config) -> dict:
    def plain(x: Any) -> Any:
        if isinstance(x, tuple):
            return list(x)
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        return x

    return plain(dataclasses.asdict(cfg))


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)


def build_config(tree: dict) -> Config:
    """Type the tree and check each section's own values; the rules across sections come after."""
    return _build(Config, tree, "")


def config_from_dict(tree: dict) -> Config:
    cfg = build_config(tree)
    validate(cfg)
    return cfg


# ---------------------------------------------------------------- rules across sections


def _sections(obj: Any) -> typing.Iterator[Section]:
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, Section):
            yield value
            yield from _sections(value)


def validate(cfg: Config) -> None:
    """The rules that need nothing but the config (and the files it names): every section's own
    rules (again, in case fields were assigned after construction), then the rules that read several
    sections. ``rlhpc.preflight.check`` runs these steps and, between them, the checks that need the
    code a config names (its reward, environment, judge, layout and memory plan). Each error names the
    key and the fix."""
    check_sections(cfg)
    resolve_defaults(cfg)
    place_groups(cfg)
    check_groups(cfg)
    check_model(cfg)
    check_data(cfg)
    check_chat_template(cfg)
    check_overlong(cfg)
    check_run(cfg)
    check_parallelism(cfg)


def check_sections(cfg: Config) -> None:
    for section in _sections(cfg):
        section.__post_init__()


def resolve_defaults(cfg: Config) -> None:
    """Defaults that depend on another section, resolved once here (written to the run dir's
    config.yaml as values, so a resume keeps them)."""
    if cfg.algo.tis is None:
        cfg.algo.tis = cfg.rollout.quantization is not None


def place_groups(cfg: Config) -> None:
    """Resolve an open split of the GPUs once, here, with the actor's TP size: it is written to the
    run dir's config.yaml as numbers, so a resume gets exactly the layout of the first start."""
    c = cfg.cluster
    tp = cfg.actor.megatron.tensor_model_parallel_size if cfg.actor.backend == "megatron" else 1
    reserved = frozen_gpus(cfg)
    actor, rollout = c.split(tp, reserved)
    if reserved and not c.heterogeneous and actor < 1:
        groups = [f"{s.SECTION}.num_gpus = {s.num_gpus}" for s in (cfg.reward_model, cfg.teacher) if s is not None]
        raise ConfigError(
            f"the job has {c.total_gpus} GPUs (cluster.num_nodes={c.num_nodes} x cluster.gpus_per_node="
            f"{c.gpus_per_node}): after {' and '.join(groups)} and {rollout} rollout GPUs "
            "none is left for the actor",
            f"ask for more nodes/GPUs, or lower {' / '.join(g.split(' ')[0] for g in groups)} / cluster.rollout_num_gpus",
        )
    c.actor_num_gpus, c.rollout_num_gpus = actor, rollout
    c.__post_init__()


def check_groups(cfg: Config) -> None:
    """The frozen groups (reward model, teacher) fit beside the actor and the engines."""
    if cfg.reward_model is not None:
        check_reward_model(cfg, cfg.reward_model)
    elif cfg.cluster.reward_nodes is not None:
        raise ConfigError(
            "cluster.reward_nodes is set but there is no reward_model: the reward component would sit idle",
            "add a reward_model section (docs/guides/reward-models.md), or drop cluster.reward_nodes (--reward-nodes)",
        )
    check_teacher(cfg)


def check_model(cfg: Config) -> None:
    m = cfg.model
    if m.path is not None and m.tiny is not None:  # e.g. --set model.path=... on a config with model.tiny
        raise ConfigError(
            f"model.path ({m.path}) and model.tiny are both set: the policy is one or the other",
            "drop model.tiny, on the command line with --set model.tiny=null beside --set model.path=... "
            "(the default config, jobs/configs/embedded.yaml, builds a tiny model: model.tiny)",
        )
    if m.path is None and m.tiny is None:
        raise ConfigError(
            "neither model.path nor model.tiny is set",
            "point model.path at an HF model directory, or use model.tiny for a random toy model",
        )
    if m.path is not None and not (Path(m.path) / "config.json").is_file():
        raise ConfigError(
            f"model.path {m.path} has no config.json",
            "point model.path at a Hugging Face model directory (config.json + safetensors)",
        )


def data_files(cfg: Config) -> list[tuple[str, str, str, str]]:
    """(key, file, prompt key, label key) of every data file the run reads."""
    d = cfg.data
    files = [("data.train_file", d.train_file, d.prompt_key, d.label_key)] if d.train_file is not None else []
    for name, s in cfg.eval.resolved_sets(d, cfg.rollout).items():
        if s.file is not None:
            key = "data.eval_file" if not cfg.eval.sets else f"eval.sets.{name}.file"
            files.append((key, s.file, s.prompt_key, s.label_key))
    return files


def check_data(cfg: Config) -> None:
    d = cfg.data
    if cfg.eval.sets and d.eval_file is not None:
        raise ConfigError(
            "data.eval_file and eval.sets are both set: with eval.sets only the named sets are evaluated",
            f"move data.eval_file into eval.sets (e.g. eval.sets.{DEFAULT_EVAL_SET}.file: {d.eval_file}) "
            "or unset eval.sets",
        )


def check_chat_template(cfg: Config) -> None:
    d = cfg.data
    if d.chat_template not in ("auto", "none") and not Path(d.chat_template).is_file():
        raise ConfigError(
            f"data.chat_template {d.chat_template} is neither auto, none, nor an existing file",
            "use auto (the tokenizer's template), none, or the path of a Jinja template",
        )


def check_overlong(cfg: Config, env: str | None = None) -> None:
    """The overlong penalty starts within a reply, and only where a reply's limit bounds a sample.
    ``env``: the run's environment where a multi-turn data.task brings its own (rlhpc.preflight
    knows it); without it this checks rollout.env, generate_fn and agent alone."""
    r, a = cfg.rollout, cfg.algo
    if a.overlong_buffer > r.max_new_tokens:
        raise ConfigError(
            f"algo.overlong_buffer = {a.overlong_buffer} > rollout.max_new_tokens = {r.max_new_tokens}: the "
            "penalty would start before the first token",
            "set algo.overlong_buffer to at most rollout.max_new_tokens (DAPO: a fifth of it, e.g. 4096 of 20480)",
        )
    if a.overlong_buffer and (r.env or env or r.generate_fn is not None or r.agent is not None):
        raise ConfigError(
            "algo.overlong_buffer with multi-turn episodes: an episode's length is not bounded by "
            "rollout.max_new_tokens (a turn's limit) alone",
            "set algo.overlong_buffer=0 (rollout.overlong_filter works with episodes: it masks cut ones)",
        )


def check_run(cfg: Config) -> None:
    """Rules between the algorithm, the rollout and the layout."""
    c, r, a = cfg.cluster, cfg.rollout, cfg.algo
    if r.partial_rollout and cfg.deterministic:
        raise ConfigError(
            "rollout.partial_rollout = true with deterministic = true: a weight push lands in the middle of a "
            "generation at a moment that depends on timing, so which tokens get which weights (and the results) "
            "would differ between reruns and on resume",
            "set rollout.partial_rollout=false (the fixed-lag async pipeline is reproducible), or deterministic=false",
        )
    if a.advantage_estimator in ("rloo", "reinforce_plus_plus_baseline") and r.n_samples_per_prompt < 2:
        raise ConfigError(
            f"algo.advantage_estimator = {a.advantage_estimator!r} needs rollout.n_samples_per_prompt >= 2 "
            "(its baseline is the other samples of the same prompt)",
            "sample at least 2 responses per prompt",
        )
    if r.rollout_batch_size * r.n_samples_per_prompt < c.actor_num_gpus:
        raise ConfigError(
            f"a rollout has {r.rollout_batch_size * r.n_samples_per_prompt} samples, fewer than the {c.actor_num_gpus} actor ranks",
            "raise rollout.rollout_batch_size or lower cluster.actor_num_gpus",
        )
    if c.colocate and c.rollout_num_gpus > c.gpus_per_node:
        # the engines take the actor's first GPUs, and actor rank 0 alone pushes to them
        raise ConfigError(
            f"cluster.colocate with cluster.rollout_num_gpus = {c.rollout_num_gpus} over nodes of "
            f"cluster.gpus_per_node = {c.gpus_per_node}: the engines would span nodes, and a colocated push hands "
            "each engine a CUDA IPC (on CPU, shared-memory) handle of actor rank 0's buffer, which no other node "
            "can open",
            "keep the colocated engines on one node (cluster.rollout_num_gpus <= cluster.gpus_per_node), or drop "
            "cluster.colocate: a disaggregated push broadcasts to engines on every node",
        )
    if r.quantization is not None:
        check_quantization(cfg)
    if r.max_staleness > 0 and (c.colocate or c.offload):
        key = "cluster.colocate" if c.colocate else "cluster.offload"
        why = (
            "the engines and the actor share the same GPUs, so generation cannot run while the actor trains"
            if c.colocate
            else "offload frees the engines' memory while the actor trains, which is when generation runs ahead"
        )
        raise ConfigError(
            f"rollout.max_staleness = {r.max_staleness} (asynchronous generation) with {key} = true: {why}",
            f"set rollout.max_staleness=0 for the synchronous loop, or {key}=false "
            "(a disaggregated layout: separate actor and rollout GPUs)",
        )


def check_quantization(cfg: Config) -> None:
    """FP8 rollout with what it cannot work with (the model itself is checked in preflight,
    ``check_fp8``, where it is read)."""
    lora = cfg.actor.lora
    if lora is not None and lora.push == "adapter":
        raise ConfigError(
            "rollout.quantization: fp8 with actor.lora.push: adapter: the engines would serve an adapter over "
            "FP8 base weights, which rlhpc does not build (its CPU engine's adapters wrap full-precision layers)",
            "set actor.lora.push: merged (the merged weights are pushed in FP8), or drop rollout.quantization",
        )


def check_parallelism(cfg: Config) -> None:
    """The actor's and the engines' parallel sizes divide the model and the GPUs; every request fits
    the model's context."""
    if cfg.actor.backend == "megatron":
        _check_megatron(cfg)
    _check_engine_tp(cfg)
    _check_context(cfg)


def frozen_gpus(cfg: Config) -> int:
    """GPUs of the frozen groups (the reward model's, the teacher's) taken off the total first: not
    the reward model's when it has a component of its own (cluster.reward_nodes)."""
    reward = cfg.reward_model if cfg.cluster.reward_nodes is None else None
    return sum(s.num_gpus for s in (reward, cfg.teacher) if s is not None)


def check_reward_model(cfg: Config, rm: RewardModelConfig) -> None:
    """The reward group fits the allocation beside the others (or its own component), each engine
    within a node (``rlhpc.cluster.layout.check_homes`` places them), with a model."""
    c = cfg.cluster
    if c.heterogeneous and c.reward_nodes is None:
        raise ConfigError(
            "reward_model with cluster.rollout_nodes but no cluster.reward_nodes: in a heterogeneous job the "
            "reward engines need a component of their own",
            "set cluster.reward_nodes (--reward-nodes N, with --reward-partition), or drop cluster.rollout_nodes: "
            "the reward engines then take GPUs of the one allocation",
        )
    if c.reward_nodes is not None:
        have, per_node = c.reward_nodes * c.reward_node_gpus, c.reward_node_gpus
        where = "cluster.reward_nodes x cluster.reward_gpus_per_node"
        if rm.num_gpus > have:
            raise ConfigError(
                f"reward_model.num_gpus = {rm.num_gpus} but its component has {have} GPUs ({where} = "
                f"{c.reward_nodes} x {per_node})",
                "ask for more reward nodes/GPUs (--reward-nodes, --reward-gpus-per-node), or lower reward_model.num_gpus",
            )
    else:
        per_node, where = c.gpus_per_node, "cluster.gpus_per_node"
        if c.used_gpus(frozen_gpus(cfg)) > c.total_gpus:
            raise ConfigError(
                f"the layout needs {c.used_gpus(frozen_gpus(cfg))} GPUs (actor {c.actor_num_gpus} + rollout "
                f"{c.rollout_num_gpus}{', colocated' if c.colocate else ''} + reward model {rm.num_gpus}) but the "
                f"job has {c.total_gpus} (cluster.num_nodes={c.num_nodes} x cluster.gpus_per_node={c.gpus_per_node})",
                "ask for more nodes/GPUs, or shrink cluster.actor_num_gpus / cluster.rollout_num_gpus / "
                "reward_model.num_gpus",
            )
    if rm.gpus_per_engine > per_node:
        raise ConfigError(
            f"reward_model.gpus_per_engine = {rm.gpus_per_engine} > {where.split(' x ')[-1]} = {per_node}: "
            "a reward engine over several nodes is not supported",
            "keep each reward engine on one node (gpus_per_engine <= GPUs per node)",
        )
    if rm.path is not None and not (Path(rm.path) / "config.json").is_file():
        model = "*ForSequenceClassification" if rm.kind == "classifier" else "chat model (*ForCausalLM)"
        raise ConfigError(
            f"reward_model.path {rm.path} has no config.json",
            f"point reward_model.path at a Hugging Face {model} directory",
        )


def check_teacher(cfg: Config) -> None:
    """A teacher when the loss reads one and only then; its group fits beside the others, each engine
    within a node (``rlhpc.cluster.layout.check_homes`` places them), with a model."""
    t, a, c = cfg.teacher, cfg.algo, cfg.cluster
    if t is None:
        if a.needs_teacher:
            key = "algo.distill_coef" if a.distill_coef > 0 else "algo.kl_target"
            raise ConfigError(
                f"{key} = {getattr(a, key.split('.')[1])!r} reads a teacher's logprobs, but there is no teacher section",
                "add teacher.path (an HF causal LM with the policy's tokenizer) or teacher.tiny",
            )
        return
    if not a.needs_teacher:
        raise ConfigError(
            "the teacher section is set but nothing uses it (algo.distill_coef = 0, no KL penalty to the teacher)",
            "set algo.distill_coef > 0 (on-policy distillation) or algo.kl_coef > 0 with algo.kl_target: teacher, "
            "or drop the teacher section",
        )
    if c.heterogeneous:
        raise ConfigError(
            "teacher with cluster.rollout_nodes: in a heterogeneous job only the reward model has a component "
            "of its own (cluster.reward_nodes), a teacher has none",
            "drop cluster.rollout_nodes: the teacher engines then take GPUs of the one allocation",
        )
    if c.used_gpus(frozen_gpus(cfg)) > c.total_gpus:
        raise ConfigError(
            f"the layout needs {c.used_gpus(frozen_gpus(cfg))} GPUs (actor {c.actor_num_gpus} + rollout "
            f"{c.rollout_num_gpus} + frozen groups {frozen_gpus(cfg)}) but the job has {c.total_gpus}",
            "ask for more nodes/GPUs, or shrink cluster.actor_num_gpus / cluster.rollout_num_gpus / teacher.num_gpus",
        )
    if t.gpus_per_engine > c.gpus_per_node:
        raise ConfigError(
            f"teacher.gpus_per_engine = {t.gpus_per_engine} > cluster.gpus_per_node = {c.gpus_per_node}: "
            "a teacher engine over several nodes is not supported",
            "keep each teacher engine on one node (gpus_per_engine <= gpus_per_node)",
        )
    if t.path is not None and not (Path(t.path) / "config.json").is_file():
        raise ConfigError(
            f"teacher.path {t.path} has no config.json",
            "point teacher.path at a Hugging Face causal LM directory with the policy's tokenizer",
        )


def context_len(cfg: Config) -> int | None:
    """The model's context length (``max_position_embeddings``), or None if unreadable."""
    if cfg.model.tiny is not None:
        return cfg.model.tiny.max_position_embeddings
    try:
        return int(json.loads((Path(cfg.model.path) / "config.json").read_text())["max_position_embeddings"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _check_context(cfg: Config) -> None:
    """Every request fits the model's context, as SGLang requires (prompt + max_new_tokens), so
    no rollout is refused by the engines halfway through a run."""
    context = context_len(cfg)
    if context is None:
        return
    prompt = cfg.data.max_prompt_tokens or 1
    for key, new in (
        ("rollout.max_new_tokens", cfg.rollout.max_new_tokens),
        ("eval.max_new_tokens", cfg.eval.max_new_tokens),
        *((f"eval.sets.{name}.max_new_tokens", s.max_new_tokens) for name, s in cfg.eval.sets.items()),
    ):
        if new is not None and prompt + new > context:
            with_prompt = f" + data.max_prompt_tokens = {prompt}" if cfg.data.max_prompt_tokens else " + a prompt token"
            raise ConfigError(
                f"{key} = {new}{with_prompt} exceeds the model's context length of {context} tokens: "
                "the engines would refuse every request",
                f"set {key} to at most {context - prompt}"
                + (" or lower data.max_prompt_tokens" if cfg.data.max_prompt_tokens else "")
                + ", or use a model with a longer context",
            )


def _model_shape(cfg: Config) -> tuple[int, int, int] | None:
    """(attention heads, kv heads, ffn size) of the configured model, or None if unreadable."""
    if cfg.model.tiny is not None:
        t = cfg.model.tiny
        return t.num_attention_heads, t.num_key_value_heads, t.intermediate_size
    try:
        hf = json.loads((Path(cfg.model.path) / "config.json").read_text())
        heads = hf["num_attention_heads"]
        return heads, hf.get("num_key_value_heads") or heads, hf["intermediate_size"]
    except (OSError, ValueError, KeyError):
        return None


def _model_layers(cfg: Config) -> int | None:
    """The configured model's decoder layers, or None if unreadable."""
    if cfg.model.tiny is not None:
        return cfg.model.tiny.num_hidden_layers
    try:
        return int(json.loads((Path(cfg.model.path) / "config.json").read_text())["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _check_engine_tp(cfg: Config) -> None:
    """An SGLang engine's TP divides the model's attention heads (SGLang's own rule)."""
    shape, tp = _model_shape(cfg), cfg.cluster.rollout_gpus_per_engine
    if cfg.rollout.backend == "sglang" and shape is not None and shape[0] % tp:
        raise ConfigError(
            f"cluster.rollout_gpus_per_engine = {tp} (each engine's TP) does not divide the model's "
            f"{shape[0]} attention heads",
            f"give each engine a number of GPUs that divides {shape[0]}",
        )


def _check_megatron(cfg: Config) -> None:
    """What the megatron actor cannot do yet, then its parallel sizes against the GPUs and the model."""
    _check_megatron_algo(cfg)
    _check_megatron_sizes(cfg)


def _check_megatron_algo(cfg: Config) -> None:
    pp = cfg.actor.megatron.pipeline_model_parallel_size
    if cfg.algo.ref_update_interval:
        raise ConfigError(
            f"algo.ref_update_interval = {cfg.algo.ref_update_interval} with actor.backend = megatron: the megatron "
            "actor cannot reset its reference model yet (nor save a reset one in its distributed checkpoint)",
            "use actor.backend: torch for reference resetting, or algo.ref_update_interval: 0 "
            "(the reference stays the initial model)",
        )
    if pp > 1 and cfg.algo.kl_in_reward:
        raise ConfigError(
            f"algo.kl_in_reward with actor.megatron.pipeline_model_parallel_size = {pp}: the per-sample KL is "
            "measured outside the pipeline schedule, which only the one-stage actor runs",
            "use pipeline_model_parallel_size: 1 (TP/EP/DP instead), or algo.kl_in_reward: false (the KL in the loss)",
        )


def _check_megatron_sizes(cfg: Config) -> None:
    c, tp = cfg.cluster, cfg.actor.megatron.tensor_model_parallel_size
    pp = cfg.actor.megatron.pipeline_model_parallel_size
    if c.actor_num_gpus % tp:
        raise ConfigError(
            f"actor.megatron.tensor_model_parallel_size = {tp} does not divide cluster.actor_num_gpus = {c.actor_num_gpus}",
            "make the actor GPUs a multiple of the TP size (data parallel = actor GPUs / (TP x PP))",
        )
    if c.actor_num_gpus % (tp * pp):
        raise ConfigError(
            f"actor.megatron.tensor_model_parallel_size x pipeline_model_parallel_size = {tp} x {pp} does not "
            f"divide cluster.actor_num_gpus = {c.actor_num_gpus}",
            "make the actor GPUs a multiple of TP x PP (data parallel = actor GPUs / (TP x PP))",
        )
    layers = _model_layers(cfg)
    if layers is not None and layers % pp:
        raise ConfigError(
            f"actor.megatron.pipeline_model_parallel_size = {pp} does not divide the model's {layers} layers",
            "choose a pipeline size that divides the layers (each stage holds layers / PP of them)",
        )
    vp = cfg.actor.megatron.virtual_pipeline_model_parallel_size
    if vp is not None and layers is not None and layers % (pp * vp):
        raise ConfigError(
            f"actor.megatron.pipeline_model_parallel_size x virtual_pipeline_model_parallel_size = {pp} x {vp} "
            f"does not divide the model's {layers} layers",
            "choose PP x VP that divides the layers (each chunk holds layers / (PP x VP) of them), "
            "or virtual_pipeline_model_parallel_size: null",
        )
    ep = cfg.actor.megatron.expert_model_parallel_size
    dp = c.actor_num_gpus // (tp * pp)
    if dp % ep:
        raise ConfigError(
            f"actor.megatron.expert_model_parallel_size = {ep} does not divide the data-parallel size "
            f"{dp} (cluster.actor_num_gpus / (TP x PP))",
            "choose an EP size that divides actor GPUs / (TP x PP), or 1",
        )
    if tp > c.gpus_per_node:
        raise ConfigError(
            f"actor.megatron.tensor_model_parallel_size = {tp} > cluster.gpus_per_node = {c.gpus_per_node}: "
            "tensor parallelism across nodes",
            "keep TP within a node (TP <= gpus_per_node); scale across nodes with data parallelism",
        )
    shape = _model_shape(cfg)
    if shape is not None:
        heads, kv_heads, ffn = shape
        if heads % tp or kv_heads % tp or ffn % tp:
            raise ConfigError(
                f"actor.megatron.tensor_model_parallel_size = {tp} does not divide the model's attention heads "
                f"({heads}), key/value heads ({kv_heads}) or FFN size ({ffn})",
                "choose a TP size that divides all three",
            )
