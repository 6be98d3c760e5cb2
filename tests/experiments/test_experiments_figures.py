"""The figures drawn from committed summaries (experiments/figures.py) and the shared drawings
of experiments/_plots.py, on the committed files and on small hand-made inputs."""

import os

import numpy as np

from experiments import _plots, figures
from experiments._tables import load


def test_every_summary_figure_is_redrawn(tmp_path):
  paths = figures.main(["--out", str(tmp_path)])
  assert len(paths) == len(set(paths)) >= 11
  for folder in ("gspo_vs_grpo", "gspo_vs_grpo_long", "stability_map", "multiturn_tools"):
    assert os.path.getsize(tmp_path / folder / "paired.png") > 0
  assert os.path.getsize(tmp_path / "stability_map" / "stability_map.png") > 0
  assert os.path.getsize(tmp_path / "routing_replay_long" / "ratio_extremes.png") > 0


def test_stability_cells_count_collapsed_seeds():
  cells = figures.stability_cells(load("stability_map"))
  assert len(cells) == 36
  medium = {loss: cells[("medium", loss, 1e-4, 16)] for loss in ("gspo", "grpo")}
  summary = load("stability_map")["cells"]
  for loss, cell in medium.items():
    raw = summary[f"medium/{loss}_mb16_lr0.0001"]
    assert cell["collapsed"] == raw["collapsed"] and len(cell["gains"]) == len(raw["seeds"])
    np.testing.assert_allclose(cell["gains"], np.subtract(raw["heldout_end"], raw["heldout_start"]))


def test_log_ratio_hist_marks_both_bands(tmp_path):
  rng = np.random.default_rng(0)
  path = _plots.log_ratio_hist(rng.normal(0, 0.01, 500), rng.normal(0, 0.001, 100), str(tmp_path))
  assert os.path.getsize(path) > 0


def test_paired_figure_with_one_seed_draws_no_interval(tmp_path):
  path = _plots.paired([("a − b", [0.5], [0.2]), ("c − d", [1, 2, 3], [0, 0, 0])],
                       str(tmp_path), "paired.png")
  assert os.path.getsize(path) > 0
