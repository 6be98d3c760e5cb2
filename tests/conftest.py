"""Test setup: 8 simulated CPU devices, strict rank promotion, float32 and float64 runs,
unoptimised (fast to compile) XLA CPU code.

The device count must be fixed before JAX initialises its backend, so it is set here,
at import time, before anything imports jax.
"""

import os
from importlib import metadata

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()


def _default_xla_flag(name, value):
  if name not in os.environ["XLA_FLAGS"]:  # flags you export yourself win
    os.environ["XLA_FLAGS"] += f" --{name}={value}"


# The suite's time goes to cold XLA compiles of small programs, not to running them.
# Unoptimised LLVM code and XLA CPU's older (non-MLIR) fusion emitters make each compile
# two to four times faster; the suite passes either way. XLA aborts on a flag it does not know, so
# the emitter flag is only set for the jaxlib series it was tested with (requirements.txt).
_default_xla_flag("xla_backend_optimization_level", 0)
if metadata.version("jaxlib").startswith("0.10."):
  _default_xla_flag("xla_cpu_use_fusion_emitters", "false")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Persistent compilation cache: reruns of the suite skip most XLA compiles. Set in the
# environment too, so the processes the tests start (the command line, fault and
# two-process tests) read and write the same cache.
_CACHE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".jax_cache")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

# Broadcasting adv_B against logp_BxT by accident is exactly where GRPO/GSPO bugs hide.
jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def pytest_configure(config):
  config.addinivalue_line("markers", "slow: slower tests (still run in CI)")


@pytest.fixture(scope="session", autouse=True)
def _eight_devices():
  assert jax.device_count() == 8, f"expected 8 simulated CPU devices, got {jax.devices()}"


@pytest.fixture(params=["float32", "float64"])
def dtype(request):
  """Runs a test once in float32 and once with JAX_ENABLE_X64 semantics in float64."""
  x64 = request.param == "float64"
  previous = jax.config.jax_enable_x64
  jax.config.update("jax_enable_x64", x64)
  try:
    yield np.float64 if x64 else np.float32
  finally:
    jax.config.update("jax_enable_x64", previous)


@pytest.fixture
def tol(dtype):
  """assert_allclose tolerances for two computations of the same quantity in `dtype`."""
  return dict(rtol=1e-5, atol=1e-6) if dtype == np.float32 else dict(rtol=1e-12, atol=1e-13)


@pytest.fixture(scope="module")
def configured(run):
  """cfg -> run.reconfigure(cfg) for the requesting module's `run` fixture, built once per
  config for the module: a rebuilt run traces and builds its programs again."""
  runs = {run.cfg: run}

  def get(cfg):
    if cfg not in runs:
      runs[cfg] = run.reconfigure(cfg)
    return runs[cfg]
  return get
