"""Mesh construction, the rules table, and sharded initialisation on 8 simulated devices."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from gspo_jax.models import config, transformer
from gspo_jax.models.transformer import Transformer
from gspo_jax.parallel import sharding


@functools.lru_cache(maxsize=None)
def reference(cfg):
  """The single-device model (built once per config, shared by the mesh variants)."""
  return transformer.create(cfg, seed=5)


MESHES = {"data8": sharding.MeshConfig(data=8), "fsdp8": sharding.MeshConfig(data=1, fsdp=8),
          "2x2x2": sharding.MeshConfig(data=2, fsdp=2, tensor=2)}


@pytest.mark.parametrize("cfg,shape", [
    (sharding.MeshConfig(), (8, 1, 1, 1)), (sharding.MeshConfig(data=2, fsdp=-1), (2, 4, 1, 1)),
    (sharding.MeshConfig(data=2, fsdp=2, tensor=2), (2, 2, 1, 2)),
    (sharding.MeshConfig(data=1, fsdp=2, expert=-1), (1, 2, 4, 1))])
def test_mesh_shapes(cfg, shape):
  mesh = sharding.make_mesh(cfg)
  assert tuple(mesh.shape.values()) == shape and mesh.axis_names == sharding.MESH_AXES


@pytest.mark.parametrize("cfg,field", [
    (sharding.MeshConfig(data=3), "mesh.data \\* mesh.fsdp \\* mesh.expert \\* mesh.tensor = 3 must equal the number of devices \\(8\\)"),
    (sharding.MeshConfig(data=-1, fsdp=-1), "at most one may be -1"),
    (sharding.MeshConfig(data=2, fsdp=3, tensor=1), "= 6 must equal"),
    (sharding.MeshConfig(data=0), "must be >= 1"),
    (sharding.MeshConfig(data=-1, fsdp=3), "8 devices do not divide"),
    (sharding.MeshConfig(num_devices=16), "mesh.num_devices = 16 but 8 devices")])
def test_bad_mesh_is_a_clear_error(cfg, field):
  with pytest.raises(ValueError, match=field):
    sharding.make_mesh(cfg)


def test_mesh_over_some_devices():
  mesh = sharding.make_mesh(sharding.MeshConfig(data=2, num_devices=2))
  assert tuple(mesh.shape.values()) == (2, 1, 1, 1) and list(mesh.devices.flat) == jax.devices()[:2]


def test_rules_table_on_a_mesh():
  mesh = sharding.make_mesh(MESHES["2x2x2"])
  assert sharding.spec_for(("embed", "heads", "head_dim"), (64, 4, 32), mesh) == P("fsdp", "tensor", None)
  assert sharding.spec_for(("vocab", "embed"), (64, 64), mesh) == P("tensor", "fsdp")
  # A mesh axis is used once per spec: the later dimension stays replicated.
  assert sharding.spec_for(("heads", "kv_heads"), (4, 4), mesh) == P("tensor", None)
  assert sharding.spec_for(("embed", None), (64, 3), mesh) == P("fsdp", None)
  assert sharding.batch_sharding(mesh).spec == P(("data", "fsdp", "expert"), None)
  assert sharding.batch_sharding(mesh, 3).spec == P(("data", "fsdp", "expert"), None, None)


def test_rules_errors_name_the_config_field():
  mesh = sharding.make_mesh(MESHES["2x2x2"])
  with pytest.raises(ValueError, match=r"model.num_kv_heads = 1 is not divisible by mesh axis mesh.tensor=2"):
    sharding.spec_for(("embed", "kv_heads", "head_dim"), (64, 1, 32), mesh)
  with pytest.raises(ValueError, match=r"model.hidden = 5 .*mesh.fsdp=2"):
    sharding.spec_for(("embed",), (5,), mesh)
  with pytest.raises(ValueError, match="unknown logical axis 'embd'"):
    sharding.spec_for(("embd",), (64,), mesh)
  with pytest.raises(ValueError, match=r"rollout.prompts_per_iter = 6 is not divisible .* = 4"):
    sharding.check_rows("rollout.prompts_per_iter", 6, mesh)
  with pytest.raises(ValueError, match="model.num_kv_heads"):
    sharding.init_sharded(Transformer, config.tiny(num_kv_heads=1), mesh)


@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("cfg", [config.tiny(), config.tiny_moe()], ids=["dense", "moe"])
def test_sharded_init_and_forward_equal_single_device(mesh_name, cfg):
  mesh = sharding.make_mesh(MESHES[mesh_name])
  model = sharding.init_sharded(Transformer, cfg, mesh, seed=5)
  ref = reference(cfg)
  is_var = lambda x: isinstance(x, nnx.Variable)
  got = jax.tree.leaves(nnx.state(model), is_leaf=is_var)
  want = jax.tree.leaves(nnx.state(ref), is_leaf=is_var)
  for var, ref_var in zip(got, want):
    np.testing.assert_array_equal(var[...], ref_var[...])
    spec = sharding.spec_for(var.get_metadata()["logical_axes"], var[...].shape, mesh)
    assert var[...].sharding.spec == spec
  q = model.layers[0].attn.q[...]
  if mesh_name == "2x2x2":
    assert q.sharding.spec == P("fsdp", "tensor", None)
    assert len({s.data.shape for s in q.addressable_shards}) == 1
    assert q.addressable_shards[0].data.shape == (32, 2, 32)  # really split, not replicated
  rows = sharding.batch_sharding(mesh)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (8, 6)), jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(6), (8, 6))
  fwd = nnx.jit(lambda m, t, p: m(t, p).hidden_BxSxD)
  out = fwd(model, jax.device_put(tokens, rows), jax.device_put(pos, rows))
  np.testing.assert_allclose(out, fwd(ref, tokens, pos), rtol=1e-5, atol=1e-5)


def fake_mesh(data, fsdp, tensor, expert=1):
  """A mesh of the given shape without devices (a pod slice's layout, checked on a laptop)."""
  return jax.sharding.AbstractMesh((data, fsdp, expert, tensor), sharding.MESH_AXES)


def test_rules_on_fake_pod_meshes_need_no_devices():
  # The README's v5p suggestion for Qwen3-30B-A3B (data=2, fsdp=16, tensor=2 = 64 chips).
  mesh = fake_mesh(2, 16, 2)
  assert sharding.spec_for(("vocab", "embed"), (151936, 2048), mesh) == P("tensor", "fsdp")
  assert sharding.spec_for(("expert", "embed", "mlp"), (128, 2048, 768), mesh) == P(None, "fsdp", "tensor")
  assert sharding.spec_for(("embed", "expert"), (2048, 128), mesh) == P("fsdp", None)
  assert sharding.spec_for(("heads", "head_dim", "embed"), (32, 128, 2048), mesh) == P("tensor", None, "fsdp")
  abstract = nnx.state(nnx.eval_shape(lambda: Transformer(config.qwen3_30b_a3b(num_layers=2),
                                                          rngs=nnx.Rngs(0))))
  shardings = sharding.param_shardings(abstract, mesh)
  specs = {jax.tree_util.keystr(path): s.spec for path, s in jax.tree_util.tree_leaves_with_path(shardings)}
  assert specs["['layers'][0]['attn']['k'].value"] == P("fsdp", "tensor", None)
  # 4 KV heads cannot split 8 ways: the error names the field and the mesh axis.
  with pytest.raises(ValueError, match=r"model.num_kv_heads = 4 is not divisible by mesh axis mesh.tensor=8"):
    sharding.param_shardings(abstract, fake_mesh(1, 8, 8))
  # Batch rows on the fake mesh: data x fsdp = 32 ways.
  sharding.check_rows("rollout.prompts_per_iter", 64, mesh)
  with pytest.raises(ValueError, match="= 48 is not divisible by the batch mesh axes mesh.data \\* mesh.fsdp \\* mesh.expert = 32"):
    sharding.check_rows("rollout.prompts_per_iter", 48, mesh)
  # Expert parallelism on v5p-64 (fsdp 16 x expert 4): experts split by expert, their width
  # by fsdp; every other weight's width over fsdp x expert; the router whole along experts.
  ep = fake_mesh(1, 16, 1, expert=4)
  assert sharding.spec_for(("expert", "embed", "mlp"), (128, 2048, 768), ep) == P("expert", "fsdp", None)
  assert sharding.spec_for(("expert", "mlp", "embed"), (128, 768, 2048), ep) == P("expert", None, "fsdp")
  assert sharding.spec_for(("embed", "heads", "head_dim"), (2048, 32, 128), ep) == P(("fsdp", "expert"), None, None)
  assert sharding.spec_for(("embed", "expert"), (2048, 128), ep) == P(("fsdp", "expert"), None)
  with pytest.raises(ValueError, match=r"model.num_experts = 126 is not divisible by mesh axis mesh.expert=4"):
    sharding.spec_for(("expert", "embed", "mlp"), (126, 2048, 768), ep)
