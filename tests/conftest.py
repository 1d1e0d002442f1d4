"""Shared fixtures: small managers over a DRAM heap and a PM file in pytest's tmp_path."""

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
