"""Expert parallelism (`mesh.expert`) on 8 simulated devices: the sampler, the prepared batch
(pi_old's log-probs and expert choices) and one full update equal the single-device run on
expert-only, data x expert and fsdp x expert meshes; Routing Replay and R3 equal their
single-device runs; the compiled update moves tokens (all-gather / reduce-scatter over the
expert axis) and never all-reduces expert activations; bad meshes are refused by name."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from gspo_jax import config as C
from gspo_jax.models.config import tiny, tiny_moe
from gspo_jax.parallel import sharding
from gspo_jax.plan import hlo as plan_hlo
from gspo_jax.train import run as R
from gspo_jax.train.collect import rollout_step
from tests import adam_bounds
from tests.helpers import host, random_rewards_BxG

MESHES = {"expert4": sharding.MeshConfig(data=1, expert=4, num_devices=4),
          "data2_expert4": sharding.MeshConfig(data=2, expert=4),
          "fsdp2_expert4": sharding.MeshConfig(data=1, fsdp=2, expert=4)}


def moe_cfg(mesh: sharding.MeshConfig, routing: str = "track") -> C.TrainConfig:
  """8 experts, top-2, two MoE layers; 8 prompts x 4 = 32 rows in 2 minibatches. `track`
  records pi_old's expert choices and reports how many changed (`routing_changed`)."""
  return C.TrainConfig(
      model=tiny_moe(vocab_size=24, hidden=32, num_heads=2, num_kv_heads=2, head_dim=16,
                     num_experts=8, experts_per_token=2, moe_mlp_dim=16),
      rollout=C.RolloutConfig(prompts_per_iter=8, group_size=4, max_new_tokens=4,
                              max_prompt_len=8),
      sft=C.SFTConfig(steps=0), optim=C.OptimConfig(learning_rate=1e-2), num_minibatches=2,
      eval_size=8, routing=routing, mesh=mesh)


def one_step(run):
  """Rollout -> prepare -> update, with fixed random rewards (an untrained model earns 0)."""
  r = rollout_step(run, run.state.params, run.state.key, 0)
  rewards = sharding.feed(random_rewards_BxG(*r.rewards_BxG.shape), run.layout.mesh,
                          r.rewards_BxG.shape[0])
  state, metrics = run.programs.update(jax.tree.map(jnp.copy, run.state), r.batch, rewards)
  return r.batch, state, metrics


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp("expert"))


@pytest.fixture(scope="module")
def reference(run_dir):
  run = R.setup(moe_cfg(sharding.MeshConfig(num_devices=1)), run_dir)
  return run, one_step(run)


def assert_step_equal(got, want, cfg):
  """The prepared batch and one update (loss, metrics, parameters, Adam's moments)."""
  (batch, state, metrics), (ref_batch, ref_state, ref_metrics) = got, want
  # The sampler: identical tokens, log-probs within float32; pi_old the same.
  np.testing.assert_array_equal(host(batch.tokens_BxGxT), host(ref_batch.tokens_BxGxT))
  for name in ("sampler_logp_BxGxT", "old_logp_BxGxT", "mask_BxGxT"):
    if getattr(ref_batch, name, None) is not None:
      np.testing.assert_allclose(host(getattr(batch, name)), host(getattr(ref_batch, name)),
                                 atol=2e-5, err_msg=name)
  for got_e, want_e in zip(batch.old_experts, ref_batch.old_experts):
    np.testing.assert_array_equal(host(got_e), host(want_e))
  for k in ("loss", "grad_norm", "ratio_max", "routing_changed", "clip_frac_token"):
    if k in ref_metrics:
      assert float(metrics[k]) == pytest.approx(float(ref_metrics[k]), rel=1e-5, abs=1e-6), k
  adam_bounds.assert_steps_close([host(x) for x in jax.tree.leaves(state.params)],
                                 [host(x) for x in jax.tree.leaves(ref_state.params)],
                                 cfg.optim.learning_rate, steps=cfg.num_minibatches,
                                 rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_train_step_and_sampler_equal_single_device(reference, run_dir, mesh_name):
  ref_run, want = reference
  run = R.setup(moe_cfg(MESHES[mesh_name]), run_dir)
  mesh = run.layout.mesh
  assert mesh.shape["expert"] == 4
  got = one_step(run)
  assert_step_equal(got, want, run.cfg)
  assert 0 < float(got[2]["routing_changed"]) < 1   # the metric is live, not trivially 0
  # Experts split by expert (4 ways, 2 each), their width by fsdp; the rest ZeRO over both.
  layer = got[1].params["layers"][0]
  gate = layer["mlp"]["gate"][...]
  fsdp = mesh.shape["fsdp"]
  assert gate.sharding.spec == (P("expert", "fsdp", None) if fsdp > 1 else P("expert", None, None))
  assert {s.data.shape for s in gate.addressable_shards} == {(2, 32 // fsdp, 16)}
  q = layer["attn"]["q"][...]
  assert q.sharding.spec[0] == (("fsdp", "expert") if fsdp > 1 else "expert")
  assert got[0].tokens_BxGxT.sharding.spec[0] == sharding.batch_axes(mesh)


@pytest.mark.parametrize("routing", ["replay", "rollout_replay"])
def test_routing_replay_equals_single_device(reference, run_dir, routing):
  ref_run = reference[0]
  single = ref_run.reconfigure(dataclasses.replace(ref_run.cfg, routing=routing))
  want = one_step(single)
  run = R.setup(moe_cfg(MESHES["fsdp2_expert4"], routing), run_dir)
  assert_step_equal(one_step(run), want, run.cfg)


@pytest.mark.parametrize("dispatch", ["ragged", "dense"])
def test_moe_layer_values_gradients_and_balancing_loss_equal_one_device(dispatch):
  """One MoE layer (8 experts, top-2) on data=2 x fsdp=2 x expert=2, traced on the mesh: the
  output, the chosen experts, the load-balancing loss and every gradient (router included)
  equal one device's; a token with an out-of-range replayed expert is NaN on its own row
  only, as on one device."""
  from gspo_jax.models.moe import MoE
  cfg = tiny_moe(hidden=32, num_experts=8, experts_per_token=2, moe_mlp_dim=16,
                 moe_dispatch=dispatch)
  graphdef, state = nnx.split(MoE(cfg, rngs=nnx.Rngs(0)))
  x = jax.random.normal(jax.random.key(1), (4, 6, 32))
  replay = jax.random.randint(jax.random.key(2), (4, 6, 2), 0, 8).at[1, 2, 0].set(8)

  def loss(state, x, replay):
    y, idx, aux = nnx.merge(graphdef, state)(x, replay_BxSxK=replay)
    return jnp.sum(jnp.where(jnp.isfinite(y), y, 0.0) ** 2) + aux, (y, idx, aux)

  grads = jax.jit(jax.grad(loss, has_aux=True))
  want_g, (want_y, want_idx, want_aux) = grads(state, x, None)
  want_replayed = jax.jit(loss)(state, x, replay)[1][0]
  mesh = sharding.make_mesh(sharding.MeshConfig(data=2, fsdp=2, expert=2))
  placed = jax.device_put(state, sharding.param_shardings(state, mesh))
  on_mesh = sharding.on_mesh(lambda *a: jax.grad(loss, has_aux=True)(*a), mesh)
  got_g, (got_y, got_idx, got_aux) = jax.jit(on_mesh)(placed, x, None)
  np.testing.assert_array_equal(host(got_idx), host(want_idx))
  np.testing.assert_allclose(host(got_y), host(want_y), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(float(got_aux), float(want_aux), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)):
    np.testing.assert_allclose(host(a), host(b), rtol=1e-4, atol=1e-5)
  got_replayed = jax.jit(sharding.on_mesh(loss, mesh))(placed, x, replay)[1][0]
  bad = ~np.isfinite(host(got_replayed)).all(-1)
  np.testing.assert_array_equal(bad, ~np.isfinite(host(want_replayed)).all(-1))
  assert bad.sum() == 1 and bad[1, 2]
  np.testing.assert_allclose(host(got_replayed)[~bad], host(want_replayed)[~bad], rtol=1e-5,
                             atol=1e-6)


def _update_hlo(run) -> str:
  from gspo_jax.plan import planner as plan
  args = plan.program_inputs(run.cfg, run.layout, run.programs)["update"]
  return run.programs.update.lower(*args).compile().as_text()


def test_update_moves_tokens_not_expert_activations(run_dir):
  """The update's HLO on data=2 x expert=4: per MoE layer and minibatch, the tokens of an
  expert group are all-gathered over the expert axis (4 chips) and their outputs
  reduce-scattered back; no all-reduce is as large as the routed tokens' activations
  (the expert group's a = 4 * n_l * K rows x D), which is what experts split by their width
  all-reduce."""
  run = R.setup(moe_cfg(MESHES["data2_expert4"]), run_dir)
  cfg, hlo = run.cfg, _update_hlo(run)
  D, K = cfg.model.hidden, cfg.model.experts_per_token
  rows = cfg.rollout.prompts_per_iter * cfg.rollout.group_size // cfg.num_minibatches
  tokens_per_chip = rows // 8 * (cfg.rollout.max_prompt_len + cfg.rollout.max_new_tokens)
  routed = 4 * tokens_per_chip * K * D * 4          # bytes of the group's routed activations
  for shape in re.findall(r"= (\S+) all-reduce(?:-start)?\(", hlo):
    assert plan_hlo._shape_bytes(shape) < routed, shape
  gathered = rf"f32\[{4 * tokens_per_chip},{D}\]"
  assert re.search(rf"= {gathered}\S* all-gather(-start)?\(", hlo), "tokens all-gathered"
  assert re.search(rf"= f32\[{tokens_per_chip},{D}\]\S* reduce-scatter(-start)?\(", hlo)
  counts = plan_hlo.static_counts(hlo)
  assert counts["all-gather"] > 0 and counts["reduce-scatter"] > 0


def test_bad_expert_meshes_are_named_before_any_work(run_dir, tmp_path):
  cfg = moe_cfg(sharding.MeshConfig(num_devices=1))
  with pytest.raises(ValueError, match=r"mesh.expert = 4 needs a Mixture-of-Experts"):
    dataclasses.replace(cfg, model=tiny(vocab_size=24), mesh=MESHES["expert4"], routing="free")
  with pytest.raises(ValueError, match=r"mesh.expert = 3 does not divide model.num_experts = 8"):
    dataclasses.replace(cfg, mesh=sharding.MeshConfig(data=1, expert=3, num_devices=3))
  with pytest.raises(ValueError, match=r"mesh.expert = 2 with mesh.tensor = 2 is not supported"):
    dataclasses.replace(cfg, mesh=sharding.MeshConfig(data=2, expert=2, tensor=2))
  with pytest.raises(ValueError, match=r"mesh.expert must be"):
    dataclasses.replace(cfg, mesh=sharding.MeshConfig(data=1, expert=0))
  # 8 experts over 8 chips of which expert takes 8 and data 2: more chips than there are.
  bad = dataclasses.replace(cfg, mesh=sharding.MeshConfig(data=2, expert=8))
  with pytest.raises(ValueError, match=r"mesh.data \* mesh.fsdp \* mesh.expert \* mesh.tensor"):
    R.setup(bad, str(tmp_path))
  assert not list(tmp_path.iterdir())   # nothing written


def test_30b_a3b_structure_at_toy_width_matches_the_reference_expert_parallel_and_scanned(
    tmp_path, monkeypatch):
  """Qwen3-30B-A3B's layer structure (every layer MoE, 128 experts, top-8 renormalised,
  GQA 8:1 with head_dim != hidden / heads, q/k norms, untied) at width 32, written as a
  Hugging Face checkpoint: our logits equal the fixtures' independent numpy forward
  (tests/data/hf_fixtures/numpy_reference.py, the executable spec of transformers' math),
  and the same checkpoint loaded scanned, with experts split data=2 x expert=4 (jitted on
  the mesh: the expert-parallel dispatch), equals the unrolled single-device model."""
  import importlib.util
  import json
  import os
  import sys
  import types

  from gspo_jax.models import hf, safetensors_io, transformer
  from gspo_jax.models.config import qwen3_30b_a3b
  from tests.helpers import FIXTURES, logits
  # The reference imports the safetensors package only to read files, which our own reader
  # does here: a stand-in keeps that package out of the test requirements.
  monkeypatch.setitem(sys.modules, "safetensors", types.SimpleNamespace(safe_open=None))
  spec = importlib.util.spec_from_file_location(
      "numpy_reference", os.path.join(FIXTURES, "numpy_reference.py"))
  reference = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(reference)

  cfg = qwen3_30b_a3b(vocab_size=64, hidden=32, num_layers=2, num_heads=8, num_kv_heads=1,
                      head_dim=16, mlp_dim=48, moe_mlp_dim=8, dtype="float32",
                      tie_embeddings=False, rope_theta=1e4)
  assert cfg.num_experts == 128 and cfg.experts_per_token == 8 and cfg.num_moe_layers == 2
  hf.save(transformer.create(cfg, seed=5), str(tmp_path))
  ids = np.asarray(jax.random.randint(jax.random.key(0), (8, 7), 0, 64))
  hf_cfg = json.load(open(tmp_path / "config.json"))
  ckpt = safetensors_io.Checkpoint(str(tmp_path))
  weights = {name: np.asarray(ckpt.tensor(name), np.float64) for name in ckpt.names()}
  want = reference.forward(hf_cfg, weights, ids)
  unrolled = logits(hf.load(str(tmp_path)), ids)
  np.testing.assert_allclose(unrolled, want, atol=1e-4, rtol=0)

  mesh = sharding.make_mesh(MESHES["data2_expert4"])
  scanned = hf.load(str(tmp_path), mesh=mesh, scan_layers=True)
  assert scanned.layers.mlp.gate[...].sharding.spec == P(None, "expert", None, None)
  graphdef, state = nnx.split(scanned)

  def forward(state, ids):
    model = nnx.merge(graphdef, state)
    pos = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
    return model.logits(model(ids, pos).hidden_BxSxD)

  program = jax.jit(sharding.on_mesh(forward, mesh),
                    in_shardings=(sharding.param_shardings(state, mesh),
                                  sharding.batch_sharding(mesh)))
  hlo = program.lower(state, ids).compile().as_text()
  assert re.search(r"all-gather(-start)?\(", hlo) and re.search(r"reduce-scatter(-start)?\(", hlo)
  np.testing.assert_allclose(host(program(state, ids)), unrolled, atol=1e-5, rtol=0)
