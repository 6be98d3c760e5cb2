"""The curated mutant list of tools/mutation.py stays applicable: every original snippet
occurs exactly once in its file and every test it names exists. Cheap (reads files, runs no
pytest subprocess), so a refactor that moves a mutated line fails here, not silently in the
next mutation run."""

import dataclasses
import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def mutation():
  # Loaded by path: tools/ is not a package and the tool is not part of gspo_jax.
  spec = importlib.util.spec_from_file_location("mutation", os.path.join(ROOT, "tools",
                                                                         "mutation.py"))
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # dataclasses resolve the module's annotations there
  spec.loader.exec_module(module)
  return module


def test_every_mutant_applies_exactly_once_and_names_existing_tests():
  m = mutation()
  assert m.check() == []
  assert len(m.MUTANTS) >= 40
  assert all(m.equivalent or m.tests for m in m.MUTANTS)


def test_the_check_finds_a_rotten_mutant():
  m = mutation()
  first = m.MUTANTS[0]
  rotten = [dataclasses.replace(first, original="no such code"),
            dataclasses.replace(first, name="twice", original="\n"),
            dataclasses.replace(first, name="gone", tests=("tests/train/test_streams.py::test_gone",)),
            first]
  problems = m.check(mutants=rotten)
  assert any("occurs 0 times" in p for p in problems)
  assert any(p.startswith("twice:") and "exactly once" in p for p in problems)
  assert any("test_gone not found" in p for p in problems)
  assert any("duplicate name" in p for p in problems)
