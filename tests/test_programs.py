"""The programs a run is built from (gspo_jax/programs.py): the StepConfig the train step is
built with resolves the loss and its hyperparameters once; the rollout's and the greedy
evaluation's sampler configurations."""

import argparse

from gspo_jax import config as C
from gspo_jax import losses, programs, step
from gspo_jax.models.config import tiny_moe
from gspo_jax.programs import step_config


def test_step_config_binds_the_loss_and_its_hyperparameters_once():
  """`programs.step_config` resolves the loss by name with the config's hyperparameters over
  the loss's defaults, the KL term only with kl_coef > 0, dynamic sampling's kept groups."""
  base = C.TrainConfig(loss=C.LossConfig(name="grpo", eps_high=0.3, kl_coef=0.1),
                       rollout=C.RolloutConfig(prompts_per_iter=4, group_size=2, oversample=2),
                       num_minibatches=2)
  sc = step_config(base)
  assert sc.loss.func is losses.grpo_loss
  assert sc.loss.keywords == {"eps_low": 0.2, "eps_high": 0.3,
                              "aggregation": "seq-mean-token-mean"}
  assert sc.kl == step.KLTerm(0.1, "k3", "seq-mean-token-mean")
  assert sc.keep_groups == 4 and sc.num_minibatches == 2
  plain = step_config(C.TrainConfig())
  assert plain.kl is None and plain.keep_groups == 0 and plain.loss.func is losses.gspo_loss


def test_sampler_configs_of_the_rollout_and_the_greedy_evaluation():
  """The rollout samples G responses with cfg.rollout's filters and the tokenizer's ids;
  evaluation takes one greedy response, unfiltered, uncompacted; under rollout replay only
  the rollout records its experts."""
  tok = argparse.Namespace(eos_id=1, pad_id=0, vocab_size=32)
  cfg = C.TrainConfig(rollout=C.RolloutConfig(group_size=4, max_new_tokens=6, max_prompt_len=5,
                                              temperature=0.7, top_p=0.9, top_k=5))
  rollout, greedy = programs.sampler_configs(tok, cfg)
  assert (rollout.group_size, rollout.max_new_tokens, rollout.max_prompt_len) == (4, 6, 5)
  assert (rollout.eos_id, rollout.pad_id, rollout.vocab_limit) == (1, 0, 32)
  assert (rollout.temperature, rollout.top_p, rollout.top_k, rollout.greedy) == (0.7, 0.9, 5, False)
  assert (greedy.group_size, greedy.greedy, greedy.temperature, greedy.top_p, greedy.top_k,
          greedy.compact_rows) == (1, True, 1.0, 1.0, 0, 0)
  assert greedy.max_new_tokens == 6 and not rollout.record_experts and not greedy.record_experts
  replay = C.TrainConfig(model=tiny_moe(), routing="rollout_replay")
  rollout, greedy = programs.sampler_configs(tok, replay)
  assert rollout.record_experts and not greedy.record_experts
