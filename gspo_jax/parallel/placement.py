"""Where the sampler runs and how far ahead of the trainer it may be: the `placement.*` and
`asynchronous.*` config groups, their checks, and the split of the devices.

  placement.sampler_devices = N   the last N devices sample (their own mesh,
                                  `placement.sampler_mesh`), the others train (`mesh.*`);
                                  0 (default): both share `mesh.*` (colocated)
  asynchronous.max_staleness = k  the rollout of iteration i is sampled by policy version
                                  max(0, i - k) (version v = the parameters after v updates):
                                  the sampler works on rollouts i+1..i+k while the trainer
                                  is on i; 0 (default): synchronous, today's loop exactly
  asynchronous.pi_old             "behaviour": pi_old is the sampling version's (teacher
                                  forced with the parameters the sampler had, or the
                                  sampler's own log-probs with old_logp="sampler"); the
                                  update's ratio pi_theta / pi_old then spans the staleness.
                                  "proximal": pi_old is recomputed by the trainer at its
                                  current version just before the update (decoupled PPO,
                                  AReaL); the staleness is then left to the rollout
                                  correction (rollout_correction.*, TIS / MIS) against the
                                  sampler's log-probs
  asynchronous.timeline           write <run>/timeline.jsonl: when each phase ran

The lag is fixed, not opportunistic: the sampler waits for version i - k rather than
taking whatever version is newest, so the staleness of every iteration is known in advance
and a run repeats bit for bit on one machine (the sampler never runs more than k versions
ahead, so there is nothing stale to drop).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax

from gspo_jax.parallel import sharding
from gspo_jax.utils import checks

PI_OLD = ("behaviour", "proximal")


@dataclasses.dataclass(frozen=True)
class PlacementConfig:
  """`placement.*`: the sampler on devices of its own (see the module docstring)."""
  sampler_devices: int = 0
  # The sampler's mesh over its `sampler_devices` (default: all of them on `data`, each
  # holding the whole policy, as inference engines do); the same rules table shards it.
  sampler_mesh: sharding.MeshConfig = sharding.MeshConfig()

  def __post_init__(self):
    if isinstance(self.sampler_devices, bool) or not isinstance(self.sampler_devices, int) \
        or self.sampler_devices < 0:
      raise ValueError(f"placement.sampler_devices must be an int >= 0 (0: the sampler shares "
                       f"the trainer's devices); got {self.sampler_devices!r}")
    if not self.sampler_devices and self.sampler_mesh != sharding.MeshConfig():
      raise ValueError("placement.sampler_mesh applies to a sampler on its own devices: set "
                       "placement.sampler_devices > 0")
    if self.sampler_mesh.num_devices:
      raise ValueError("placement.sampler_mesh.num_devices: the sampler's devices are "
                       "placement.sampler_devices")


@dataclasses.dataclass(frozen=True)
class AsyncConfig:
  """`asynchronous.*` (also spelled `async.*` on the command line)."""
  max_staleness: int = 0
  pi_old: Literal["behaviour", "proximal"] = "behaviour"
  timeline: bool = False

  def __post_init__(self):
    if isinstance(self.max_staleness, bool) or not isinstance(self.max_staleness, int) \
        or self.max_staleness < 0:
      raise ValueError(f"asynchronous.max_staleness must be an int >= 0 (0: synchronous); got "
                       f"{self.max_staleness!r}")
    checks.check_choice("asynchronous", "pi_old", self.pi_old, PI_OLD)
    if not isinstance(self.timeline, bool):
      raise ValueError(f"asynchronous.timeline must be a bool; got {self.timeline!r}")


def is_async(cfg) -> bool:
  """Whether the run needs the pipeline (`gspo_jax.train.pipeline`) rather than today's loop."""
  return bool(cfg.asynchronous.max_staleness or cfg.placement.sampler_devices
              or cfg.asynchronous.pi_old != "behaviour" or cfg.asynchronous.timeline)


def check_config(cfg) -> None:
  """What the asynchronous sampler cannot combine with, each named (TrainConfig calls this)."""
  a, p = cfg.asynchronous, cfg.placement
  if not is_async(cfg):
    return
  what = (f"asynchronous.max_staleness={a.max_staleness}, placement.sampler_devices="
          f"{p.sampler_devices}, asynchronous.pi_old={a.pi_old!r}")
  refused = {}
  if p.sampler_devices:
    refused["lora.rank (the frozen base is not placed on the sampler's devices)"] = \
        bool(cfg.lora.rank)
  bad = [name for name, on in refused.items() if on]
  if bad:
    raise ValueError(f"{what} cannot be combined with {', '.join(bad)}")
  if a.pi_old == "proximal" and cfg.old_logp == "sampler":
    raise ValueError("asynchronous.pi_old='proximal' recomputes pi_old at the trainer's "
                     "version; old_logp='sampler' makes the sampler's log-probs pi_old: "
                     "choose one (old_logp='recompute', or asynchronous.pi_old='behaviour')")


def split_devices(cfg, devices=None):
  """(trainer devices, sampler devices or None) of the run: the trainer takes the first
  `mesh.num_devices` (default: all but the sampler's), the sampler the next
  `placement.sampler_devices`. ValueError naming the field when there are too few
  (multi-host: refused, see docs/async.md)."""
  devices = jax.devices() if devices is None else list(devices)
  n = cfg.placement.sampler_devices
  if not n:
    return devices, None
  if jax.process_count() > 1:
    raise ValueError(f"placement.sampler_devices={n}: a sampler on its own devices is "
                     "single-host for now (each host would need its own rows of both "
                     "meshes); use placement.sampler_devices=0 (asynchronous.max_staleness "
                     "also works colocated)")
  trainer = cfg.mesh.num_devices or len(devices) - n
  if trainer < 1 or trainer + n > len(devices):
    raise ValueError(f"placement.sampler_devices={n} and mesh.num_devices="
                     f"{cfg.mesh.num_devices} (the trainer's; 0: all the others) need more "
                     f"than the {len(devices)} devices there are")
  return devices[:trainer], devices[trainer:trainer + n]


def make_meshes(cfg, devices=None):
  """(trainer mesh, sampler mesh or None): `mesh.*` over the trainer's devices and
  `placement.sampler_mesh` over the sampler's; an error names the group whose shape
  does not fit its devices."""
  if is_async(cfg) and jax.process_count() > 1:
    raise ValueError(f"asynchronous.max_staleness={cfg.asynchronous.max_staleness} (or another "
                     "asynchronous.* / placement.* setting): the asynchronous pipeline is "
                     "single-host for now (its rollouts in flight are saved from one host); "
                     "leave asynchronous.* and placement.* at their defaults on multi-host runs")
  trainer, sampler = split_devices(cfg, devices)
  if sampler is None:
    return sharding.make_mesh(cfg.mesh, devices=trainer), None
  mesh = sharding.make_mesh(dataclasses.replace(cfg.mesh, num_devices=0), devices=trainer)
  try:
    smesh = sharding.make_mesh(cfg.placement.sampler_mesh, devices=sampler)
  except ValueError as e:
    raise ValueError(f"placement.sampler_mesh over the {len(sampler)} sampler devices "
                     f"(placement.sampler_devices): {e}") from None
  sharding.check_rows("rollout.prompts_per_iter + rollout.oversample (prompts sampled), over "
                      "placement.sampler_mesh", cfg.rollout.sampled_prompts, smesh)
  return mesh, smesh
