"""Importing cachedarrays sets the OpenMP wait defaults the kernels were tuned with, unless the
user set them (they must be in the environment before numba's OpenMP runtime starts)."""

import os
import subprocess
import sys

import pytest

PRINT = "import os, cachedarrays; print(os.environ['OMP_WAIT_POLICY'], os.environ['GOMP_SPINCOUNT'])"


@pytest.mark.parametrize("user, want", [({}, "PASSIVE 3000"),
                                        ({"GOMP_SPINCOUNT": "0", "OMP_WAIT_POLICY": "ACTIVE"}, "ACTIVE 0")])
def test_wait_policy_defaults_and_user_values_win(user, want):
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", PRINT], env={**env, **user}, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == want.split()
