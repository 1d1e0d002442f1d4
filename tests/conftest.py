"""Shared fixtures: small managers over a DRAM heap and a PM file in pytest's tmp_path."""

import gc
import os
import shutil
import tempfile

import pytest
from hypothesis import HealthCheck, settings

from cachedarrays import DRAM, PM, Manager

settings.register_profile("ci", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci")

JAX_CACHE = "JAX_COMPILATION_CACHE_DIR"


def pytest_configure(config):
    """One JAX compilation cache for the run's processes, in a temporary folder (unless the user
    chose one): the xdist workers share the CNN and DLRM tests and would otherwise each compile
    the same module-level jits (``test_cnn.py`` on two workers: 117 s without it, 105 s with it).
    Set in the environment before the workers start, which JAX reads when they import it."""
    if os.environ.get("PYTEST_XDIST_WORKER") or JAX_CACHE in os.environ:
        return
    config.jax_cache = tempfile.mkdtemp(prefix="cachedarrays-jax-cache-")
    wanted = {JAX_CACHE: config.jax_cache, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
              "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    config.jax_env = {k: v for k, v in wanted.items() if k not in os.environ}  # a user's own settings stay
    os.environ.update(config.jax_env)


def pytest_unconfigure(config):
    """Remove the cache folder and the variables :func:`pytest_configure` set."""
    path = getattr(config, "jax_cache", None)
    if path is None:
        return
    shutil.rmtree(path, ignore_errors=True)
    for k, v in config.jax_env.items():
        if os.environ.get(k) == v:
            del os.environ[k]


@pytest.fixture
def manager(tmp_path):
    m = Manager(DRAM("1MiB"), PM(tmp_path, "4MiB"))
    yield m
    m.check()
    m.close()


@pytest.fixture
def young_gc():
    """Make ``gc.collect()`` inside the test scan only the objects the test created.

    The manager and policy tests call ``gc.collect()`` after dropping references (to check that
    unreachable arrays are freed); each call walks every object in the process, and after the
    JAX, torch and numba tests that is hundreds of thousands, which made these stateful tests
    ~10-25x slower inside the whole suite than alone. Everything older is frozen (moved out of
    the collector's generations) for the duration of the test and thawed afterwards.
    """
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()
