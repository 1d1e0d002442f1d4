"""Annotations: apply policy hints to every CachedArray inside arbitrary program structures.

`onobjects(f, tree)` finds the CachedArrays in ``tree`` — through tuples, lists,
sets, dicts, dataclasses, functions' captured cells (closures), bound methods,
``functools.partial`` and JAX pytrees — and calls ``f`` once per object.  The
hints (`prefetch`, `evict`, `softevict`, `unsafe_free`), `cleanup` and
`noescape` are built on it (Section 4.5.2).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import types
from typing import Any, Callable, Iterator

import numpy as np

from .array import CachedArray
from .manager import Manager

_ATOMS = (str, bytes, bytearray, int, float, complex, bool, type(None), np.ndarray, np.generic, type,
          types.ModuleType)


def _children(x: Any) -> Iterator[Any]:
    if isinstance(x, (list, tuple, set, frozenset)):
        yield from x
    elif isinstance(x, dict):
        yield from x.values()
    elif dataclasses.is_dataclass(x) and not isinstance(x, type):
        for field in dataclasses.fields(x):
            yield getattr(x, field.name)
    elif isinstance(x, types.FunctionType):
        for cell in x.__closure__ or ():
            try:
                yield cell.cell_contents
            except ValueError:  # empty cell
                pass
    elif isinstance(x, types.MethodType):
        yield x.__self__
        yield x.__func__
    elif isinstance(x, functools.partial):
        yield x.func
        yield from x.args
        yield from x.keywords.values()
    elif "jax" in sys.modules:  # only a registered pytree node can have children here
        import jax
        leaves = jax.tree_util.tree_leaves(x, is_leaf=lambda y: y is not x)
        if not (len(leaves) == 1 and leaves[0] is x):
            yield from leaves


def cached_arrays(tree: Any) -> Iterator[CachedArray]:
    """Every CachedArray in ``tree`` (first occurrence per object), depth first."""
    seen_nodes: set[int] = set()
    seen_objects: set[int] = set()
    stack = [tree]
    while stack:
        x = stack.pop()
        kind = type(x)
        if kind is CachedArray or isinstance(x, CachedArray):
            if x.object.id not in seen_objects:
                seen_objects.add(x.object.id)
                yield x
            continue
        if kind is tuple or kind is list:  # the common containers, without `_children`'s dispatch
            if id(x) not in seen_nodes:
                seen_nodes.add(id(x))
                stack.extend(x[::-1])
            continue
        if isinstance(x, _ATOMS) or id(x) in seen_nodes:
            continue
        seen_nodes.add(id(x))
        stack.extend(reversed(list(_children(x))))


def onobjects(f: Callable[[CachedArray], Any], tree: Any) -> None:
    """Call ``f(array)`` once for each distinct object among the CachedArrays in ``tree``."""
    for x in cached_arrays(tree):
        f(x)


def _live(xs: tuple) -> Iterator[CachedArray]:
    for x in cached_arrays(xs):
        if x.object.alive:
            yield x


def prefetch(*xs: Any, force: bool = False, to: Any = None) -> None:
    """Ask the policy to move every array in ``xs`` (arrays or pytrees) up to level ``to``
    (a device or its name; default: the policy's choice, normally the fast device).

    Returns at once; the copies run in the background and each array's next use waits for its own.
    """
    for x in cached_arrays(xs):
        if to is None:
            x.policy.prefetch(x.object, force=force)
        else:
            x.policy.prefetch(x.object, force=force, to=_device(x, to))


def evict(*xs: Any, to: Any = None) -> None:
    """Move every array in ``xs`` down to level ``to`` (default: the policy's choice, normally the
    next level) now; dirty data is written back asynchronously, clean data moves no bytes."""
    for x in cached_arrays(xs):
        if to is None:
            x.policy.evict(x.object)
        else:
            x.policy.evict(x.object, to=_device(x, to))


def _device(x: CachedArray, device: Any):
    name = device if isinstance(device, str) else getattr(device, "name", None)
    dev = x.manager.devices.get(name)
    if dev is None or (not isinstance(device, str) and dev is not device):
        raise ValueError(f"{device!r} is not a device of this array's manager (devices: {list(x.manager.devices)})")
    return dev


def softevict(*xs: Any) -> None:
    """Mark every array in ``xs`` as first to go when room is needed."""
    for x in cached_arrays(xs):
        x.policy.softevict(x.object)


def unsafe_free(*xs: Any) -> None:
    """Free every array in ``xs`` now (the policy may ignore it, as without mode M).

    Arrays already freed are skipped, so freeing is idempotent; the hints above
    raise `UseAfterFreeError` on freed arrays instead.
    """
    for x in _live(xs):
        x.policy.unsafe_free(x.object)


class Preserved(frozenset):
    """Object ids that `cleanup` must not free (see `preserve`). A program that already holds the
    ids of what it keeps (``x.object.id``) may build one from them, rather than have `preserve`
    walk the arrays again."""


def preserve(tree: Any) -> Preserved:
    """The set of objects in ``tree``, to pass as ``keep`` to `cleanup`."""
    return Preserved(x.object.id for x in cached_arrays(tree))


def cleanup(tree: Any, keep: Any = ()) -> int:
    """`unsafe_free` every array in ``tree`` except those in ``keep`` (a tree or a `preserve` result).

    Returns the number of objects handed to the policy.
    """
    kept = keep if isinstance(keep, Preserved) else preserve(keep)
    doomed = [x for x in _live((tree,)) if x.object.id not in kept]
    unsafe_free(doomed)
    return len(doomed)


def noescape(manager: Manager, f: Callable, *args: Any, **kwargs: Any) -> Any:
    """Call ``f(*args, **kwargs)``, then free the arrays it allocated that are not reachable from
    its result or its arguments (temporaries that would otherwise wait for the garbage collector)."""
    first = manager.next_id
    result = f(*args, **kwargs)
    born = {id_: obj for id_ in range(first, manager.next_id)  # only objects born during the call (Listing 4.8)
            if (obj := manager.getobject(id_)) is not None}
    if born:
        # the walk stops once every newborn is found reachable: the result comes first, where a
        # layer's outputs are, so its inputs and the rest of the arguments are seldom walked
        for x in cached_arrays((result, args, kwargs)):
            born.pop(x.object.id, None)
            if not born:
                break
    for obj in born.values():
        if not manager.pinned(obj):
            manager.policy.unsafe_free(obj)
    return result
