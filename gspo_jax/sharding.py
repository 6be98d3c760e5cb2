"""Device meshes, the logical-axis rules table, and sharded model initialisation.

Model code names the axes of every parameter (`logical_axes` metadata: vocab, embed, heads,
kv_heads, head_dim, mlp, expert); one rules table here maps those names to mesh axes.
Parameter and activation (batch) rules are kept apart, as levanter does: parameters are
split along `fsdp` (the residual width) and `tensor` (heads, mlp, vocab); batches along
`data` and `fsdp` together.

Meshes use `AxisType.Auto` (jax.make_mesh defaults to Explicit in this JAX version, which
breaks ordinary NNX layers whose contracting dimension is sharded).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import jax
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")

# Logical parameter axis -> mesh axis (None = replicated).
PARAM_RULES: Mapping[str, str | None] = {
    "vocab": "tensor",
    "embed": "fsdp",
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    "expert": None,      # no expert parallelism yet: experts are split by embed / mlp
}

# Logical activation axis -> mesh axes. Rows of a batch are split over data and fsdp.
ACTIVATION_RULES: Mapping[str, Any] = {
    "batch": ("data", "fsdp"),
    "seq": None,
}


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Mesh shape; -1 on one axis takes all remaining devices. Any axis may be 1."""
  data: int = -1
  fsdp: int = 1
  tensor: int = 1

  def shape(self, num_devices: int) -> tuple[int, int, int]:
    sizes = [self.data, self.fsdp, self.tensor]
    if sizes.count(-1) > 1 or any(s == 0 or s < -1 for s in sizes):
      raise ValueError(f"MeshConfig: each of data/fsdp/tensor must be >= 1, and at most one may "
                       f"be -1; got {self}")
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
      if num_devices % known:
        raise ValueError(f"MeshConfig {self}: {num_devices} devices do not divide by {known}")
      sizes[sizes.index(-1)] = num_devices // known
    if math.prod(sizes) != num_devices:
      raise ValueError(f"MeshConfig {self}: data*fsdp*tensor = {math.prod(sizes)} must equal the "
                       f"number of devices ({num_devices})")
    return tuple(sizes)


def make_mesh(cfg: MeshConfig = MeshConfig(), devices=None) -> Mesh:
  devices = jax.devices() if devices is None else devices
  shape = cfg.shape(len(devices))
  return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES),
                       devices=devices)


def spec_for(axes: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh,
             rules: Mapping[str, Any] = PARAM_RULES) -> P:
  """PartitionSpec for an array with these logical axes. A dimension stays replicated when
  its size does not divide by the mesh axis, or when that mesh axis is already used by an
  earlier dimension (a spec may name each mesh axis once)."""
  used, out = set(), []
  for name, size in zip(axes, shape):
    target = rules.get(name) if name is not None else None
    names = () if target is None else (target if isinstance(target, tuple) else (target,))
    ways = math.prod(mesh.shape[n] for n in names) if names else 1
    if not names or used & set(names) or size % ways or ways == 1:
      out.append(None)
      continue
    used |= set(names)
    out.append(names[0] if len(names) == 1 else names)
  return P(*out)


def _is_variable(x) -> bool:
  return isinstance(x, nnx.Variable)


def param_shardings(abstract_state, mesh: Mesh, rules: Mapping[str, Any] = PARAM_RULES):
  """The state tree with each Variable's value replaced by its NamedSharding."""
  def one(var):
    spec = spec_for(var.get_metadata()["logical_axes"], var.get_value().shape, mesh, rules)
    return var.replace(NamedSharding(mesh, spec))
  return jax.tree.map(one, abstract_state, is_leaf=_is_variable)


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
  """Rows split over the batch mesh axes, everything else replicated."""
  return NamedSharding(mesh, P(ACTIVATION_RULES["batch"], *([None] * (ndim - 1))))


def init_sharded(model_cls, cfg, mesh: Mesh, seed: int = 0):
  """Build `model_cls(cfg, rngs=nnx.Rngs(seed))` with every parameter created directly in its
  sharding: shapes come from `nnx.eval_shape`, and one `jax.jit` with `out_shardings`
  runs the initialisers, so no device ever holds the full parameter set."""
  make = lambda: model_cls(cfg, rngs=nnx.Rngs(seed))
  graphdef, abstract = nnx.split(nnx.eval_shape(make))
  shardings = param_shardings(abstract, mesh)
  state = jax.jit(lambda: nnx.state(make()), out_shardings=shardings)()
  return nnx.merge(graphdef, state)
