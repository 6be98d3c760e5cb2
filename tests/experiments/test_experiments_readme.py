"""experiments/README.md against the committed results: every table is either rendered from a
summary (and equal to the rendering) or marked as untraced, and every number the text quotes
from a summary is the one the summary gives (experiments/readme_tables.py,
experiments/_readme_quotes.py)."""

import os
import re

import pytest

from experiments import _readme_quotes, readme_tables

TEXT = open(readme_tables.README, encoding="utf-8").read()
MARKER = re.compile(r"<!-- (table: \w+|untraced: [^>]+|quoted: [^>]+) -->")


def squash(text: str) -> str:
  return re.sub(r"\s+", " ", text)


@pytest.mark.parametrize("name", sorted(readme_tables.TABLES))
def test_table_equals_its_rendering(name):
  tables = readme_tables.readme_tables(TEXT)
  assert name in tables, f"experiments/README.md has no <!-- table: {name} -->"
  assert tables[name] == readme_tables.TABLES[name](), (
      f"table {name} differs from its summary: python -m experiments.readme_tables --write")


def test_every_marker_names_a_known_table():
  assert set(readme_tables.readme_tables(TEXT)) <= set(readme_tables.TABLES)


def test_every_table_is_rendered_or_marked_untraced():
  """A markdown table's first row must follow a marker line: no table of hand-copied numbers
  can enter the README unmarked."""
  lines = re.sub(r"```.*?```", "", TEXT, flags=re.S).splitlines()
  for i, line in enumerate(lines):
    if line.startswith("|") and (i == 0 or not lines[i - 1].startswith("|")):
      assert i and MARKER.fullmatch(lines[i - 1]), f"unmarked table: {line[:80]}"


def test_untraced_tables_mark_their_numbers():
  """Every untraced table says which of its columns are untraced (‡ in the header)."""
  for block in re.findall(r"<!-- untraced: [^>]+ -->\n(\|.*)\n", TEXT):
    assert "‡" in block, block


@pytest.mark.parametrize("quote", _readme_quotes.quotes())
def test_quoted_number_is_in_the_text(quote):
  assert squash(quote) in squash(TEXT), f"experiments/README.md does not say {quote!r}"


def test_a_changed_summary_value_is_caught(monkeypatch):
  """Edit one value of a loaded summary: its table no longer matches the README."""
  from experiments import _tables
  real = _tables.load

  def edited(name):
    out = real(name)
    if name == "gspo_vs_grpo":
      out["gspo"]["heldout_end"][0] += 0.01
    return out

  monkeypatch.setattr(readme_tables, "load", edited)
  assert readme_tables.TABLES["gspo_vs_grpo"]() != readme_tables.readme_tables(TEXT)["gspo_vs_grpo"]


def test_readme_check_command_passes():
  assert readme_tables.main(["--check"]) == 0


def test_results_it_reads_are_committed_files():
  for name in ("gspo_vs_grpo", "stability_map", "routing_replay_long"):
    assert os.path.exists(os.path.join(readme_tables._results.RESULTS, name, "summary.json"))
