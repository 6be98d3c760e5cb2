"""An int8 frozen base (`lora.base_dtype = "int8"`, gspo_jax/lora/quant.py): each dense
weight within half a quantisation step of the float one; the run's log-probs within a
stated tolerance of the float base's; at init the adapted policy is the dequantised base
exactly; gradients reach only the adapters (the int8 arrays bit-identical after updates);
the stored base is smaller; resume restores it exactly; the planner plans it; bad values
are refused by name."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gspo_jax import config as C
from gspo_jax.lora import adapters as lora
from gspo_jax.lora import export as lora_export
from gspo_jax.lora import quant as lora_quant
from gspo_jax.parallel import sharding
from gspo_jax.train import run as R
from gspo_jax.train import step
from gspo_jax.train.collect import rollout_step
from tests.helpers import TINY_MODEL, host, leaves, tiny_cfg
from tests.lora.test_lora import (
  LORA,
  adapted_logprobs,
  assert_resume_is_exact,
  one_update,
  plain_logprobs,
  sharded_cfg,
  train_steps,
  trained_run,
)

INT8 = dataclasses.replace(LORA, base_dtype="int8")


def int8_cfg(**kw):
  return tiny_cfg(**{"lora": INT8, "sft": C.SFTConfig(steps=0),
                     "loss": C.LossConfig(kl_coef=0.1), **kw})


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp("lora_int8"))


@pytest.fixture(scope="module")
def runs(run_dir):
  """(the int8 run, the same run on the float base): same seed, same initial model."""
  q = R.setup(int8_cfg(), run_dir)
  f = R.setup(int8_cfg(lora=LORA), run_dir)
  return q, f


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_each_weight_is_within_half_a_step_of_the_float_one(scan):
  from gspo_jax.models.transformer import Transformer
  model = Transformer(dataclasses.replace(TINY_MODEL, scan_layers=scan), rngs=nnx.Rngs(0))
  params = nnx.state(model, nnx.Param)
  dense = lora.dense_weights(params)
  assert len(dense) == 7 * (1 if scan else TINY_MODEL.num_layers)
  # One output channel of zeros: scale 0, q 0, dequantised 0 (no division by zero).
  first = next(iter(dense))
  zeroed = dict(nnx.to_flat_state(params))
  zeroed[first] = zeroed[first].replace(zeroed[first].get_value().at[..., 0].set(0.0))
  params = nnx.from_flat_state(zeroed)
  q = lora_quant.quantize(params, dense)
  flat_q, flat_w = dict(nnx.to_flat_state(q)), dict(nnx.to_flat_state(params))
  back = dict(nnx.to_flat_state(lora_quant.dequantize(q)))
  assert set(back) == set(flat_w)
  for path, n_in in dense.items():
    w, qv = host(flat_w[path].get_value()), host(flat_q[(*path, lora_quant.QUANT)].get_value())
    s = host(flat_q[(*path, lora_quant.SCALE)].get_value())
    lead = int(scan)
    assert qv.dtype == np.int8 and qv.shape == w.shape and np.abs(qv).max() == 127
    assert s.shape == w.shape[:lead] + w.shape[lead + n_in:]
    step_ = lora_quant._expand(s, w.ndim, lead)
    err = np.abs(host(back[path].get_value()) - w)
    assert np.all(err <= step_ / 2 * (1 + 1e-6) + 1e-12), path
    assert flat_q[(*path, lora_quant.QUANT)].get_metadata()["logical_axes"] == \
        flat_w[path].get_metadata()["logical_axes"]
  assert not np.any(host(back[first].get_value())[..., 0])
  for path in set(flat_w) - set(dense):  # embeddings, norms, the head: untouched
    np.testing.assert_array_equal(host(back[path].get_value()), host(flat_w[path].get_value()))


def test_the_int8_runs_logprobs_are_near_the_float_base_and_exact_to_its_own_base(runs):
  q, f = runs
  r = rollout_step(q, q.state.params, q.state.key, 0)
  mask = host(r.batch.mask_BxGxT).astype(bool)
  # At init (B = 0): the adapted policy is the dequantised base, bit for bit (pi_old = pi_ref).
  ours = adapted_logprobs(q, r.batch, q.state.params)
  np.testing.assert_array_equal(ours, plain_logprobs(q, r.batch, q.frozen.weights()))
  np.testing.assert_array_equal(host(r.batch.ref_logp_BxGxT)[mask],
                                host(r.batch.old_logp_BxGxT)[mask])
  # Against the float base: measured 0.066 (max) / 0.018 (mean) nats on this model; the
  # tolerance is about twice that. A wrong scale axis or a lost scale moves them by nats.
  diff = np.abs(ours - plain_logprobs(f, r.batch, f.frozen.params))[mask]
  assert diff.max() < 0.15 and diff.mean() < 0.04, (diff.max(), diff.mean())


def test_only_the_adapters_are_trained_and_the_base_is_stored_in_int8(runs):
  q, f = runs
  base_before = leaves(q.frozen.params)
  metrics = train_steps(q, 2)
  for a, b in zip(leaves(q.frozen.params), base_before):
    np.testing.assert_array_equal(a, b)  # int8 values and scales, bit for bit
  assert float(metrics["kl"]) > 0 and float(metrics["skipped_updates"]) == 0
  # Parameter bytes: 1 byte per dense weight entry + 4 per output channel, against 4.
  dense = lora.dense_weights(f.frozen.params)
  flat = dict(nnx.to_flat_state(f.frozen.params))
  n_dense = sum(flat[p].get_value().size for p in dense)
  n_rest = sum(v.get_value().size for p, v in flat.items() if p not in dense)
  scales = sum(v.get_value().size for p, v in nnx.to_flat_state(q.frozen.params)
               if p[-1] == lora_quant.SCALE)
  assert lora.num_bytes(f.frozen.params) == 4 * (n_dense + n_rest)
  assert lora.num_bytes(q.frozen.params) == n_dense + 4 * (n_rest + scales)
  assert lora.num_bytes(q.state.params) == lora.num_bytes(f.state.params)  # same adapters
  # The merged export is the dequantised base plus the adapters' product.
  merged = lora_export.merged_params(q)
  r = rollout_step(q, q.state.params, q.state.key, 5)
  np.testing.assert_allclose(plain_logprobs(q, r.batch, merged),
                             adapted_logprobs(q, r.batch, q.state.params), atol=1e-6)


def test_prepare_and_update_see_the_same_base(runs):
  """The KL reference (prepare) and the KL in the update read the same dequantised base:
  recomputed here from `weights()` through the plain model."""
  q, _ = runs
  if not any(np.any(host(v[...])) for p, v in nnx.to_flat_state(q.state.params)
             if p[-1] == lora.B):
    train_steps(q, 1)
  r = rollout_step(q, q.state.params, q.state.key, 3)
  ref = jax.jit(lambda p: step.policy_logprobs(p, q.graphdef, r.batch, q.programs.step_cfg)[0])
  mask = host(r.batch.mask_BxGxT).astype(bool)
  np.testing.assert_array_equal(host(r.batch.ref_logp_BxGxT)[mask],
                                host(ref(q.frozen.weights()))[mask])
  assert not np.allclose(host(r.batch.ref_logp_BxGxT)[mask],
                         host(r.batch.old_logp_BxGxT)[mask], atol=1e-6)


def test_resume_restores_the_int8_base_exactly(tmp_path_factory, tmp_path):
  cfg = tiny_cfg(iterations=2, lora=INT8, loss=C.LossConfig(kl_coef=0.1),
                 sft=C.SFTConfig(steps=4, batch_size=32, learning_rate=3e-3))
  full = trained_run(tmp_path_factory, "int8_full", cfg, 1)
  resumed = assert_resume_is_exact(cfg, full, tmp_path / "part", 1, 1, refused=(
      (dataclasses.replace(cfg, lora=LORA), "lora.base_dtype"),))
  assert {v[...].dtype for p, v in nnx.to_flat_state(resumed.frozen.params)
          if p[-1] == lora_quant.QUANT} == {jnp.dtype(jnp.int8)}


def test_an_int8_base_on_8_devices_takes_one_devices_first_update(run_dir):
  """fsdp 8: each int8 array sharded as its float weight was (the scales by its output
  axes), and the first update equal to one device's within float32 reduction order."""
  cfg = lambda mesh: dataclasses.replace(sharded_cfg(mesh), lora=INT8)
  one = R.setup(cfg(sharding.MeshConfig(num_devices=1)), run_dir)
  many = R.setup(cfg(sharding.MeshConfig(data=1, fsdp=8)), run_dir)
  (b1, _, m1), (b8, _, m8) = one_update(one), one_update(many)
  for name in ("old_logp_BxGxT", "ref_logp_BxGxT"):
    np.testing.assert_allclose(host(getattr(b8, name)), host(getattr(b1, name)), atol=2e-5)
  for k in ("loss", "grad_norm", "kl"):
    assert float(m8[k]) == pytest.approx(float(m1[k]), rel=1e-5, abs=1e-6), k
  flat = dict(nnx.to_flat_state(many.frozen.params))
  full = dict(nnx.to_flat_state(many.frozen.layout.state.params))
  mesh = many.layout.mesh
  for path in lora.dense_weights(many.frozen.layout.params):
    q, s = flat[(*path, lora_quant.QUANT)][...], flat[(*path, lora_quant.SCALE)]
    assert q.sharding.spec == full[path].get_value().spec
    assert s[...].sharding.spec == sharding.spec_for(s.get_metadata()["logical_axes"],
                                                     s[...].shape, mesh)
  q = flat[("layers", 0, "attn", "q", lora_quant.QUANT)][...]
  assert {sh.data.shape for sh in q.addressable_shards} == {(4, 2, 16)}  # D = 32 split 8 ways


def test_the_planner_counts_the_int8_base():
  from gspo_jax.plan import planner as plan
  only = ("update",)
  f = plan.plan(int8_cfg(lora=LORA), "local", only)["programs"]["update"]
  q = plan.plan(int8_cfg(), "local", only)["programs"]["update"]
  # The update's arguments: the base (int8: about a third of the float bytes here) + state.
  assert q["argument"] < f["argument"] and q["output"] == f["output"]


@pytest.mark.parametrize("lora_kw,match", [
    (dict(rank=4, base_dtype="nf4"), r"lora.base_dtype must be one of \('', 'int8'\).*'nf4'"),
    (dict(rank=4, base_dtype="bfloat16"), r"lora.base_dtype must be one of"),
    (dict(rank=0, base_dtype="int8"), r"lora.base_dtype = 'int8' needs lora.rank > 0"),
])
def test_bad_base_dtypes_are_refused_by_name(lora_kw, match):
  with pytest.raises(ValueError, match=match):
    tiny_cfg(lora=C.LoRAConfig(**lora_kw))

