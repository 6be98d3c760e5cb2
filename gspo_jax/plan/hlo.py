"""Reading a compiled program's HLO (`compiled.as_text()`, partitioned for its chips): the
collectives it runs and the bytes they move per chip, each weighted by the trip counts of
the loops around it (XLA's `cost_analysis` counts a loop body once)."""

from __future__ import annotations

import math
import re
from typing import Any

from gspo_jax.plan import cost as plan_cost

TOP_OPS = 4   # the largest collectives listed per program
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
               "collective-permute")


def static_counts(hlo: str) -> dict[str, int]:
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


def collective_bytes(hlo: str, devices: int = 1) -> dict[str, Any]:
  """Result bytes of each kind of collective per chip, each op weighted by how often it
  runs: the product of the trip counts of the loops around it. A loop's trip count is read
  from its condition (`counter < constant`, as `lax.scan` and `fori_loop` compile); a loop
  whose condition is anything else (the sampler's decode loop, which exits early) counts
  once and is listed under `dynamic_loops`. `wire`: the bytes each chip sends for them
  (`plan_cost.wire_bytes`; a group the HLO does not name is all `devices`)."""
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
  # TPU's asynchronous collectives repeat one op (one channel_id) in the fusions of each of
  # its steps, some of them scheduled inside a later loop's body: an op counts once, with
  # the smallest weight among its reachable copies (where it starts).
  found: dict[Any, tuple[int, str, str, int]] = {}
  for name, body in comps.items():
    for kind in COLLECTIVES:
      for shape, rest in re.findall(rf"= (\S+(?: \S+)*?) {kind}(?:-start)?\((.*)", body):
        w = weight.get(name, 0)
        if not w:
          continue
        channel = re.search(r"channel_id=(\d+)", rest)
        key = ("channel", channel.group(1)) if channel else (name, len(found))
        size, n, as_kind = _shape_bytes(shape), plan_cost.group_size(rest, devices), kind
        if kind == "all-reduce" and name.startswith("all-reduce-scatter"):
          # TPU writes a reduce-scatter as a fusion around an all-reduce: its result is
          # one chip's 1/n of the sum.
          size, as_kind = size // n, "reduce-scatter"
        wire = w * plan_cost.wire_bytes(as_kind, size, n)
        op = (w * size, as_kind, re.sub(r"\{[^}]*\}", "", shape), w, wire)
        found[key] = min(found.get(key, op), op)
  out = {kind: 0 for kind in COLLECTIVES}
  for moved, kind, *_ in found.values():
    out[kind] += moved
  top = [{"kind": k, "shape": s, "times": n, "bytes": b}
         for b, k, s, n, _ in sorted(found.values(), reverse=True)[:TOP_OPS] if b]
  return {**out, "dynamic_loops": dynamic, "largest": top,
          "wire": sum(op[-1] for op in found.values())}
