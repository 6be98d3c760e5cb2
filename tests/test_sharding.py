"""Mesh construction, the rules table, and sharded initialisation on 8 simulated devices."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from gspo_jax import sharding
from gspo_jax.models import config, transformer
from gspo_jax.models.transformer import Transformer

@functools.lru_cache(maxsize=None)
def reference(cfg):
  """The single-device model (built once per config, shared by the mesh variants)."""
  return transformer.create(cfg, seed=5)


MESHES = {"data8": sharding.MeshConfig(data=8), "fsdp8": sharding.MeshConfig(data=1, fsdp=8),
          "2x2x2": sharding.MeshConfig(data=2, fsdp=2, tensor=2)}


@pytest.mark.parametrize("cfg,shape", [
    (sharding.MeshConfig(), (8, 1, 1)), (sharding.MeshConfig(data=2, fsdp=-1), (2, 4, 1)),
    (sharding.MeshConfig(data=2, fsdp=2, tensor=2), (2, 2, 2))])
def test_mesh_shapes(cfg, shape):
  mesh = sharding.make_mesh(cfg)
  assert tuple(mesh.shape.values()) == shape and mesh.axis_names == sharding.MESH_AXES


@pytest.mark.parametrize("cfg", [sharding.MeshConfig(data=3), sharding.MeshConfig(data=-1, fsdp=-1),
                                 sharding.MeshConfig(data=2, fsdp=3, tensor=1),
                                 sharding.MeshConfig(data=0)])
def test_bad_mesh_is_a_clear_error(cfg):
  with pytest.raises(ValueError, match="MeshConfig"):
    sharding.make_mesh(cfg)


def test_rules_table_on_a_mesh():
  mesh = sharding.make_mesh(MESHES["2x2x2"])
  assert sharding.spec_for(("embed", "heads", "head_dim"), (64, 4, 32), mesh) == P("fsdp", "tensor", None)
  assert sharding.spec_for(("vocab", "embed"), (64, 64), mesh) == P("tensor", "fsdp")
  # Not divisible by the mesh axis -> replicated; a mesh axis is used once per spec.
  assert sharding.spec_for(("embed", "kv_heads", "head_dim"), (64, 1, 32), mesh) == P("fsdp", None, None)
  assert sharding.spec_for(("heads", "kv_heads"), (4, 4), mesh) == P("tensor", None)
  assert sharding.batch_sharding(mesh).spec == P(("data", "fsdp"), None)


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
