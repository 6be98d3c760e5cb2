"""The package's layout: no import cycle (module-level or inside functions), every module
within ~400 lines, and every module importable on its own."""

import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "gspo_jax")
MAX_LINES = 420  # "about 400"


def modules() -> dict[str, str]:
  """Dotted module name -> file, for every .py file of the package."""
  out = {}
  for folder, _, files in os.walk(PACKAGE):
    for f in files:
      if f.endswith(".py"):
        path = os.path.join(folder, f)
        name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
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
  # `import a.b.c` also runs a and a.b; a package's __init__ is not an edge we care about.
  return {m for m in found if m in known and m != name and m != "gspo_jax"}


def test_no_import_cycle():
  mods = modules()
  known = set(mods)
  graph = {name: imports_of(name, path, known) for name, path in mods.items()}
  state: dict[str, str] = {}

  def visit(node, stack):
    state[node] = "open"
    for nxt in sorted(graph[node]):
      if state.get(nxt) == "open":
        cycle = stack[stack.index(nxt):] + [nxt] if nxt in stack else [node, nxt]
        pytest.fail("import cycle: " + " -> ".join(cycle))
      if nxt not in state:
        visit(nxt, stack + [nxt])
    state[node] = "done"

  for name in sorted(graph):
    if name not in state:
      visit(name, [name])


def test_the_cycle_check_can_fail(tmp_path, monkeypatch):
  # Two modules that import each other inside functions: the check above must see it.
  pkg = tmp_path / "gspo_jax"
  pkg.mkdir()
  (pkg / "__init__.py").write_text("")
  (pkg / "a.py").write_text("def f():\n  from gspo_jax import b\n")
  (pkg / "b.py").write_text("from gspo_jax.a import f\n")
  monkeypatch.setattr(sys.modules[__name__], "PACKAGE", str(pkg))
  monkeypatch.setattr(sys.modules[__name__], "ROOT", str(tmp_path))
  with pytest.raises(pytest.fail.Exception, match="import cycle"):
    test_no_import_cycle()


def test_modules_stay_small():
  long = {os.path.relpath(p, ROOT): n for p in modules().values()
          if (n := sum(1 for _ in open(p))) > MAX_LINES}
  assert not long, f"modules over {MAX_LINES} lines: {long}"


@pytest.mark.parametrize("name", ["gspo_jax.train", "gspo_jax.evaluate", "gspo_jax.coldstart",
                                  "gspo_jax.run", "gspo_jax.generate", "gspo_jax.fused",
                                  "gspo_jax.plan"])
def test_entry_points_import_alone(name):
  subprocess.run([sys.executable, "-c", f"import {name}"], check=True, cwd=ROOT,
                 env={**os.environ, "JAX_PLATFORMS": "cpu"})
