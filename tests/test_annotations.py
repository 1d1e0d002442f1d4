"""Annotations: traversal of program structures, cleanup/preserve, noescape, module-level hints."""

import dataclasses
import functools

import jax
import numpy as np
import pytest

import cachedarrays as ca
from cachedarrays import DRAM, PM, CachedArray, LRUPolicy, Manager, cleanup, noescape, onobjects, preserve


@pytest.fixture
def m():
    manager = Manager(DRAM("2MiB"), PM(None, "16MiB"), policy=LRUPolicy())
    yield manager
    manager.check()


@dataclasses.dataclass
class Layer:
    weight: object
    bias: object
    name: str = "dense"


@jax.tree_util.register_pytree_node_class
class Node:
    def __init__(self, children):
        self.children = children

    def tree_flatten(self):
        return self.children, None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children)


def test_onobjects_finds_every_array_once(m):
    xs = [CachedArray(np.full(4, i), m) for i in range(8)]
    closure_target = xs[5]

    def closure():
        return closure_target

    tree = {
        "tuple": (xs[0], [xs[1], {"deep": xs[2]}]),
        "layer": Layer(xs[3], xs[4]),
        "fn": closure,
        "partial": functools.partial(np.add, xs[6]),
        "pytree": Node([xs[7], 3.0]),
        "dup": [xs[0], ca.readable(xs[0])],
        "other": (np.ones(3), "text", 5),
    }
    seen = []
    onobjects(lambda x: seen.append(int(x[0])), tree)
    assert sorted(seen) == list(range(8))


def test_cleanup_frees_all_but_preserved(m):
    acts = [CachedArray(np.ones(100), m) for _ in range(4)]
    weights = CachedArray(np.ones(100), m)
    pullback_state = {"activations": acts, "weights": weights}
    n = cleanup(pullback_state, preserve(weights))
    assert n == 4 and all(not a.object.alive for a in acts) and weights.object.alive


def test_cleanup_respects_policy_without_mode_m():
    m = Manager(DRAM("1MiB"), PM(None, "4MiB"), policy=LRUPolicy(honor_frees=False))
    x = CachedArray(np.ones(10), m)
    cleanup([x])
    assert x.object.alive


def test_noescape_frees_only_temporaries(m):
    a = CachedArray(np.arange(1000.0), m)
    kept = {}

    def f(x):
        t1 = x * 2
        t2 = t1 + 1  # temporaries
        kept["t1"] = t1  # hidden from noescape: not reachable from the result or the arguments
        result = t2 - x
        return [result]

    before = len(m.objects())
    out = noescape(m, f, a)
    assert np.array_equal(np.asarray(out[0]), np.arange(1000.0) + 1)
    assert a.object.alive and out[0].object.alive
    assert not kept["t1"].object.alive  # noescape frees what is not reachable from the result or the args
    assert len(m.objects()) == before + 1


def test_noescape_keeps_newborns_reachable_only_through_the_arguments_or_deep_in_the_result(m):
    """The walk for reachable newborns may stop early only once every one is found: one stored
    into an argument, one deep in the result after an older array, and a temporary."""
    a = CachedArray(np.arange(10.0), m)
    box: dict = {}
    hidden = {}

    def f(x, out):
        out["made"] = x + 1  # reachable through the arguments only
        hidden["t"] = x * 3
        return (x, [{"deep": x * 2}])

    res = noescape(m, f, a, box)
    assert box["made"].object.alive and res[1][0]["deep"].object.alive and a.object.alive
    assert not hidden["t"].object.alive


def test_module_hints_accept_pytrees(m):
    xs = {"a": CachedArray(np.ones(1000), m), "b": [CachedArray(np.ones(1000), m)]}
    ca.evict(xs)
    assert all(not m.policy.in_fast(x.object) for x in (xs["a"], xs["b"][0]))
    ca.prefetch(xs)
    assert all(m.policy.in_fast(x.object) for x in (xs["a"], xs["b"][0]))
    ca.softevict(xs)
    ca.unsafe_free(xs)
    assert not xs["a"].object.alive and not xs["b"][0].object.alive
