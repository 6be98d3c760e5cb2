"""The sampler, the old-log-prob phase and one full train step on 8 simulated devices equal
the single-device run (float32 tolerance), on three mesh shapes; every output array carries
the sharding the rules table says; a model too large for one device's share initialises
sharded."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gspo_jax import config as C
from gspo_jax.models import config
from gspo_jax.models.transformer import Transformer
from gspo_jax.parallel import sharding
from gspo_jax.train import programs
from gspo_jax.train import run as R
from gspo_jax.train.collect import rollout_step
from tests import adam_bounds
from tests.helpers import host, random_rewards_BxG, small_cfg

ROWS = ("data", "fsdp")
MESHES = {"data8": sharding.MeshConfig(data=8), "fsdp8": sharding.MeshConfig(data=1, fsdp=8),
          "2x2x2": sharding.MeshConfig(data=2, fsdp=2, tensor=2)}


def one_step(run):
  """Rollout -> prepare (pi_old, pi_ref) -> update (advantages inside)."""
  r = rollout_step(run, run.state.params, run.state.key, 0,
                   ref_params=jax.tree.map(jnp.copy, run.state.params))
  rewards = sharding.feed(random_rewards_BxG(*r.rewards_BxG.shape), run.layout.mesh,
                          r.rewards_BxG.shape[0])
  rollout = sample(run)
  state, metrics = run.programs.update(jax.tree.map(jnp.copy, run.state), r.batch, rewards)
  return rollout, r.batch, state, metrics, r.stats


def sample(run):
  """The run's own sampler program (shardings as the run declares them) on fixed prompts."""
  prompts = np.asarray(jax.random.randint(jax.random.key(3), (8, 8), 3, 20), np.int32)
  lens = np.arange(8, dtype=np.int32) % 7 + 1
  mesh = run.layout.mesh
  sampler = run.programs.make_sampler(programs.sampler_configs(run.tok, run.cfg)[0])
  return sampler(run.state.params, sharding.feed(prompts, mesh, 8), sharding.feed(lens, mesh, 8),
                 jax.random.key(4))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp("sharded"))  # the tokenizer is trained once, then loaded


@pytest.fixture(scope="module")
def reference(run_dir):
  run = R.setup(small_cfg(sharding.MeshConfig(num_devices=1)), run_dir)
  return run, one_step(run)


def assert_trees_close(got, want, rtol=1e-5, atol=1e-6):
  got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
  assert len(got_leaves) == len(want_leaves)
  for a, b in zip(got_leaves, want_leaves):
    np.testing.assert_allclose(host(a), host(b), rtol=rtol, atol=atol)


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_train_step_and_sampler_equal_single_device(reference, run_dir, mesh_name):
  ref_run, (ref_rollout, ref_batch, ref_state, ref_metrics, ref_stats) = reference
  run = R.setup(small_cfg(MESHES[mesh_name]), run_dir)
  mesh = run.layout.mesh
  assert mesh.devices.size == 8
  rollout, batch, state, metrics, stats = one_step(run)

  # Same parameters to start with (sharded initialisation is the same function).
  assert_trees_close(run.state.params, ref_run.state.params, rtol=0, atol=0)
  # Sampler: identical tokens (same keys, threefry is partitionable), log-probs within f32.
  np.testing.assert_array_equal(host(rollout.tokens_BxGxT), host(ref_rollout.tokens_BxGxT))
  np.testing.assert_array_equal(host(rollout.mask_BxGxT), host(ref_rollout.mask_BxGxT))
  np.testing.assert_allclose(host(rollout.logp_BxGxT), host(ref_rollout.logp_BxGxT), atol=2e-5)
  # The rollout phase of training (its own prompts) and the prepared batch.
  np.testing.assert_array_equal(host(batch.tokens_BxGxT), host(ref_batch.tokens_BxGxT))
  for name in ("old_logp_BxGxT", "ref_logp_BxGxT", "mask_BxGxT"):
    np.testing.assert_allclose(host(getattr(batch, name)), host(getattr(ref_batch, name)),
                               atol=2e-5, err_msg=name)
  assert stats["reward_mean"] == ref_stats["reward_mean"]
  # One full update: loss, metrics, parameters and the whole optimiser state (Adam's first
  # moment after one step is (1 - b1) * gradient: the gradients agree too).
  for k in ("loss", "grad_norm", "kl", "clip_frac_token"):
    assert float(metrics[k]) == pytest.approx(float(ref_metrics[k]), rel=1e-5, abs=1e-6), k
  # Adam divides by sqrt(v): where a gradient is tiny, float32 rounding of the sharded
  # reductions moves a step by up to ~2 lr on some CPU; all but 1% of the entries within
  # 1% of lr (1e-3), every one within the steps' reach (adam_bounds).
  adam_bounds.assert_steps_close([host(x) for x in jax.tree.leaves(state.params)],
                                 [host(x) for x in jax.tree.leaves(ref_state.params)],
                                 run.cfg.optim.learning_rate, steps=run.cfg.num_minibatches,
                                 rtol=1e-5, atol=1e-5)
  assert_trees_close(state.opt_state, ref_state.opt_state)
  assert int(state.step) == int(ref_state.step) == 1

  # The arrays really are sharded as the rules say.
  is_var = lambda x: isinstance(x, nnx.Variable)
  for var in jax.tree.leaves(state.params, is_leaf=is_var):
    want = sharding.spec_for(var.get_metadata()["logical_axes"], var[...].shape, mesh)
    assert var[...].sharding.spec == want and var[...].sharding.mesh == mesh
  mu = state.opt_state[1].inner_state[0].mu
  for var, m in zip(jax.tree.leaves(state.params, is_leaf=is_var), jax.tree.leaves(mu, is_leaf=is_var)):
    assert m[...].sharding.spec == var[...].sharding.spec
  for x in (rollout.tokens_BxGxT, rollout.logp_BxGxT, batch.tokens_BxGxT, batch.old_logp_BxGxT,
            batch.prompts_BxP, batch.prompt_lens_B):
    assert x.sharding.is_equivalent_to(NamedSharding(mesh, P(ROWS, *([None] * (x.ndim - 1)))),
                                       x.ndim), x.sharding
  assert all(m.sharding.is_fully_replicated for m in metrics.values())
  if mesh_name == "fsdp8":  # the residual width really is split 8 ways on every device
    q = state.params["layers"][0]["attn"]["q"][...]
    assert q.sharding.spec == P("fsdp", None, None)
    assert {s.data.shape for s in q.addressable_shards} == {(4, 2, 16)}


def test_indivisible_batch_is_a_clear_error(run_dir):
  cfg = dataclasses.replace(small_cfg(MESHES["data8"]),
                            rollout=C.RolloutConfig(prompts_per_iter=4, group_size=4))
  with pytest.raises(ValueError, match=r"rollout.prompts_per_iter = 4 is not divisible"):
    R.setup(cfg, run_dir)
  cfg = dataclasses.replace(small_cfg(MESHES["data8"]), num_minibatches=8)
  with pytest.raises(ValueError, match=r"rows per minibatch .* = 4 is not divisible"):
    R.setup(cfg, run_dir)
  cfg = dataclasses.replace(small_cfg(MESHES["2x2x2"]), model=config.tiny(num_kv_heads=1))
  with pytest.raises(ValueError, match="model.num_kv_heads = 1"):
    R.setup(cfg, run_dir)


def test_model_too_large_for_one_device_initialises_sharded():
  # ~0.56 B parameters = 2.3 GB in float32, in two wide layers (the compile time grows with
  # the number of layers, not with their width). Compiled (not run) for an fsdp=8 mesh: each
  # device's output is one eighth of the model, and its peak (output + the initialiser's
  # random-bit temporaries, themselves sharded: measured 282 + 472 MB) stays far below one
  # full copy: no device ever holds the whole parameter set.
  cfg = config.ModelConfig(vocab_size=64000, hidden=2048, num_layers=2, num_heads=16,
                           num_kv_heads=8, head_dim=128, mlp_dim=22528)
  mesh = sharding.make_mesh(MESHES["fsdp8"])
  _, program = sharding.init_program(Transformer, cfg, mesh)
  total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(
      jax.eval_shape(lambda: nnx.state(Transformer(cfg, rngs=nnx.Rngs(0))))))
  assert total > 2e9
  memory = program.lower().compile().memory_analysis()
  assert memory.output_size_in_bytes == pytest.approx(total / 8, rel=1e-3)
  assert memory.output_size_in_bytes + memory.temp_size_in_bytes < total / 2


def test_bf16_matmul_inputs_sharded_equal_single_device(run_dir):
  """model.matmul_dtype=bfloat16 on a 2x2x2 mesh: the rounding is elementwise, so the
  sharded run differs from one device by float32 summation order only, and by what that
  order does to a bfloat16 rounding downstream (an input moved to its neighbouring bfloat16
  value moves a product by up to 2^-8 relative): log-probs within 5e-3 (such a flip moved
  one by 1.1e-3 on a 2-core AMD EPYC), the metrics within 1e-3, far inside a wrong
  sharding's O(1). One minibatch, so that every metric is taken at theta_old: after an
  Adam step, entries whose gradient sits at that noise may move either way by lr
  (tests/adam_bounds.py), and a second minibatch's metrics would differ by more."""
  bf16 = lambda mesh: dataclasses.replace(small_cfg(mesh), num_minibatches=1,
                                          model=dataclasses.replace(small_cfg(mesh).model,
                                                                    matmul_dtype="bfloat16"))
  ref_run = R.setup(bf16(sharding.MeshConfig(num_devices=1)), run_dir)
  run = R.setup(bf16(MESHES["2x2x2"]), run_dir)
  ref_rollout, _, _, ref_metrics, _ = one_step(ref_run)
  rollout, _, _, metrics, _ = one_step(run)
  np.testing.assert_array_equal(host(rollout.tokens_BxGxT), host(ref_rollout.tokens_BxGxT))
  np.testing.assert_allclose(host(rollout.logp_BxGxT), host(ref_rollout.logp_BxGxT), atol=5e-3)
  for k in ("loss", "grad_norm", "kl", "clip_frac_token"):
    assert float(metrics[k]) == pytest.approx(float(ref_metrics[k]), rel=1e-3, abs=1e-5), k
