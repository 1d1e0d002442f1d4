"""Shared fixtures: small managers over a DRAM heap and a PM file in pytest's tmp_path."""

import gc

import pytest
from hypothesis import HealthCheck, settings

from cachedarrays import DRAM, PM, Manager

settings.register_profile("ci", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci")


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
