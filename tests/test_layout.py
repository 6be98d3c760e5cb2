"""The package's layout: subpackages by concern that import only downwards (the rules table
below, also in docs/adding_a_feature.md), no import cycle (module-level or inside functions),
every module within 450 lines, every subpackage saying what it may import, and every entry
point importable on its own."""

import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "gspo_jax")
MAX_LINES = 450

# What each part of the package may import from the rest of it: subpackages and the
# top-level modules, lowest first. An entry names a whole part ("models") or one module
# ("lora.adapters"). Nothing imports upwards; the few modules that join a feature to the run
# are listed in JOINS, each with its reason.
ALLOWED = {
    "utils": set(),
    "objectives": {"utils"},
    "parallel": {"utils"},
    "models": {"parallel", "utils"},
    "tasks": {"utils"},
    "rollout": {"models", "parallel", "utils"},
    "config": {"objectives", "parallel", "models", "tasks", "utils", "lora.adapters"},
    "lora": {"models", "parallel", "utils"},
    "train": {"config", "objectives", "rollout", "models", "tasks", "parallel", "utils",
              "lora.adapters", "lora.quant"},
    "multiturn": {"config", "objectives", "rollout", "models", "tasks", "parallel", "utils",
                  "train.programs", "train.collect"},
    "plan": {"config", "objectives", "rollout", "models", "tasks", "parallel", "utils", "lora",
             "train", "multiturn"},
    # the package's face and the command-line tools beside train and plan
    "__init__": {"objectives", "models"},
    "evaluate": {"train", "tasks", "parallel", "utils"},
    "generate": {"models", "rollout", "tasks", "parallel", "utils"},
    "demo": {"objectives", "models", "utils"},
}
JOINS = {
    # a run's setup chooses its kind: LoRA or full, multi-turn episodes or groups
    "train.run": {"lora.run", "multiturn.rollout", "multiturn.envs"},
    # the loop restores a LoRA run's frozen base and starts RL from its cold start
    "train.loop": {"lora.run"},
    # what a LoRA run does differently is built from the run's own programs and checkpoints
    "lora.run": {"config", "rollout", "train.checkpoint", "train.coldstart", "train.optim",
                 "train.programs", "train.step"},
    # the export command loads a run directory
    "lora.export": {"train.run"},
}


def modules(package=None) -> dict[str, str]:
  """Dotted module name -> file, for every .py file of the package."""
  package = package or PACKAGE
  root = os.path.dirname(package)
  out = {}
  for folder, _, files in os.walk(package):
    for f in files:
      if f.endswith(".py"):
        path = os.path.join(folder, f)
        name = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
        out[name.removesuffix(".__init__")] = path
  return out


def imports_of(name: str, path: str, known: set[str]) -> set[str]:
  """The package modules `name` imports anywhere in its file (functions included)."""
  package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
  found = set()
  for node in ast.walk(ast.parse(open(path).read())):
    if isinstance(node, ast.Import):
      found |= {a.name for a in node.names}
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        parts = package.split(".")[:len(package.split(".")) - node.level + 1]
        base = ".".join(parts + ([base] if base else []))
      found.add(base)
      found |= {f"{base}.{a.name}" for a in node.names}  # `from pkg import module`
  # `import a.b.c` also runs a and a.b; a package's __init__ is not an edge we care about
  # unless it is all there is (`from gspo_jax.tasks import make_task`).
  out = {m for m in found if m in known and m != name and m != "gspo_jax"}
  return {m for m in out if not any(o.startswith(m + ".") for o in out)}


def part(module: str) -> str:
  """'gspo_jax.train.step' -> 'train'; 'gspo_jax.config' -> 'config'; 'gspo_jax' -> '__init__'."""
  parts = module.split(".")
  return parts[1] if len(parts) > 1 else "__init__"


def short(module: str) -> str:
  return module.removeprefix("gspo_jax.")


def graph(package=None) -> dict[str, set[str]]:
  mods = modules(package)
  return {name: imports_of(name, path, set(mods)) for name, path in mods.items()}


def upward_imports(g) -> list[str]:
  bad = []
  for name, deps in sorted(g.items()):
    allowed = ALLOWED[part(name)] | JOINS.get(short(name), set())
    for dep in sorted(deps):
      if part(dep) == part(name):
        continue
      if part(dep) in allowed or any(short(dep) == a or short(dep).startswith(a + ".")
                                     for a in allowed):
        continue
      bad.append(f"{short(name)} imports {short(dep)}")
  return bad


def test_every_part_is_in_the_rules_table():
  parts = {part(m) for m in modules()}
  assert parts == set(ALLOWED), (parts ^ set(ALLOWED))


def test_imports_go_downwards_only():
  bad = upward_imports(graph())
  assert not bad, "imports the rules table (tests/test_layout.py ALLOWED) does not allow:\n" + \
      "\n".join(bad)


def test_the_rules_check_can_fail():
  g = graph()
  g["gspo_jax.objectives.losses"] = g["gspo_jax.objectives.losses"] | {"gspo_jax.models.logprobs"}
  g["gspo_jax.rollout.sampling"] = g["gspo_jax.rollout.sampling"] | {"gspo_jax.train.step"}
  assert upward_imports(g) == ["objectives.losses imports models.logprobs",
                               "rollout.sampling imports train.step"]


def find_cycle(g) -> list[str] | None:
  state: dict[str, str] = {}

  def visit(node, stack):
    state[node] = "open"
    for nxt in sorted(g[node]):
      if state.get(nxt) == "open":
        return stack[stack.index(nxt):] + [nxt]
      if nxt not in state:
        found = visit(nxt, stack + [nxt])
        if found:
          return found
    state[node] = "done"
    return None

  for name in sorted(g):
    if name not in state:
      found = visit(name, [name])
      if found:
        return found
  return None


def test_no_import_cycle():
  cycle = find_cycle(graph())
  assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_check_can_fail(tmp_path):
  # Two modules that import each other inside functions: the check above must see it.
  pkg = tmp_path / "gspo_jax"
  pkg.mkdir()
  (pkg / "__init__.py").write_text("")
  (pkg / "a.py").write_text("def f():\n  from gspo_jax import b\n")
  (pkg / "b.py").write_text("from gspo_jax.a import f\n")
  assert find_cycle(graph(str(pkg))) == ["gspo_jax.a", "gspo_jax.b", "gspo_jax.a"]


def test_modules_stay_small():
  long = {os.path.relpath(p, ROOT): n for p in modules().values()
          if (n := sum(1 for _ in open(p))) > MAX_LINES}
  assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_every_subpackage_says_what_it_is_and_what_it_may_import():
  for folder in sorted(os.listdir(PACKAGE)):
    init = os.path.join(PACKAGE, folder, "__init__.py")
    if os.path.isfile(init):
      doc = ast.get_docstring(ast.parse(open(init).read())) or ""
      assert "May import" in doc or folder == "tasks", f"gspo_jax/{folder}/__init__.py: {doc!r}"


@pytest.mark.parametrize("name", ["gspo_jax.train", "gspo_jax.train.__main__", "gspo_jax.evaluate",
                                  "gspo_jax.train.coldstart", "gspo_jax.train.run",
                                  "gspo_jax.generate", "gspo_jax.train.fused",
                                  "gspo_jax.plan.__main__", "gspo_jax.lora.export"])
def test_entry_points_import_alone(name):
  subprocess.run([sys.executable, "-c", f"import {name}"], check=True, cwd=ROOT,
                 env={**os.environ, "JAX_PLATFORMS": "cpu"})
