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
(`collective_bytes`; the sampler's early-exit decode loop counts once and is flagged).
FLOPs and roofline times are not computed yet.
Multi-turn episode programs are not planned (their host loop sits between them).
"""

from __future__ import annotations

import os

# libtpu, loaded for the topology, looks for a TPU VM's metadata unless told it is not on
# one; the planner itself runs on the CPU backend.
for _name, _value in (("JAX_PLATFORMS", "cpu"), ("TPU_SKIP_MDS_QUERY", "1"),
                      ("TPU_ACCELERATOR_TYPE", "v5litepod-4"),
                      ("TPU_WORKER_HOSTNAMES", "localhost")):
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

from gspo_jax import configlib, optim, programs, sharding  # noqa: E402
from gspo_jax.config import TrainConfig  # noqa: E402

GIB = 2 ** 30
LIBTPU = "libtpu==0.0.42.1"   # the version jax[tpu]==0.10.2 pins


@dataclasses.dataclass(frozen=True)
class Chip:
  """Published per-chip figures (Cloud TPU spec sheets), for the verdict and, later, the
  roofline."""
  hbm_gib: float
  bf16_tflops: float
  hbm_gbs: float


CHIPS = {"v4": Chip(32, 275, 1200), "v5e": Chip(16, 197, 819), "v5p": Chip(95, 459, 2765),
         "v6e": Chip(32, 918, 1640)}
# Topologies compiled here (any GEN:AxB[xC] of a generation above is tried).
KNOWN = ("v5e:2x2", "v5e:4x4", "v5e:16x16", "v5p:2x2x2", "v5p:4x4x4", "v6e:2x2", "v6e:8x8",
         "v4:2x2x2")
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
               "collective-permute")


class PlanError(ValueError):
  """A plan refused before anything was compiled (topology, mesh, libtpu, config)."""


def topology_devices(name: str):
  """The compile-only devices of a Cloud TPU topology `GEN:AxB[xC]`."""
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


class _ShapeTokenizer:
  """What the programs take from a tokenizer: ids only (the planner trains none)."""

  def __init__(self, vocab_size: int):
    self.vocab_size, self.pad_id, self.eos_id, self.bos_id = vocab_size, 0, 1, 2



def _model_cfg(cfg: TrainConfig):
  """The model a run trains: `model`, or `pretrained`'s as `run.setup` loads it."""
  if not cfg.pretrained:
    return cfg.model
  from gspo_jax.models import hf
  from gspo_jax.run import pretrained_load_args
  return hf.model_config(cfg.pretrained, **pretrained_load_args(cfg))


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
  rollout, _ = jax.eval_shape(progs.sample, layout.params, prompts, lens, state.key, step)
  rollout = sharding.abstract_rows(rollout, mesh)
  ref = layout.params if cfg.loss.kl_coef else None
  batch = sharding.abstract_rows(
      jax.eval_shape(progs.prepare, layout.params, ref, rollout, prompts, lens), mesh)
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


def _collectives(hlo: str) -> dict[str, int]:
  """Collective ops in the partitioned HLO, by kind (static: a loop body counts once)."""
  return {kind: len(re.findall(rf"= \S+ {kind}(-start)?\(", hlo)) for kind in COLLECTIVES}


_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2,
                "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}


def _shape_bytes(shape: str) -> int:
  """Bytes of an HLO result type: `f32[16,13,8]{...}` or a tuple of such."""
  total = 0
  for dtype, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", shape):
    if dtype in _DTYPE_BYTES:
      total += _DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
  return total


def collective_bytes(hlo: str) -> dict[str, Any]:
  """Result bytes of each kind of collective per chip, each op weighted by how often it
  runs: the product of the trip counts of the loops around it. A loop's trip count is read
  from its condition (`counter < constant`, as `lax.scan` and `fori_loop` compile); a loop
  whose condition is anything else (the sampler's decode loop, which exits early) counts
  once and is listed under `dynamic_loops`."""
  comps: dict[str, str] = {}
  for m in re.finditer(r"^(ENTRY )?%(\S+) [^\n]*\{\n(.*?)\n\}", hlo, re.S | re.M):
    comps[m.group(2)] = m.group(3)
    if m.group(1):
      entry = m.group(2)
  calls: dict[str, list[tuple[str, int]]] = {name: [] for name in comps}
  dynamic = 0
  for name, body in comps.items():
    for line in body.splitlines():
      loop = re.search(r"\bwhile\(.*condition=%([\w.\-]+), body=%([\w.\-]+)", line)
      if loop:
        cond, loop_body = loop.groups()
        trips = re.search(r"ROOT \S+ = pred\[\]\S* compare\(%[\w.\-]+, %([\w.\-]+)\), "
                          r"direction=LT", comps.get(cond, ""))
        bound = trips and re.search(rf"%{re.escape(trips.group(1))} = s32\[\]\S* "
                                    r"constant\((\d+)\)", comps.get(cond, ""))
        n = int(bound.group(1)) if bound else 1
        dynamic += not bound
        calls[name].append((loop_body, n))
        continue
      for callee in re.findall(r"(?:calls|to_apply|body)=%([\w.\-]+)", line):
        calls[name].append((callee, 1))
      for group in re.findall(r"branch_computations=\{([^}]*)\}", line):
        calls[name] += [(c.strip().lstrip("%"), 1) for c in group.split(",")]
  weight: dict[str, int] = {}

  def visit(name: str, w: int) -> None:
    weight[name] = weight.get(name, 0) + w
    for callee, n in calls.get(name, ()):
      if callee in comps:
        visit(callee, w * n)

  visit(entry, 1)
  out = {kind: 0 for kind in COLLECTIVES}
  for name, body in comps.items():
    for kind in COLLECTIVES:
      for shape in re.findall(rf"= (\S+(?: \S+)*?) {kind}(?:-start)?\(", body):
        out[kind] += weight.get(name, 0) * _shape_bytes(shape)
  return {**out, "dynamic_loops": dynamic}


def plan(cfg: TrainConfig, topology: str) -> dict[str, Any]:
  """Compile the run's programs for `topology`; the report (see the module docstring).
  PlanError for a topology, mesh, batch or libtpu that cannot be planned."""
  from flax import nnx
  from gspo_jax.models.transformer import Transformer
  if cfg.lora.rank:  # refused before libtpu is asked for anything
    raise PlanError("lora.rank > 0: the planner compiles a full run's programs; a LoRA run "
                    "(adapters on a frozen base) is not planned yet")
  devices = topology_devices(topology)
  chip = CHIPS[topology.partition(":")[0]]
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
  progs = programs.make_programs(graphdef, tx, cfg, layout, _ShapeTokenizer(model_cfg.vocab_size))
  report: dict[str, Any] = {
      "topology": topology, "chips": len(devices), "mesh": dict(mesh.shape),
      "hbm_per_chip_gib": chip.hbm_gib, "param_bytes": _bytes(layout.params),
      "param_bytes_per_chip": _bytes(layout.params, per_chip=True), "programs": {}}
  # TPU executables compiled without a TPU client cannot be read back from JAX's persistent
  # compilation cache: keep them out of it (restored below). JAX decides once per process
  # whether the cache is used, so the decision is reset on the way in and out.
  from jax._src import compilation_cache
  cache = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  compilation_cache.reset_cache()
  try:
    report["programs"] = _compile_all(cfg, layout, progs, chip)
  finally:
    jax.config.update("jax_enable_compilation_cache", cache)
    compilation_cache.reset_cache()
  report["fits"] = all(p["fits"] for p in report["programs"].values())
  return report


def _compile_all(cfg: TrainConfig, layout, progs, chip: Chip) -> dict[str, Any]:
  out = {}
  for name, args in program_inputs(cfg, layout, progs).items():
    t0 = time.perf_counter()
    entry: dict[str, Any] = {}
    try:
      compiled = getattr(progs, name).lower(*args).compile()
    except Exception as e:  # noqa: BLE001 - XLA refuses a program that cannot fit
      if not re.search(r"resource_exhausted|hbm|out of memory", str(e), re.I):
        raise
      entry.update(fits=False, error=str(e).splitlines()[0][:300])
    else:
      hlo = compiled.as_text()
      entry.update(_memory(compiled), collectives=_collectives(hlo),
                   collective_bytes=collective_bytes(hlo))
      entry["fits"] = entry["peak"] <= chip.hbm_gib * GIB
    entry["compile_s"] = round(time.perf_counter() - t0, 2)
    out[name] = entry
  return out


def format_report(report: dict[str, Any]) -> str:
  gib = lambda b: f"{b / GIB:8.3f}"
  lines = [f"{report['topology']}: {report['chips']} chips, mesh {report['mesh']}, "
           f"{report['hbm_per_chip_gib']} GiB HBM per chip; parameters "
           f"{report['param_bytes'] / GIB:.3f} GiB, {report['param_bytes_per_chip'] / GIB:.3f} "
           "GiB per chip",
           f"{'program':8s} {'args':>8s} {'output':>8s} {'donated':>8s} {'temp':>8s} "
           f"{'code':>8s} {'peak':>8s}  GiB per chip   compile  {'traffic':>8s}  "
           "collectives (static count)"]
  for name, p in report["programs"].items():
    if "peak" not in p:
      lines.append(f"{name:8s} does not fit: {p['error']}")
      continue
    coll = ", ".join(f"{k} {v}" for k, v in p["collectives"].items() if v) or "none"
    moved = sum(v for k, v in p["collective_bytes"].items() if k in COLLECTIVES)
    loops = p["collective_bytes"]["dynamic_loops"]
    lines.append(f"{name:8s} {gib(p['argument'])} {gib(p['output'])} {gib(p['alias'])} "
                 f"{gib(p['temp'])} {gib(p['code'])} {gib(p['peak'])}  "
                 f"{'fits' if p['fits'] else 'DOES NOT FIT':12s}  {p['compile_s']:6.1f} s  "
                 f"{gib(moved)}{'+' if loops else ' '} {coll}")
  worst = [n for n, p in report["programs"].items() if not p["fits"]]
  lines.append("traffic: GiB per chip of collective results, each weighted by the trip counts "
               "of its loops ('+': a loop with an early exit, the decode loop, counted once)")
  lines.append("verdict: every program fits" if not worst else
               f"verdict: does not fit ({', '.join(worst)} over "
               f"{report['hbm_per_chip_gib']} GiB per chip)")
  return "\n".join(lines)


def main(argv=None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description="Compile a run's programs for a Cloud TPU "
                                   "topology on this machine and report per-chip memory")
  configlib.add_cli_args(parser)
  parser.add_argument("--topology", required=True, help=f"e.g. {', '.join(KNOWN)}")
  parser.add_argument("--json", action="store_true", help="print the report as JSON")
  args = parser.parse_args(argv)
  try:
    cfg = configlib.config_from_args(args, TrainConfig)
    report = plan(cfg, args.topology)
  except ValueError as e:  # ConfigError and PlanError: named, nothing written
    raise SystemExit(f"plan error: {e}") from None
  print(json.dumps(report, indent=2) if args.json else format_report(report))
  if not report["fits"]:
    sys.exit(1)
  return report


if __name__ == "__main__":
  main()
