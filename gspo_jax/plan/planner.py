"""Plan a TPU run before renting one: compile every program of a run for a Cloud TPU
topology on this CPU machine and report what each needs per chip.

    python -m gspo_jax.plan --config configs/addition_tiny.py --topology v5e:2x2
    python -m gspo_jax.plan --config configs/long_chain.py --topology v5p:4x4x4 \\
        --set mesh.data=1 --set mesh.fsdp=64 --json

No TPU, no weights, no tokenizer, nothing written: the model is abstract
(`nnx.eval_shape`), the mesh is over the topology's compile-only devices
(`jax.experimental.topologies`, which needs libtpu: `pip install -r requirements-plan.txt`),
and the programs are the run's own (`programs.make_layout` / `make_programs`, the path
`train` builds them by), lowered from abstract inputs and compiled by XLA for the chip.

Per program and chip: argument, output, aliased (donated), temporary and generated-code
bytes (`memory_analysis`), their peak against the chip's HBM (a verdict per program, and
for the run), the compile time, the collective ops in the partitioned HLO, and their
traffic: each collective's result bytes weighted by the trip counts of the loops around it
(`plan_hlo.collective_bytes`; the sampler's early-exit decode loop counts once and is
flagged), and the bytes each chip sends for them; analytic FLOPs and HBM bytes and the
roofline time per program (compute, HBM and interconnect at the chip's published peaks,
the binding one named; `plan_cost`). `--search` plans every data x fsdp x tensor mesh
(`mesh.expert` kept as set).
Multi-turn episode programs are not planned (their host loop sits between them).
"""

from __future__ import annotations

import os

# libtpu, loaded for the topology, looks for a TPU VM's metadata unless told it is not on
# one, and takes a machine-wide lock that another JAX process with libtpu installed may
# hold; the planner itself runs on the CPU backend, unless it plans for the local devices
# (`--topology local`: whatever backend JAX finds, e.g. a GPU).
_DEFAULTS = (("TPU_SKIP_MDS_QUERY", "1"), ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1"),
             ("TPU_ACCELERATOR_TYPE", "v5litepod-4"), ("TPU_WORKER_HOSTNAMES", "localhost"))
if os.environ.get("GSPO_PLAN_LOCAL") != "1":
  _DEFAULTS += (("JAX_PLATFORMS", "cpu"),)
for _name, _value in _DEFAULTS:
  os.environ.setdefault(_name, _value)

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from gspo_jax.config import TrainConfig  # noqa: E402
from gspo_jax.parallel import sharding
from gspo_jax.plan import cost as plan_cost  # noqa: E402
from gspo_jax.plan import hlo as plan_hlo
from gspo_jax.plan.cost import CHIPS, Chip  # noqa: E402
from gspo_jax.plan.report import format_report  # noqa: E402
from gspo_jax.train import optim, programs
from gspo_jax.utils import configlib  # noqa: E402

GIB = 2 ** 30
LIBTPU = "libtpu==0.0.42.1"   # the version jax[tpu]==0.10.2 pins


# Topologies compiled here (any GEN:AxB[xC] of a generation above is tried).
KNOWN = ("v5e:2x2", "v5e:4x4", "v5e:16x16", "v5p:2x2x2", "v5p:4x4x4", "v6e:2x2", "v6e:8x8",
         "v4:2x2x2")
class PlanError(ValueError):
  """A plan refused before anything was compiled (topology, mesh, libtpu, config)."""


def topology_devices(name: str):
  """The compile-only devices of a Cloud TPU topology `GEN:AxB[xC]`, or with "local" this
  process's own devices."""
  if name == LOCAL:
    return jax.devices()
  gen, _, shape = name.partition(":")
  if gen not in CHIPS or not re.fullmatch(r"\d+x\d+(x\d+)?", shape):
    raise PlanError(f"--topology {name!r} is not a TPU topology GEN:AxB[xC] with GEN one of "
                    f"{', '.join(CHIPS)}; known here: {', '.join(KNOWN)}")
  if importlib.util.find_spec("libtpu") is None:
    raise PlanError("compiling for a TPU topology needs libtpu (no TPU needed): "
                    f"pip install '{LIBTPU}' (or pip install -r requirements-plan.txt)")
  from jax.experimental import topologies
  try:
    return topologies.get_topology_desc(platform="tpu", topology_name=name).devices
  except Exception as e:  # noqa: BLE001 - libtpu's own error for a shape it does not make
    raise PlanError(f"--topology {name!r} is not a topology libtpu knows ({e}); known here: "
                    f"{', '.join(KNOWN)}") from None


# `--topology local`: plan on this process's devices (run with GSPO_PLAN_LOCAL=1, which
# keeps JAX on its default backend), to compare the planner with a real device.
LOCAL = "local"


class _ShapeTokenizer:
  """What the programs take from a tokenizer: ids only (the planner trains none)."""

  def __init__(self, vocab_size: int):
    self.vocab_size, self.pad_id, self.eos_id, self.bos_id = vocab_size, 0, 1, 2



def _model_cfg(cfg: TrainConfig):
  """The model a run trains: `model`, or `pretrained`'s as `run.setup` loads it."""
  if not cfg.pretrained:
    return cfg.model
  from gspo_jax.models import hf
  from gspo_jax.train.run import pretrained_load_args
  return hf.model_config(cfg.pretrained, **pretrained_load_args(cfg))


def _shapes(program, *args):
  """`jax.eval_shape` of a program; a LoRA run's (`lora_run.Bound`) with its abstract base."""
  base = getattr(program, "frozen", None)
  if base is None:
    return jax.eval_shape(program, *args)
  return jax.eval_shape(program.jitted, base.abstract, *args)


def program_inputs(cfg: TrainConfig, layout, progs) -> dict[str, tuple]:
  """Abstract inputs of every program, in their shardings (the rollout's prompts, the
  evaluation's chunk of prompts, the cold start's batch)."""
  S, mesh, r = jax.ShapeDtypeStruct, layout.mesh, cfg.rollout
  rows = lambda shape, dtype: S(shape, dtype, sharding=sharding.batch_sharding(mesh, len(shape)))
  rep = sharding.replicated(mesh)
  state = sharding.abstract(jax.eval_shape(progs.init, layout.params), layout.state)
  Bs, P, T = r.sampled_prompts, r.max_prompt_len, r.max_new_tokens
  prompts, lens, step = rows((Bs, P), jnp.int32), rows((Bs,), jnp.int32), S((), jnp.int32,
                                                                             sharding=rep)
  rollout, _ = _shapes(progs.sample, layout.params, prompts, lens, state.key, step)
  rollout = sharding.abstract_rows(rollout, mesh)
  from gspo_jax.lora import run as lora_run
  ref = layout.params if lora_run.trains_reference(cfg) else None  # LoRA: the base
  batch = sharding.abstract_rows(
      _shapes(progs.prepare, layout.params, ref, rollout, prompts, lens), mesh)
  rewards = rows((Bs, r.group_size) if not cfg.multiturn.turn_credit
                 else (Bs, r.group_size, cfg.multiturn.max_turns), jnp.float32)
  ways = sharding.batch_ways(mesh)
  E = -(-min(cfg.eval_size or ways, 256) // ways) * ways   # evaluate's chunk, mesh-rounded
  out = {"init": (layout.params,),
         "sample": (layout.params, prompts, lens, state.key, step),
         "prepare": (layout.params, ref, rollout, prompts, lens),
         "update": (state, batch, rewards),
         "greedy": (layout.params, rows((E, P), jnp.int32), rows((E,), jnp.int32), state.key)}
  if cfg.sft.steps > 0:
    b = cfg.sft.batch_size
    sft_state = sharding.abstract(jax.eval_shape(progs.sft_init, layout.params),
                                  layout.sft_opt_state)
    out["sft"] = (layout.params, sft_state, (rows((b, P), jnp.int32), rows((b,), jnp.int32),
                                             rows((b, T), jnp.int32), rows((b, T), jnp.float32)))
  return out


def _bytes(abstract, per_chip: bool = False) -> int:
  """Bytes of abstract arrays, whole or one chip's shard (the layout's shardings; the
  compiled programs' own figures also count the chip's tile padding)."""
  shape = lambda x: x.sharding.shard_shape(x.shape) if per_chip else x.shape
  return sum(math.prod(shape(x)) * x.dtype.itemsize for x in jax.tree.leaves(abstract))


def _memory(compiled) -> dict[str, int]:
  m = compiled.memory_analysis()
  out = {"argument": m.argument_size_in_bytes, "output": m.output_size_in_bytes,
         "alias": m.alias_size_in_bytes, "temp": m.temp_size_in_bytes,
         "code": m.generated_code_size_in_bytes}
  # Donated (aliased) outputs reuse their arguments' buffers.
  out["peak"] = out["argument"] + out["output"] - out["alias"] + out["temp"] + out["code"]
  return out


def plan(cfg: TrainConfig, topology: str, only: tuple[str, ...] = ()) -> dict[str, Any]:
  """Compile the run's programs (or `only` these) for `topology`; the report (see the
  module docstring). PlanError for a topology, mesh, batch or libtpu that cannot be
  planned."""
  from flax import nnx

  from gspo_jax.models.transformer import Transformer
  devices = topology_devices(topology)
  chip = plan_cost.local_chip(devices) if topology == LOCAL else CHIPS[topology.partition(":")[0]]
  try:
    mesh = sharding.make_mesh(cfg.mesh, devices=devices)
    programs.check_layout(cfg, mesh)
  except ValueError as e:
    raise PlanError(f"{e} ({len(devices)} chips in {topology})") from None
  model_cfg = _model_cfg(cfg)
  cfg = dataclasses.replace(cfg, model=model_cfg)
  graphdef, params = nnx.split(nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0))),
                               nnx.Param)
  tx = optim.make_optimizer(cfg.optim)
  sft_tx = optim.sft_optimizer(cfg.sft.steps, cfg.sft.learning_rate) if cfg.sft.steps else None
  try:
    layout = programs.make_layout(params, tx, mesh, sft_tx)
  except ValueError as e:  # a parameter axis the mesh does not divide, named by its field
    raise PlanError(str(e)) from None
  tok = _ShapeTokenizer(model_cfg.vocab_size)
  progs = programs.make_programs(graphdef, tx, cfg, layout, tok)
  count = sum(math.prod(x.shape) for x in jax.tree.leaves(layout.params))
  report: dict[str, Any] = {
      "topology": topology, "chips": len(devices), "mesh": dict(mesh.shape),
      "hbm_per_chip_gib": chip.hbm_gib / chip.devices_per_chip, "params": count,
      "param_bytes": _bytes(layout.params),
      "param_bytes_per_chip": _bytes(layout.params, per_chip=True), "programs": {}}
  if cfg.lora.rank:  # adapters on a frozen base, as `run.setup` builds them (`lora_run`)
    layout, progs = _lora(cfg, graphdef, params, tx, layout, progs, tok)
    report.update(trained_params=sum(math.prod(x.shape) for x in jax.tree.leaves(layout.params)),
                  trained_bytes_per_chip=_bytes(layout.params, per_chip=True))
  costs = (plan_cost.program_flops(cfg, model_cfg),
           plan_cost.program_hbm_bytes(cfg, model_cfg, dict(mesh.shape), count))
  # TPU executables compiled without a TPU client cannot be read back from JAX's persistent
  # compilation cache: keep them out of it (restored below). JAX decides once per process
  # whether the cache is used, so the decision is reset on the way in and out.
  from jax.experimental.compilation_cache import compilation_cache
  cache = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  compilation_cache.reset_cache()
  try:
    report["programs"] = _compile_all(cfg, layout, progs, chip, costs, only)
  finally:
    jax.config.update("jax_enable_compilation_cache", cache)
    compilation_cache.reset_cache()
  report["fits"] = all(p["fits"] for p in report["programs"].values())
  loop = [report["programs"][n] for n in ITERATION if n in report["programs"]]
  if len(loop) == len(ITERATION) and all("time_s" in p for p in loop):
    report["iteration_s"] = sum(p["time_s"] for p in loop)
  return report


def _oom_bytes(message: str) -> float | None:
  """What XLA's out-of-memory error says the program needs (bytes), when it says."""
  units = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}
  found = re.search(r"\(([\d.]+)([KMGT])\) exceeds available HBM|Used ([\d.]+)([KMGT]) of",
                    message)
  if not found:
    return None
  value, unit = (found.group(1), found.group(2)) if found.group(1) else found.group(3, 4)
  return float(value) * units[unit]


# The programs one RL iteration runs (evaluation and the cold start come and go).
ITERATION = ("sample", "prepare", "update")


def _lora(cfg: TrainConfig, graphdef, params, tx, full_layout, full_programs, tok):
  """(the adapters' layout, a LoRA run's programs), abstract: the frozen base is the full
  model's abstract parameters, passed to each program as its first argument."""
  from gspo_jax.config import check_lora
  from gspo_jax.lora import adapters as lora
  from gspo_jax.lora import run as lora_run
  try:
    check_lora(cfg.lora, cfg.model)
  except ValueError as e:
    raise PlanError(str(e)) from None
  frozen = lora_run.Frozen(full_layout.params, full_layout, cfg.lora.scale, full_programs,
                           cfg.lora.base_dtype)
  layout = lora_run.adapters_layout(lora.adapter_shapes(params, cfg.lora), tx, full_layout.mesh,
                                    cfg)
  return layout, lora_run.make_programs(graphdef, tx, cfg, layout, tok, frozen)


def _compile_all(cfg: TrainConfig, layout, progs, chip: Chip, costs, only) -> dict[str, Any]:
  out = {}
  devices = len(layout.mesh.devices.flat)
  for name, args in program_inputs(cfg, layout, progs).items():
    if only and name not in only:
      continue
    t0 = time.perf_counter()
    entry: dict[str, Any] = {}
    try:
      compiled = getattr(progs, name).lower(*args).compile()
    except Exception as e:  # noqa: BLE001 - XLA refuses a program that cannot fit
      if not re.search(r"resource_exhausted|hbm|out of memory", str(e), re.I):
        raise
      entry.update(fits=False, error=str(e).splitlines()[0][:300])
      need = _oom_bytes(str(e))
      if need:
        entry["needs"] = need
    else:
      hlo = compiled.as_text()
      entry.update(_memory(compiled), collectives=plan_hlo.static_counts(hlo),
                   collective_bytes=plan_hlo.collective_bytes(hlo, devices))
      entry["fits"] = not chip.hbm_gib or entry["peak"] <= chip.hbm_gib / chip.devices_per_chip * GIB
      entry.update(flops=costs[0][name], hbm_bytes=costs[1][name],
                   **plan_cost.roofline(costs[0][name], costs[1][name],
                                        entry["collective_bytes"]["wire"], chip, devices))
    entry["compile_s"] = round(time.perf_counter() - t0, 2)
    out[name] = entry
  return out


def mesh_choices(chips: int) -> list[tuple[int, int, int]]:
  """Every (data, fsdp, tensor) whose product is `chips`, tensor and data first small."""
  out = []
  for tensor in (t for t in range(1, chips + 1) if chips % t == 0):
    for data in (d for d in range(1, chips // tensor + 1) if chips // tensor % d == 0):
      out.append((data, chips // tensor // data, tensor))
  return out


def search(cfg: TrainConfig, topology: str, only: tuple[str, ...] = (),
           remats: tuple[str, ...] = ()) -> dict[str, Any]:
  """Plan every mesh of the topology's chips (and each of `remats`, default the config's
  own); the plans that fit, fastest at the roofline first, and the others with why.
  PlanError naming the smallest shortfall if none fits."""
  chips = len(topology_devices(topology))
  fits, refused, short = [], [], []
  expert = max(cfg.mesh.expert, 1)   # kept as the config sets it; the other axes searched
  choices = [(m, r) for m in mesh_choices(chips // expert) for r in (remats or (cfg.model.remat,))]
  for (data, fsdp, tensor), remat in choices:
    mesh = dataclasses.replace(cfg.mesh, data=data, fsdp=fsdp, tensor=tensor, num_devices=0)
    name = (f"data={data} fsdp={fsdp} tensor={tensor}" + (f" expert={expert}" if expert > 1 else "")
            + (f" remat={remat}" if remats else ""))
    try:
      model = dataclasses.replace(cfg.model, remat=remat)
      report = plan(dataclasses.replace(cfg, mesh=mesh, model=model), topology, only)
    except PlanError as e:
      refused.append({"mesh": name, "why": str(e)})
      continue
    entry = {"mesh": name, "iteration_s": report.get("iteration_s"), "report": report}
    if report["fits"]:
      fits.append(entry)
    else:
      over = max(p.get("peak", p.get("needs", math.inf)) - report["hbm_per_chip_gib"] * GIB
                 for p in report["programs"].values())
      short.append((over, name))
  fits.sort(key=lambda e: (e["iteration_s"] is None, e["iteration_s"] or 0))
  if not fits:
    detail = (f"; the smallest shortfall: {min(short)[0] / GIB:.2f} GiB per chip over the "
              f"HBM with {min(short)[1]}") if short and min(short)[0] < math.inf else ""
    raise PlanError(f"no mesh of {topology}'s {chips} chips fits this config "
                    f"({len(short)} compiled and too large, {len(refused)} refused){detail}")
  return {"topology": topology, "fits": fits, "too_large": [n for _, n in sorted(short)],
          "refused": refused}


def main(argv=None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description="Compile a run's programs for a Cloud TPU "
                                   "topology on this machine and report per-chip memory")
  configlib.add_cli_args(parser)
  parser.add_argument("--topology", required=True,
                      help=f"e.g. {', '.join(KNOWN)}; or {LOCAL!r}: this process's devices "
                           "(with GSPO_PLAN_LOCAL=1 in the environment)")
  parser.add_argument("--json", action="store_true", help="print the report as JSON")
  parser.add_argument("--programs", default="",
                      help="comma-separated programs to compile (default: all); "
                           f"an iteration's are {','.join(ITERATION)}")
  parser.add_argument("--search", action="store_true",
                      help="plan every data x fsdp x tensor mesh of the chips; list those that "
                           "fit, fastest first")
  parser.add_argument("--search-remat", default="",
                      help="with --search, also try these model.remat values, e.g. full,dots,none")
  args = parser.parse_args(argv)
  only = tuple(p for p in args.programs.split(",") if p)
  try:
    unknown = set(only) - set(PROGRAMS)
    if unknown:
      raise PlanError(f"--programs: unknown {sorted(unknown)}; the programs are "
                      f"{', '.join(PROGRAMS)}")
    cfg = configlib.config_from_args(args, TrainConfig)
    if args.search:
      remats = tuple(r for r in args.search_remat.split(",") if r)
      found = search(cfg, args.topology, only, remats)
      print(json.dumps(found, indent=2) if args.json else "\n".join(
          f"{e['mesh']:32s} " + (f"{e['iteration_s']:.3f} s per iteration at the roofline"
                                 if e["iteration_s"] is not None else "fits")
          for e in found["fits"]))
      return found
    report = plan(cfg, args.topology, only)
  except ValueError as e:  # ConfigError and PlanError: named, nothing written
    raise SystemExit(f"plan error: {e}") from None
  print(json.dumps(report, indent=2) if args.json else format_report(report))
  if not report["fits"]:
    sys.exit(1)
  return report


PROGRAMS = ("init", "sample", "prepare", "update", "greedy", "sft")

if __name__ == "__main__":
  main()
