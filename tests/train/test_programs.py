"""The programs a run is built from (gspo_jax/train/programs.py): the StepConfig the train step is
built with resolves the loss and its hyperparameters once; the rollout's and the greedy
evaluation's sampler configurations."""

import argparse

from gspo_jax import config as C
from gspo_jax.models.config import tiny, tiny_moe
from gspo_jax.objectives import losses
from gspo_jax.train import programs, step
from gspo_jax.train.programs import step_config


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


def _compiled_update_hlo(cfg) -> str:
  """The run's update program compiled on the simulated CPU devices, from abstract inputs."""
  from flax import nnx

  from gspo_jax.models.transformer import Transformer
  from gspo_jax.parallel import sharding
  from gspo_jax.plan import planner as plan
  from gspo_jax.train import optim
  mesh = sharding.make_mesh(cfg.mesh)
  graphdef, params = nnx.split(nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0))),
                               nnx.Param)
  tx = optim.make_optimizer(cfg.optim)
  layout = programs.make_layout(params, tx, mesh, None)
  progs = programs.make_programs(graphdef, tx, cfg, layout,
                                 plan._ShapeTokenizer(cfg.model.vocab_size))
  return progs.update.lower(*plan.program_inputs(cfg, layout, progs)["update"]).compile().as_text()


def test_the_update_keeps_activations_split_by_rows_on_8_devices():
  """FSDP over 8 simulated devices: no all-reduce in the compiled update carries a
  minibatch's activations (a result with its R = 16 rows x S = 24 positions, or R*S = 384
  tokens): each device computes its own rows with gathered weights, and only weights'
  gradients are reduced. Without the row constraints (`sharding.constrain` in the model)
  the residual stream took the embedding's (vocab, embed->fsdp) layout and the attention
  and MLP partial sums of every token were all-reduced in each layer."""
  import re

  from gspo_jax.parallel import sharding
  cfg = C.TrainConfig(
      model=tiny(vocab_size=64, hidden=64, mlp_dim=128, num_heads=2, num_kv_heads=2,
                 head_dim=16, num_layers=2, scan_layers=True),
      rollout=C.RolloutConfig(prompts_per_iter=8, group_size=4, max_new_tokens=16,
                              max_prompt_len=8),
      sft=C.SFTConfig(steps=0), num_minibatches=2, mesh=sharding.MeshConfig(data=1, fsdp=8))
  hlo = _compiled_update_hlo(cfg)
  reduced = [tuple(int(d) for d in dims.split(",") if d)
             for dims in re.findall(r"= \w+\[([\d,]*)\]\S* all-reduce\(", hlo)]
  assert reduced, "expected the weights' gradients to be reduced"
  R, S = 16, 24
  tokens = [dims for dims in reduced if R * S in dims or (R in dims and S in dims)]
  assert not tokens, f"activation-sized all-reduces {tokens} in the update"
