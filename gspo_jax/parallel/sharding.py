"""Device meshes, the logical-axis rules table, and sharded model initialisation.

Model code names the axes of every parameter (`logical_axes` metadata: vocab, embed, heads,
kv_heads, head_dim, mlp, expert, and layers for a scanned model); one rules table here maps those names to mesh axes.
Parameter and activation (batch) rules are kept apart, as levanter does: parameters are
split along `fsdp` and `expert` (the residual width, ZeRO-3 style), `expert` (a MoE layer's
experts) and `tensor` (heads, mlp, vocab); batches along `data`, `fsdp` and `expert`
together. Outside its MoE layers the `expert` axis is one more way of splitting the batch
and the weights' residual width; inside them each chip runs its own experts on the tokens
of its expert group (`models.moe`, expert-parallel dispatch).

Meshes use `AxisType.Auto` (jax.make_mesh defaults to Explicit in this JAX version, which
breaks ordinary NNX layers whose contracting dimension is sharded).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gspo_jax.parallel import expert_mesh

MESH_AXES = ("data", "fsdp", "expert", "tensor")

# Logical parameter axis -> mesh axis (None = replicated).
PARAM_RULES: Mapping[str, str | None] = {
    "vocab": "tensor",
    "embed": ("fsdp", "expert"),   # an expert weight's own `expert` dimension takes that axis
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    "expert": "expert",  # a MoE layer's experts (expert parallelism, `models.moe`)
    "layers": None,      # the stacked axis of a scanned model (cfg.scan_layers): the scan
                         # slices one layer per step, so every device holds all of them
}

# Logical activation axis -> mesh axes. Rows of a batch are split over data, fsdp and expert.
ACTIVATION_RULES: Mapping[str, Any] = {
    "batch": ("data", "fsdp", "expert"),
    "seq": None,
}

# The config field behind each logical parameter axis (named in divisibility errors).
AXIS_FIELDS: Mapping[str, str] = {
    "vocab": "model.vocab_size", "embed": "model.hidden", "heads": "model.num_heads",
    "kv_heads": "model.num_kv_heads", "head_dim": "model.head_dim",
    "mlp": "model.mlp_dim (or model.moe_mlp_dim)", "expert": "model.num_experts",
    "layers": "model.num_layers",
}


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Mesh shape over `num_devices` devices (0 = every device of every process); -1 on one
  axis takes all remaining devices. Any axis may be 1.

    data:   pure data parallelism (parameters replicated)
    fsdp:   rows of the batch *and* the parameters' residual dimension are split (ZeRO-3)
    expert: a MoE model's experts split (expert parallelism); elsewhere it acts as fsdp
            (rows and the residual width split). Must divide model.num_experts; a dense
            model, or tensor > 1 beside it, is refused (`config.check_mesh`)
    tensor: heads / mlp / vocab split (Megatron-style), activations all-reduced
  """
  data: int = -1
  fsdp: int = 1
  tensor: int = 1
  num_devices: int = 0
  expert: int = 1

  def shape(self, num_devices: int) -> tuple[int, int, int, int]:
    """Sizes in MESH_AXES order (data, fsdp, expert, tensor)."""
    sizes = [self.data, self.fsdp, self.expert, self.tensor]
    if sizes.count(-1) > 1 or any(s == 0 or s < -1 for s in sizes):
      raise ValueError(f"mesh: each of mesh.data / mesh.fsdp / mesh.expert / mesh.tensor must "
                       f"be >= 1, and at most one may be -1; got {self}")
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
      if num_devices % known:
        raise ValueError(f"mesh: {num_devices} devices do not divide by the fixed mesh axes "
                         f"({known}); got {self}")
      sizes[sizes.index(-1)] = num_devices // known
    if math.prod(sizes) != num_devices:
      raise ValueError(f"mesh: mesh.data * mesh.fsdp * mesh.expert * mesh.tensor = "
                       f"{math.prod(sizes)} must equal the number of devices ({num_devices}); "
                       f"got {self}")
    return tuple(sizes)


def make_mesh(cfg: MeshConfig = MeshConfig(), devices=None) -> Mesh:
  """An `AxisType.Auto` mesh with axes MESH_AXES. Devices default to all of them (every
  process's, in multi-host runs), or the first `cfg.num_devices`."""
  devices = jax.devices() if devices is None else list(devices)
  if cfg.num_devices:
    if cfg.num_devices > len(devices) or (jax.process_count() > 1 and
                                          cfg.num_devices != len(devices)):
      raise ValueError(f"mesh: mesh.num_devices = {cfg.num_devices} but {len(devices)} devices "
                       f"are available over {jax.process_count()} process(es)")
    devices = devices[:cfg.num_devices]
  shape = cfg.shape(len(devices))
  return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES),
                       devices=devices)


def spec_for(axes: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh,
             rules: Mapping[str, Any] = PARAM_RULES) -> P:
  """PartitionSpec for an array with these logical axes.

  A mesh axis names at most one dimension of a spec: a later dimension keeps only the mesh
  axes not yet in use (an expert weight's embed dimension: fsdp, its expert one having taken
  `expert`), and stays replicated if none is left. An unknown logical name, or a dimension that the
  mesh axis does not divide, is a ValueError naming the config field to change.
  """
  used, out = set(), []
  for name, size in zip(axes, shape):
    if name is not None and name not in rules:
      raise ValueError(f"unknown logical axis {name!r} (the rules table knows {sorted(rules)})")
    target = rules.get(name) if name is not None else None
    names = () if target is None else (target if isinstance(target, tuple) else (target,))
    names = tuple(n for n in names if n not in used and mesh.shape.get(n, 1) > 1)
    ways = math.prod(mesh.shape[n] for n in names)
    if ways == 1:
      out.append(None)
      continue
    if size % ways:
      field = AXIS_FIELDS.get(name, f"the {name!r} dimension")
      raise ValueError(f"{field} = {size} is not divisible by mesh axis "
                       f"{' x '.join(f'mesh.{n}={mesh.shape[n]}' for n in names)}: choose a "
                       f"mesh that divides it (logical axis {name!r})")
    used |= set(names)
    out.append(names[0] if len(names) == 1 else names)
  return P(*out)


def constrain(x: jax.Array, axes: tuple[str | None, ...],
              rules: Mapping[str, Any] = ACTIVATION_RULES) -> jax.Array:
  """`x` laid out by its logical `axes` on the mesh of the program being traced, if it has
  one (`on_mesh`); unchanged otherwise (one device, or code traced without a mesh).

  Model code calls this at a few boundaries so that XLA's propagation cannot choose a
  layout that is cheap locally and ruinous globally: without it the embedding's
  (vocab, embed->fsdp) layout spreads into the residual stream, and FSDP turns into
  tensor parallelism over the whole minibatch (an activation-sized all-reduce per layer).
  A dimension the mesh axes do not divide is split unevenly (XLA pads it)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return x
  used, spec = set(), []
  for name in axes:
    target = rules.get(name) if name is not None else None
    names = () if target is None else (target if isinstance(target, tuple) else (target,))
    names = tuple(n for n in names if n in mesh.shape and n not in used)
    used |= set(names)
    spec.append(None if not names else names[0] if len(names) == 1 else names)
  return jax.lax.with_sharding_constraint(x, P(*spec))


def gathered(weights, dtype=None):
  """Weights (a pytree of `nnx.Variable`s, e.g. one layer's state) as one chip uses them
  under FSDP: gathered over `fsdp` (still split over `tensor`) on the program's mesh, in
  `dtype` (the compute dtype every layer casts its weights to anyway: float32 master
  weights travel at half the bytes in bfloat16), with their gradients laid out as the
  parameters are. Unchanged without a mesh.

  The custom gradient says where the summed gradient goes: constrained only in the
  forward pass, the transpose would ask for the full gradient on every chip (an
  all-reduce of every weight per minibatch) instead of a reduce-scatter to its shard."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.shape.get("fsdp", 1) * mesh.shape.get("expert", 1) == 1:
    return weights
  # The residual width whole, and the router's expert columns (it is small, and the softmax
  # over experts then stays on one chip); heads, mlp and vocab stay split over `tensor`.
  use_rules = {**PARAM_RULES, "embed": None, "expert": None}

  def one(var):
    axes = tuple(var.get_metadata()["logical_axes"])
    value = var.get_value()
    axes = axes[len(axes) - value.ndim:]      # a scanned layer's slice lost its `layers` axis
    if axes[:1] == ("expert",) and expert_mesh.expert_parallel(mesh):
      return var   # the expert-parallel MoE gathers its own experts' shards (`models.moe`)
    use, keep = spec_for(axes, value.shape, mesh, use_rules), spec_for(axes, value.shape, mesh)
    if use == keep:
      return var
    if dtype is not None and jnp.issubdtype(value.dtype, jnp.floating):
      value = value.astype(dtype)
    return var.replace(_gather(value, use, keep))
  return jax.tree.map(one, weights, is_leaf=_is_variable)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gather(x, use: P, keep: P):
  return jax.lax.with_sharding_constraint(x, use)


def _gather_fwd(x, use, keep):
  return _gather(x, use, keep), None


def _gather_bwd(use, keep, _, ct):
  return (jax.lax.with_sharding_constraint(ct, keep),)


_gather.defvjp(_gather_fwd, _gather_bwd)


def batch_axes(mesh) -> tuple[str, ...]:
  """The mesh axes that split the rows of a batch, in order (those `mesh` has)."""
  return tuple(a for a in ACTIVATION_RULES["batch"] if a in mesh.shape)


def on_mesh(fn, mesh: Mesh, whole_experts: bool = False):
  """`fn` traced with `mesh` as its context (what `constrain` reads): the programs'
  functions are wrapped by this where their jit is built. `whole_experts`: a sampler's
  layout of the experts (`expert_mesh.expert_group`)."""
  @functools.wraps(fn)
  def traced(*args, **kwargs):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), expert_mesh.layout(whole_experts):
      return fn(*args, **kwargs)
  return traced


def _is_variable(x) -> bool:
  return isinstance(x, nnx.Variable)


def param_shardings(abstract_state, mesh: Mesh, rules: Mapping[str, Any] = PARAM_RULES):
  """The state tree with each Variable's value replaced by its NamedSharding."""
  def one(var):
    spec = spec_for(var.get_metadata()["logical_axes"], var.get_value().shape, mesh, rules)
    return var.replace(NamedSharding(mesh, spec))
  return jax.tree.map(one, abstract_state, is_leaf=_is_variable)


def optimizer_shardings(tx, abstract_params, params_sharding, mesh: Mesh):
  """Shardings of `tx.init(params)`: moments follow their parameter, the rest (counts,
  injected hyperparameters) is replicated."""
  abstract_opt = jax.eval_shape(tx.init, abstract_params)
  return optax.tree_map_params(tx, lambda _, s: s, abstract_opt, params_sharding,
                               transform_non_params=lambda _: replicated(mesh),
                               is_leaf=_is_variable)


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def batch_ways(mesh: Mesh) -> int:
  """How many ways the rows of a batch are split."""
  return math.prod(mesh.shape[n] for n in ACTIVATION_RULES["batch"])


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
  """Rows split over the batch mesh axes, everything else replicated."""
  return NamedSharding(mesh, P(ACTIVATION_RULES["batch"], *([None] * (ndim - 1))))


def rows(mesh: Mesh) -> NamedSharding:
  """Rows split over the batch mesh axes, whatever the rank: a sharding prefix of any
  pytree whose arrays all lead with rows (a `step.Batch`, rewards_BxG or per turn)."""
  return NamedSharding(mesh, P(ACTIVATION_RULES["batch"]))


def by_rank(shapes, mesh: Mesh):
  """The rule that gives a program's per-row outputs their shardings from their abstract
  shapes (`jax.eval_shape`): arrays of rank >= 1 lead with rows (`batch_sharding`),
  scalars are replicated. None leaves stay None."""
  return jax.tree.map(lambda s: batch_sharding(mesh, s.ndim) if s.ndim else replicated(mesh),
                      shapes)


def abstract(arrays, shardings):
  """`arrays` (or their shapes) as `jax.ShapeDtypeStruct`s placed in `shardings` (a tree
  of the same structure): what a program compiled ahead of time takes."""
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                      arrays, shardings)


def abstract_rows(shapes, mesh: Mesh):
  """`shapes` (from `jax.eval_shape`) as abstract inputs in the `by_rank` shardings."""
  return abstract(shapes, by_rank(shapes, mesh))


def check_rows(field: str, rows: int, mesh: Mesh) -> None:
  """A batch dimension set by config `field` must divide over the batch mesh axes."""
  ways = batch_ways(mesh)
  if rows % ways:
    raise ValueError(f"{field} = {rows} is not divisible by the batch mesh axes "
                     f"mesh.data * mesh.fsdp * mesh.expert = {ways}: rows of a batch are split "
                     "over them")


def init_sharded(model_cls, cfg, mesh: Mesh, seed: int = 0):
  """Build `model_cls(cfg, rngs=nnx.Rngs(seed))` with every parameter created directly in its
  sharding: shapes come from `nnx.eval_shape`, and one `jax.jit` with `out_shardings`
  runs the initialisers, so no device ever holds the full parameter set."""
  graphdef, program = init_program(model_cls, cfg, mesh, seed)
  return nnx.merge(graphdef, program())


def init_program(model_cls, cfg, mesh: Mesh, seed: int = 0):
  """(graphdef, the jitted initialiser with out_shardings) behind `init_sharded`; lower and
  compile it to see per-device memory without allocating anything."""
  make = lambda: model_cls(cfg, rngs=nnx.Rngs(seed))
  graphdef, abstract = nnx.split(nnx.eval_shape(make))
  return graphdef, jax.jit(lambda: nnx.state(make()), out_shardings=param_shardings(abstract, mesh))


# ------------------------------------------------------------------------------ multi-host data
# Each process feeds, and reads back, only the rows of a batch that live on its own devices.


def local_rows(sharding: NamedSharding, rows: int) -> slice:
  """The rows of a (rows, ...) array with this sharding that this process's devices hold."""
  index = sharding.addressable_devices_indices_map((rows,))
  starts = sorted({idx[0].indices(rows)[0] for idx in index.values()})
  stops = sorted({idx[0].indices(rows)[1] for idx in index.values()})
  lo, hi = starts[0], stops[-1]
  covered = sum(b - a for a, b in zip(starts, stops))
  if covered != hi - lo:
    raise ValueError("this process's rows of the batch are not contiguous; order the mesh "
                     "devices by process (jax.make_mesh does)")
  return slice(lo, hi)


def to_global(local, sharding: NamedSharding, global_shape: tuple[int, ...]) -> jax.Array:
  """A global array from this process's rows (`local_rows`); one process: a device_put."""
  return jax.make_array_from_process_local_data(sharding, np.asarray(local), global_shape)


def to_host(x: jax.Array) -> np.ndarray:
  """This process's rows of a row-sharded global array, in order, as numpy."""
  if jax.process_count() == 1:
    return np.asarray(x)
  shards = {s.index[0].indices(x.shape[0])[0]: s.data for s in x.addressable_shards}
  return np.concatenate([np.asarray(shards[k]) for k in sorted(shards)], axis=0)


def gather_rows(local: np.ndarray) -> np.ndarray:
  """Every process's rows of a host array, concatenated in process order (for metrics)."""
  if jax.process_count() == 1:
    return np.asarray(local)
  from jax.experimental import multihost_utils
  return np.asarray(multihost_utils.process_allgather(np.asarray(local), tiled=True))


def barrier(name: str) -> None:
  """Wait for every process (no-op with one)."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices(name)


def local_part(items, mesh: Mesh):
  """This process's share of a global batch of host items (examples, texts): every process
  draws the same global batch (a pure function of seed and step) and encodes only the rows
  its devices hold."""
  return items[local_rows(batch_sharding(mesh), len(items))]


def feed(local, mesh: Mesh, rows: int) -> jax.Array:
  """A global row-sharded array of `rows` rows from this process's rows (`local_part`)."""
  local = np.asarray(local)
  return to_global(local, batch_sharding(mesh, local.ndim), (rows, *local.shape[1:]))
