"""The configs of a training run: frozen dataclasses, checked when they are built.

A config file is a Python file whose `get_config()` returns a `TrainConfig` (configs/);
`--set dotted.field=value` overrides any field (gspo_jax/utils/configlib.py). Every check here
names the field the user sets (`rollout.temperature`, not the sampler's own name), so a
bad setting stops the run before any work.

Config groups by concern: `task.*` (the problems and their rewards, `tasks.config`),
`loss.*` (the objective and the KL term), `rollout.*`, `optim.*`, `sft.*`, `model.*`,
`mesh.*` and one group per optional feature (`rollout_correction.*`, `multiturn.*`,
`lora.*`, `placement.*`, `asynchronous.*`). A group checks itself; `TrainConfig` checks what
crosses groups. `--set loss=grpo` and `--set task=chain` are aliases of `loss.name` /
`task.name`, `async.max_staleness` of `asynchronous.max_staleness`; the flat
names of earlier versions (`eps_low`, `task_digits`, `data.train_file`, ...) are errors
that name the new field, and a saved config.json that has them loads
(`TrainConfig.migrate`).

Loss hyperparameters left unset (None) take the chosen loss's own defaults from
`losses.LOSS_DEFAULTS`: `--set loss=grpo` alone clips GRPO at 0.2 / 0.27, not at GSPO's
3e-4 / 4e-4. `LossConfig.kwargs()` is what the train step passes to the loss.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from gspo_jax.lora.adapters import LoRAConfig
from gspo_jax.lora.adapters import check_model as check_lora
from gspo_jax.models.config import ModelConfig, tiny
from gspo_jax.objectives import losses
from gspo_jax.objectives.rollout_correction import RolloutCorrectionConfig
from gspo_jax.objectives.row_skip import RowSkipConfig, refusals
from gspo_jax.parallel import expert_mesh, sharding
from gspo_jax.parallel.placement import AsyncConfig, PlacementConfig, is_async
from gspo_jax.parallel.placement import check_config as check_async
from gspo_jax.tasks.config import TaskConfig  # the task group (re-exported here)
from gspo_jax.utils import checks

OLD_LOGP_SOURCES = ("recompute", "sampler")
# MoE routing in the update (paper section 5.3):
#   free:   every forward routes anew (GSPO needs nothing else);
#   track:  record pi_old's expert choices, report `routing_changed` per update (diagnostic);
#   replay: Routing Replay, pi_theta's forward reuses pi_old's recorded expert choices, the
#           workaround GRPO needs on MoE models (R2);
#   rollout_replay: Rollout Routing Replay (R3, arXiv 2510.11370), the sampler records its
#           own expert choices and the pi_old and pi_theta forwards replay those, with the
#           gate renormalised over them from the trainer's router (gspo_jax/models/moe.py).
ROUTING_MODES = ("free", "track", "replay", "rollout_replay")
SAMPLER_DTYPES = ("", "float32", "bfloat16")
# Responses that hit rollout.max_new_tokens without EOS (gspo_jax/rollout/lengths.py says where each
# acts and why):
#   count:    trained on like any other response (the paper's setting);
#   mask:     left out of the loss and of their group's advantage statistics (DAPO's
#             overlong filtering);
#   overlong: DAPO's soft overlong punishment added to every response's reward, falling
#             from 0 at max_new_tokens - overlong_cache tokens to -1 at max_new_tokens.
TRUNCATION_MODES = ("count", "mask", "overlong")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  """The RL update's AdamW (`train.optim.make_optimizer`)."""
  learning_rate: float = 1e-4
  warmup_steps: int = 0
  decay_steps: int = 0              # cosine decay to 10% over this many steps; 0 = constant
  weight_decay: float = 0.0
  grad_clip: float = 1.0            # global-norm clip; 0 = off
  b1: float = 0.9
  b2: float = 0.99

  def __post_init__(self):
    if not self.learning_rate > 0:
      raise ValueError(f"optim.learning_rate must be > 0; got {self.learning_rate}")


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  prompts_per_iter: int = 16        # B
  group_size: int = 8               # G
  max_new_tokens: int = 6           # T
  max_prompt_len: int = 16          # P: prompts are padded to this (static shapes, one compile)
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  # Sample with parameters and activations cast to this dtype ("" = the trainer's): a
  # bfloat16 inference engine next to a float32 trainer (paper section 5.4).
  sampler_dtype: Literal["", "float32", "bfloat16"] = ""
  # DAPO's dynamic sampling (gspo_jax/rollout/dynamic_sampling.py): sample this many prompts more than
  # prompts_per_iter, and train on prompts_per_iter groups, those whose rewards are not
  # all equal first; 0 = off.
  oversample: int = 0
  # Storage dtype of the sampler's KV cache ("" = its compute dtype): "bfloat16" halves the
  # cache, attention still computes in float32 (`SamplerConfig.cache_dtype`).
  kv_cache_dtype: Literal["", "float32", "bfloat16"] = ""
  # Live-row compaction: as responses end, each decode phase continues on the live rows in
  # up to this many halvings of the B*G rows (`SamplerConfig.compact_rows`; the rollout
  # sampler only, not the greedy evaluation). 0 = off.
  compact_rows: int = 0

  def __post_init__(self):
    if isinstance(self.compact_rows, bool) or not isinstance(self.compact_rows, int) \
        or self.compact_rows < 0:
      raise ValueError(f"rollout.compact_rows must be an int >= 0 (halvings of the decode "
                       f"rows; 0 = off); got {self.compact_rows!r}")
    checks.check_choice("config", "rollout.sampler_dtype", self.sampler_dtype, SAMPLER_DTYPES)
    checks.check_choice("config", "rollout.kv_cache_dtype", self.kv_cache_dtype, SAMPLER_DTYPES)
    if isinstance(self.oversample, bool) or not isinstance(self.oversample, int) \
        or self.oversample < 0:
      raise ValueError(f"rollout.oversample must be an int >= 0 (extra prompts sampled per "
                       f"iteration; 0 = off); got {self.oversample!r}")
    if self.prompts_per_iter < 1 or self.group_size < 2:
      raise ValueError("rollout.prompts_per_iter must be >= 1 and rollout.group_size >= 2 "
                       "(group-normalised advantages need 2 responses per prompt)")
    if self.max_new_tokens < 1 or self.max_prompt_len < 1:
      raise ValueError(f"rollout.max_new_tokens ({self.max_new_tokens}) and "
                       f"rollout.max_prompt_len ({self.max_prompt_len}) must be >= 1")
    if not self.temperature > 0:
      raise ValueError(f"rollout.temperature must be > 0; got {self.temperature}")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"rollout.top_p must be in (0, 1]; got {self.top_p}")
    if self.top_k < 0:
      raise ValueError(f"rollout.top_k must be >= 0 (0 = off); got {self.top_k}")
    rows = self.sampled_prompts * self.group_size
    if 2 ** self.compact_rows > rows:
      raise ValueError(f"rollout.compact_rows={self.compact_rows} halves the B*G = {rows} "
                       f"rows of a rollout below one row: use at most "
                       f"{rows.bit_length() - 1} halvings")

  @property
  def sampled_prompts(self) -> int:
    """B_s: prompts sampled (and scored) per iteration, prompts_per_iter + oversample."""
    return self.prompts_per_iter + self.oversample


CREDITS = ("turn", "episode")


@dataclasses.dataclass(frozen=True)
class MultiTurnConfig:
  """Multi-turn episodes with an environment (gspo_jax/multiturn/); off while `env` is "".
  `rollout.max_new_tokens` is then the episode's token budget T, model and observation
  tokens together."""
  env: str = ""                     # an environment spec (multiturn.envs): "calculator", "mod:Name"
  stop_strings: tuple[str, ...] = ("]",)   # end a model turn; each must be one token
  max_obs_tokens: int = 16          # O: the longest observation appended (longer: episode ends)
  max_turns: int = 4                # model turns per episode
  # "turn": each turn's tokens get its group-normalised return (advantages.turn_advantages),
  # for loss=gspo_token or grpo; "episode": the episode reward per sequence, any loss.
  credit: Literal["turn", "episode"] = "turn"

  def __post_init__(self):
    checks.check_choice("config", "multiturn.credit", self.credit, CREDITS)
    for name in ("max_obs_tokens", "max_turns"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"multiturn.{name} must be an int >= 1; got {value!r}")
    if not self.stop_strings or not all(isinstance(x, str) and x for x in self.stop_strings):
      raise ValueError(f"multiturn.stop_strings must be non-empty strings; got "
                       f"{self.stop_strings!r}")

  @property
  def turn_credit(self) -> bool:
    """Per-token advantages from per-turn rewards (the update takes rewards_BxGxK)."""
    return bool(self.env) and self.credit == "turn"


@dataclasses.dataclass(frozen=True)
class SFTConfig:
  """Cold start: supervised steps on task demonstrations before RL (the paper starts RL
  from a cold-start fine-tuned model)."""
  steps: int = 300                  # maximum number of steps
  batch_size: int = 64
  learning_rate: float = 3e-3
  # Stop early once greedy accuracy on a probe of *train-split* problems reaches this
  # (0 = run all steps): RL then starts from comparable partial accuracy for every seed,
  # where a fixed step count lands anywhere on a steep learning curve.
  target_accuracy: float = 0.0

  check_every: int = 20
  probe_size: int = 256


@dataclasses.dataclass(frozen=True)
class LossConfig:
  """The objective: a loss of `losses.LOSSES` by name with its hyperparameters, and the KL
  term to a reference policy (the cold-start policy)."""
  # a key of losses.LOSSES
  name: Literal["gspo", "gspo_token", "grpo", "luspo", "sapo", "sapo_seq", "cispo", "gmpo"] = "gspo"
  # None = the loss's own default (losses.LOSS_DEFAULTS): GSPO 3e-4 / 4e-4, GRPO 0.2 / 0.27.
  # Each applies only to the losses whose LOSS_DEFAULTS entry has it (an error otherwise).
  eps_low: float | None = None
  eps_high: float | None = None
  # GRPO and CISPO: losses.AGGREGATIONS; None = GRPO's seq-mean-token-mean, CISPO's token-mean.
  aggregation: Literal["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"] | None = None
  # SAPO's gate temperatures for positive / other advantages; None = 1.0 / 1.05.
  tau_pos: float | None = None
  tau_neg: float | None = None
  kl_coef: float = 0.0              # loss + kl_coef * KL(pi_theta || pi_ref); 0 = no reference
  kl_estimator: Literal["k1", "k2", "k3"] = "k3"

  def __post_init__(self):
    checks.check_choice("config", "loss.name", self.name, tuple(losses.LOSSES))
    checks.check_choice("config", "loss.kl_estimator", self.kl_estimator,
                         losses.KL_ESTIMATORS)
    if self.aggregation is not None:
      checks.check_choice("config", "loss.aggregation", self.aggregation, losses.AGGREGATIONS)
    for name, value in self._hyperparameters().items():
      if value is not None and name not in losses.LOSS_DEFAULTS[self.name]:
        # Refused, not ignored: e.g. token-mean aggregation would length-weight GSPO.
        takers = "/".join(repr(k) for k, d in losses.LOSS_DEFAULTS.items() if name in d)
        raise ValueError(f"config: loss.{name} applies to loss.name={takers}; loss.name is "
                         f"{self.name!r} (its hyperparameters: "
                         f"{', '.join(losses.LOSS_DEFAULTS[self.name])})")
    for name in ("eps_low", "eps_high", "tau_pos", "tau_neg"):
      value = getattr(self, name)
      if value is not None and not value > 0:
        raise ValueError(f"loss.{name} must be > 0 (or unset for the loss's default); "
                         f"got {value}")
    if self.kl_coef < 0:
      raise ValueError(f"loss.kl_coef must be >= 0; got {self.kl_coef}")

  def kwargs(self) -> dict[str, Any]:
    """Keyword arguments of `losses.LOSSES[self.name]`: the loss's own defaults
    (`losses.LOSS_DEFAULTS`) with what this config sets."""
    kwargs = dict(losses.LOSS_DEFAULTS[self.name])
    kwargs.update({k: v for k, v in self._hyperparameters().items() if v is not None})
    return kwargs

  def _hyperparameters(self) -> dict[str, Any]:
    """The loss hyperparameters a config may set (None = the loss's default)."""
    return {"eps_low": self.eps_low, "eps_high": self.eps_high,
            "aggregation": self.aggregation, "tau_pos": self.tau_pos, "tau_neg": self.tau_neg}

  @property
  def kl_aggregation(self) -> str:
    """The KL term is reduced like the policy loss."""
    return self.kwargs().get("aggregation", "seq-mean-token-mean")


# Fields of earlier versions, flat at the top, and where they live now (a saved config.json
# that has them is moved over once, `TrainConfig.migrate`; `--set` names the new field).
MOVED = {"task_digits": "task.digits", "task_steps": "task.steps", "data": "task.data",
         "reward": "task.reward", "gym": "task.gym",
         **{k: f"loss.{k}" for k in ("eps_low", "eps_high", "aggregation", "tau_pos",
                                     "tau_neg", "kl_coef", "kl_estimator")}}


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  task: TaskConfig = TaskConfig()
  model: ModelConfig = dataclasses.field(default_factory=lambda: tiny(vocab_size=32))
  rollout: RolloutConfig = RolloutConfig()
  optim: OptimConfig = OptimConfig()
  sft: SFTConfig = SFTConfig()
  loss: LossConfig = LossConfig()

  num_minibatches: int = 4
  old_logp: Literal["recompute", "sampler"] = "recompute"  # "sampler": its log-probs are pi_old
  rollout_correction: RolloutCorrectionConfig = RolloutCorrectionConfig()
  multiturn: MultiTurnConfig = MultiTurnConfig()
  # LoRA adapters on a frozen base (gspo_jax/lora/adapters.py, docs/lora.md); rank 0 = off.
  lora: LoRAConfig = LoRAConfig()
  routing: Literal["free", "track", "replay", "rollout_replay"] = "free"  # MoE: ROUTING_MODES
  # Teacher forcing (pi_theta, pi_old, pi_ref) computes each prompt once for its G responses
  # (`teacher_forcing.response_logprobs`); minibatches then hold whole groups.
  share_prompts: bool = False
  truncation: Literal["count", "mask", "overlong"] = "count"   # see TRUNCATION_MODES
  # truncation="overlong" only: DAPO's L_cache in tokens, 0 < overlong_cache <
  # rollout.max_new_tokens (DAPO's recipe: 4096 of 20480, a fifth).
  overlong_cache: int = 0
  # Report the loss's clip fractions per length quartile of rollout.max_new_tokens
  # (clip_frac_{token,seq}_len_q1..q4). Off by default: reading pi_theta's log-probs a
  # second time in the update changes how XLA fuses the loss, and with it the last bits
  # of the update (measured: 1-ulp differences in GRPO's loss on CPU at
  # xla_backend_optimization_level=0), so existing configs would not train bit for bit
  # as before.
  length_clip_metrics: bool = False
  # Skip the backward pass of rows whose gradient is exactly zero (gspo_jax/objectives/row_skip.py):
  # the same update up to float32 summation order; docs/update_speed.md says when it pays.
  row_skip: RowSkipConfig = RowSkipConfig()
  # Time each phase alone: the host waits for the sampler, prepare and the update, so that
  # time_sample, time_prepare and time_update exclude each other (the phases then no longer
  # overlap with the host's scoring and bookkeeping). Off: only time_sample, the sampler's own.
  profile_phases: bool = False
  # Compute prepare's log-probs (pi_old, pi_ref) for this many groups of prompts one after
  # another: a chunks-th of its activations alive at once (the largest program of long
  # runs, `python -m gspo_jax.plan`); the same log-probs up to float rounding.
  prepare_chunks: int = 1
  # The sampler on devices of its own, and up to k policy versions ahead of the trainer
  # (gspo_jax/parallel/placement.py, docs/async.md); the defaults are the synchronous loop.
  placement: PlacementConfig = PlacementConfig()
  asynchronous: AsyncConfig = AsyncConfig()

  iterations: int = 50
  eval_every: int = 10
  eval_size: int = 256
  seed: int = 0
  mesh: sharding.MeshConfig = sharding.MeshConfig()   # default: every device on `data`
  # A Hugging Face model directory (config.json, safetensors, tokenizer) to start from
  # instead of a fresh `model` with a task tokenizer; `model` is then taken from it.
  pretrained: str = ""
  # Parameter (master-weight) dtype of the loaded model; the checkpoint's own dtype stays
  # the compute dtype. float32 by default: an RL step at lr ~1e-6 is below bfloat16's
  # resolution for most weights and would round away (the optimiser's moments follow the
  # parameters' dtype too). "" = as stored.
  pretrained_dtype: str = "float32"

  # `--set NAME=VALUE` for a group's name field (configlib.apply_overrides).
  ALIASES = {"loss": "loss.name", "task": "task.name",
             **{f"async.{f}": f"asynchronous.{f}" for f in ("max_staleness", "pi_old",
                                                            "timeline")}}
  MOVED = MOVED

  def __post_init__(self):
    checks.check_choice("config", "old_logp", self.old_logp, OLD_LOGP_SOURCES)
    checks.check_choice("config", "routing", self.routing, ROUTING_MODES)
    check_truncation(self)
    check_async(self)
    if self.rollout_correction.weights and self.old_logp == "sampler":
      raise ValueError(f"rollout_correction.level={self.rollout_correction.level!r} needs "
                       "old_logp='recompute': with old_logp='sampler' pi_old is the sampler, "
                       "so every weight pi_old / pi_sampler would be exactly 1")
    if not self.pretrained:
      check_routing(self)
      expert_mesh.check_experts(self.mesh, self.model.num_experts)
      check_positions(self.model, self.rollout)
      check_lora(self.lora, self.model)  # a pretrained model is checked once loaded (run.setup)
    sampling_dtype = self.rollout.sampler_dtype or self.model.dtype
    if self.rollout.kv_cache_dtype == "bfloat16" and sampling_dtype == "float64":
      raise ValueError("rollout.kv_cache_dtype='bfloat16' needs a float32 or bfloat16 sampler; "
                       "this one computes in float64 (model.dtype, rollout.sampler_dtype)")
    if (self.rollout.prompts_per_iter * self.rollout.group_size) % self.num_minibatches:
      raise ValueError(f"num_minibatches ({self.num_minibatches}) must divide "
                       "rollout.prompts_per_iter * rollout.group_size")
    if self.share_prompts and self.rollout.prompts_per_iter % self.num_minibatches:
      raise ValueError(f"share_prompts=True keeps groups whole, so num_minibatches "
                       f"({self.num_minibatches}) must divide rollout.prompts_per_iter "
                       f"({self.rollout.prompts_per_iter})")
    if self.model.attention_block and not self.share_prompts:  # it blocks `extend` only
      raise ValueError("model.attention_block needs share_prompts=True (or attention_block=0)")
    self.task.check_widths(self.rollout.max_new_tokens, self.rollout.max_prompt_len)
    if not (isinstance(self.prepare_chunks, int) and self.prepare_chunks >= 1
            and self.rollout.sampled_prompts % self.prepare_chunks == 0):
      raise ValueError(f"prepare_chunks = {self.prepare_chunks!r} must be a positive int that "
                       "divides the prompts sampled per iteration "
                       f"({self.rollout.sampled_prompts})")
    if self.prepare_chunks > 1 and (self.routing != "free" or self.multiturn.env):
      raise ValueError("prepare_chunks > 1 needs routing='free' (expert choices are recorded "
                       "in one pass) and a single-turn task; set prepare_chunks=1")
    check_multiturn(self)
    if self.row_skip.enabled:
      bad = refusals(kl_coef=self.loss.kl_coef,
                     off_policy_threshold=self.rollout_correction.off_policy_threshold)
      if bad:
        raise ValueError(f"row_skip.enabled=True cannot be exact with {'; '.join(bad)}: "
                         "set row_skip.enabled=False")

  @classmethod
  def migrate(cls, d: dict) -> dict:
    """A saved config dict of an earlier version with its flat task and loss fields moved
    into their groups (`MOVED`; `task` and `loss` held the names); any other dict as is."""
    d = dict(d)
    task, loss = d.get("task"), d.get("loss")
    if isinstance(task, str):
      d["task"] = {"name": task}
    if isinstance(loss, str):
      d["loss"] = {"name": loss}
    for old, new in MOVED.items():
      if old in d:
        group, _, field = new.partition(".")
        d.setdefault(group, {})
        d[group] = {**d[group], field: d.pop(old)}
    # pretrained_dtype's default was "" (as stored); without `pretrained` it means nothing,
    # so such a run saved the old default, which is today's.
    if not d.get("pretrained") and d.get("pretrained_dtype") == "":
      d["pretrained_dtype"] = "float32"
    return d


def check_positions(model: ModelConfig, rollout: RolloutConfig) -> None:
  """Prompt + response positions within the model's (`ModelConfig.max_positions`)."""
  need = rollout.max_prompt_len + rollout.max_new_tokens
  if model.max_positions is not None and need > model.max_positions:
    raise ValueError(f"rollout.max_prompt_len + rollout.max_new_tokens = "
                     f"{rollout.max_prompt_len} + {rollout.max_new_tokens} = {need} positions, "
                     f"more than the model's max_positions = {model.max_positions}: lower "
                     f"rollout.max_new_tokens to at most "
                     f"{model.max_positions - rollout.max_prompt_len}")


def check_routing(cfg: TrainConfig) -> None:
  if cfg.routing != "free" and not cfg.model.num_experts:
    raise ValueError(f"routing={cfg.routing!r} needs a Mixture-of-Experts model "
                     "(model.num_experts > 0); a dense model has no routing to track or replay")


def check_truncation(cfg: TrainConfig) -> None:
  checks.check_choice("config", "truncation", cfg.truncation, TRUNCATION_MODES)
  T, cache = cfg.rollout.max_new_tokens, cfg.overlong_cache
  if isinstance(cache, bool) or not isinstance(cache, int):
    raise ValueError(f"overlong_cache must be an int (tokens); got {cache!r}")
  if cfg.truncation != "overlong":
    if cache:
      raise ValueError(f"overlong_cache applies to truncation='overlong'; truncation is "
                       f"{cfg.truncation!r}")
  elif not 0 < cache < T:
    raise ValueError(f"truncation='overlong' needs 0 < overlong_cache < rollout.max_new_tokens "
                     f"({T}): the penalty falls from 0 at max_new_tokens - overlong_cache "
                     f"tokens to -1 at max_new_tokens; got overlong_cache={cache}")


def check_multiturn(cfg: TrainConfig) -> None:
  """Multi-turn episodes with the features they support; the others are refused here."""
  mt = cfg.multiturn
  if not mt.env:
    if mt != MultiTurnConfig():
      raise ValueError("multiturn.* settings apply to multi-turn episodes: set multiturn.env "
                       "(e.g. multiturn.env=calculator)")
    return
  refused = {"rollout.oversample": cfg.rollout.oversample != 0,
             "rollout.sampler_dtype": cfg.rollout.sampler_dtype != "",
             # the episode sampler decodes every row to the end: it never compacts
             "rollout.compact_rows": cfg.rollout.compact_rows != 0,
             "routing='rollout_replay'": cfg.routing == "rollout_replay",
             "lora.rank": cfg.lora.rank != 0,
             # multi-turn episodes run their own loop, not the asynchronous pipeline
             "asynchronous.* / placement.sampler_devices": is_async(cfg)}
  if mt.turn_credit:  # per-token advantages: these read one advantage per sequence
    refused.update({"truncation='mask'/'overlong'": cfg.truncation != "count",
                    "length_clip_metrics": cfg.length_clip_metrics,
                    "rollout_correction.off_policy_threshold":
                        bool(cfg.rollout_correction.off_policy_threshold)})
  bad = [name for name, on in refused.items() if on]
  if bad:
    raise ValueError(f"multiturn.env={mt.env!r} (credit={mt.credit!r}) does not support "
                     f"{', '.join(bad)}")
  if mt.turn_credit and cfg.loss.name not in ("gspo_token", "grpo"):
    raise ValueError(f"multiturn.credit='turn' gives per-token advantages, which "
                     f"loss.name={cfg.loss.name!r} cannot take: use loss.name=gspo_token (or "
                     "grpo), or multiturn.credit='episode' for one advantage per episode")
