"""The train step's seams (gspo_jax/step.py): the minibatch split is a tree map over every
Batch field (none is dropped, each is taken with its own rows), a Batch field added in one
place reaches the minibatch loss split by rows on an 8-device mesh, and the StepConfig the
programs are built with resolves the loss and its hyperparameters once."""

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from gspo_jax import config as C
from gspo_jax import losses, sharding, step
from gspo_jax.programs import step_config

B, G, T, PL, S, K = 4, 2, 3, 5, 8, 2   # prompts, group, response, prompt len, MoE positions, top-k
ROWS = ("data", "fsdp")


def row_ids_batch(cls=step.Batch, **extra) -> step.Batch:
  """A batch whose every field spells its row: response (b, g) holds 10*b + g in each of
  its entries (prompt fields hold 10*b), so a split can be checked field by field."""
  row_BxG = 10.0 * np.arange(B)[:, None] + np.arange(G)[None, :]
  per_token = np.broadcast_to(row_BxG[..., None], (B, G, T)).astype(np.float32)
  flat = np.broadcast_to(row_BxG.reshape(B * G, 1, 1), (B * G, S, K)).astype(np.int32)
  return cls(
      prompts_BxP=jnp.asarray(np.broadcast_to(10 * np.arange(B)[:, None], (B, PL)), jnp.int32),
      prompt_lens_B=jnp.asarray(10 * np.arange(B), jnp.int32),
      tokens_BxGxT=jnp.asarray(per_token, jnp.int32), mask_BxGxT=jnp.asarray(per_token),
      old_logp_BxGxT=jnp.asarray(per_token), ref_logp_BxGxT=jnp.asarray(per_token),
      old_experts=(jnp.asarray(flat), jnp.asarray(flat)),
      sampler_logp_BxGxT=jnp.asarray(per_token), turn_BxGxT=jnp.asarray(per_token, jnp.int32),
      **extra)


def cfg(**kw) -> step.StepConfig:
  return step.StepConfig(loss=losses.gspo_loss, **{"num_minibatches": 2, **kw})


@pytest.mark.parametrize("share_prompts", [False, True])
def test_every_batch_field_is_split_with_its_rows(share_prompts):
  """No field is dropped (turn_BxGxT was, when the split listed fields by hand), and every
  entry of every minibatch belongs to the row the tokens say: the prompt fields to its
  prompt, per-response fields and advantages to its response, the flat (B*G, ...) expert
  choices to theirs."""
  batch = row_ids_batch()
  adv_BxG = batch.old_logp_BxGxT[..., 0] + 0.5
  mb = step.split_minibatches(jax.random.key(1), batch, adv_BxG, cfg(share_prompts=share_prompts),
                              weights_BxGxT=batch.old_logp_BxGxT + 0.25)
  rows = mb.rows
  for f in dataclasses.fields(step.Batch):
    assert getattr(rows, f.name) is not None, f.name
  tokens = np.asarray(rows.tokens_BxGxT)                  # (M, b, g, T)
  row = tokens[..., 0]                                     # (M, b, g): 10*prompt + response
  assert sorted(row.ravel()) == sorted((10 * np.arange(B)[:, None] + np.arange(G)).ravel())
  for name in ("mask_BxGxT", "old_logp_BxGxT", "ref_logp_BxGxT", "sampler_logp_BxGxT",
               "turn_BxGxT"):
    np.testing.assert_array_equal(np.asarray(getattr(rows, name)), tokens, err_msg=name)
  np.testing.assert_array_equal(np.asarray(mb.adv_bxg), row + 0.5)
  np.testing.assert_array_equal(np.asarray(mb.token_weights_bxgxT), tokens + 0.25)
  prompt = np.asarray(rows.prompts_BxP)                    # (M, b, P)
  np.testing.assert_array_equal(prompt[..., 0], row[..., 0] // 10 * 10)
  np.testing.assert_array_equal(np.asarray(rows.prompt_lens_B), row[..., 0] // 10 * 10)
  for experts in rows.old_experts:                         # (M, b*g, S, K), row-major
    np.testing.assert_array_equal(np.asarray(experts)[:, :, 0, 0], row.reshape(2, -1))
  if share_prompts:  # whole groups: each minibatch row holds one prompt's G responses
    assert row.shape[-1] == G and (row[..., 1] == row[..., 0] + 1).all()
  else:
    assert row.shape[-1] == 1


@flax.struct.dataclass
class ToyBatch(step.Batch):
  """A feature's batch field, added in one place: a per-response bonus (B, G)."""
  bonus_BxG: jax.Array | None = None


def test_a_new_batch_field_reaches_the_minibatch_loss_split_by_rows():
  """The worked example of docs/adding_a_feature.md: `ToyBatch` adds one field; the update's
  batch sharding (`sharding.rows`, a prefix of any Batch) takes it as it is, the split
  hands each minibatch its rows of it, sharded over the batch mesh axes, and a loss reads
  it there. Its per-minibatch sums equal the sums of the rows the minibatch order picked."""
  mesh = sharding.make_mesh(sharding.MeshConfig(data=2, fsdp=2, tensor=2))
  bonus = np.arange(B * G, dtype=np.float32).reshape(B, G) + 1.0
  batch = row_ids_batch(ToyBatch, bonus_BxG=jnp.asarray(bonus))
  adv = jnp.zeros((B, G))
  config = cfg()
  key = jax.random.key(7)

  def scan_minibatches(batch, adv):
    mbs = step.split_minibatches(key, batch, adv, config, mesh)

    def minibatch_loss(carry, mb):   # a loss that reads the new field
      return carry, (jnp.sum(mb.rows.bonus_BxG), mb.rows.bonus_BxG)
    return jax.lax.scan(minibatch_loss, 0.0, mbs)[1], mbs.rows.bonus_BxG

  program = jax.jit(scan_minibatches, in_shardings=(sharding.rows(mesh), sharding.rows(mesh)))
  (sums, seen), split = program(batch, adv)
  order = np.asarray(step.minibatch_order(key, B * G, 1))   # the rows, as the split drew them
  want = bonus.reshape(-1)[order].reshape(2, -1)
  np.testing.assert_array_equal(np.asarray(sums), want.sum(-1))
  np.testing.assert_array_equal(np.asarray(seen)[..., 0], want)
  assert split.sharding.is_equivalent_to(NamedSharding(mesh, P(None, ROWS, None)), 3), \
      split.sharding


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


def test_a_reference_without_a_kl_term_is_an_error():
  """pi_ref's log-probs in a minibatch with no KL term configured would be silently ignored:
  the step refuses it instead."""
  batch = row_ids_batch().replace(old_experts=None)
  mb = step.Minibatch(batch, jnp.zeros((B, G)))
  with pytest.raises(ValueError, match="StepConfig.kl"):
    jax.eval_shape(lambda mb: step.minibatch_loss(None, None, mb, cfg()), mb)
