"""Expert parallelism's layout: whether a program's mesh splits experts, over which mesh
axes (training or a sampler), moving a sampler's experts to that layout, and the checks of
`mesh.expert` against the model. The dispatch itself is `models.moe._expert_parallel`; the
rules table (`sharding.PARAM_RULES`) maps the logical `expert` axis to the `expert` mesh axis.

Training and teacher forcing keep each expert's residual width split over fsdp at rest
and gather it per layer, as every weight is; a sampler instead splits whole experts over
fsdp x expert (moved there once per call, `place_experts`), so that a decode step moves
its few tokens to the experts and never an expert's weights.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
from jax.sharding import PartitionSpec as P

_WHOLE_EXPERTS = contextvars.ContextVar("whole_experts", default=False)


@contextlib.contextmanager
def layout(whole_experts: bool):
  """Trace the enclosed code with a sampler's layout of the experts (`whole_experts`) or
  training's (`sharding.on_mesh` enters this)."""
  token = _WHOLE_EXPERTS.set(whole_experts)
  try:
    yield
  finally:
    _WHOLE_EXPERTS.reset(token)


def expert_parallel(mesh=None) -> bool:
  """Whether `mesh` (default: the mesh of the program being traced) splits experts."""
  mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
  return not mesh.empty and mesh.shape.get("expert", 1) > 1


def expert_group(mesh=None) -> tuple[str, ...]:
  """The mesh axes a MoE layer's experts are split over in the program being traced:
  `expert` (training, teacher forcing), or fsdp x expert in a sampler."""
  mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
  return ("fsdp", "expert") if _WHOLE_EXPERTS.get() and "fsdp" in mesh.shape else ("expert",)


def place_experts(params):
  """`params` (a model's state) with each expert weight laid out as `expert_group` says, on
  the traced program's mesh: a sampler moves its experts once per call, before its decode
  loop, instead of gathering them at every step. Unchanged without expert parallelism."""
  if not expert_parallel():
    return params
  group = expert_group()

  def one(var):
    axes = tuple(var.get_metadata()["logical_axes"])
    if "expert" not in axes or axes.index("expert") != len(axes) - 3:
      return var   # not an (E, ., .) expert weight (the router's expert axis is its last)
    spec = P(*([None] * (len(axes) - 3)), group, None, None)
    return var.replace(jax.lax.with_sharding_constraint(var.get_value(), spec))
  return jax.tree.map(one, params, is_leaf=lambda x: hasattr(x, "get_metadata"))


def check_experts(mesh, num_experts: int) -> None:
  """`mesh.expert` (`mesh` a `sharding.MeshConfig`) against the model's `num_experts` (0 for
  a dense model): only a MoE model's experts split over it, evenly, and not beside tensor
  parallelism (the expert-parallel MoE runs whole experts per chip). Raised before any work,
  naming the field."""
  if mesh.expert == 1:
    return
  if not num_experts:
    raise ValueError(f"mesh.expert = {mesh.expert} needs a Mixture-of-Experts model "
                     "(model.num_experts > 0): a dense model has no experts to split; use "
                     "mesh.fsdp or mesh.data for these chips")
  if mesh.expert < 1:
    raise ValueError(f"mesh.expert must be a number of chips >= 1 (it has to divide "
                     f"model.num_experts = {num_experts}); got {mesh.expert}")
  if num_experts % mesh.expert:
    raise ValueError(f"mesh.expert = {mesh.expert} does not divide model.num_experts = "
                     f"{num_experts}: each chip of the expert axis holds "
                     "num_experts / mesh.expert whole experts")
  if mesh.tensor != 1:
    raise ValueError(f"mesh.expert = {mesh.expert} with mesh.tensor = {mesh.tensor} is not "
                     "supported: expert-parallel MoE layers run whole experts per chip; set "
                     "mesh.tensor=1 (use mesh.fsdp or mesh.data for the other chips)")
