"""Calling NumPy on CachedArrays (NEP 13 / NEP 18 plumbing).

Every CachedArray among a call's arguments is converted to a pinned numpy view
(``out=`` arguments to writable views, everything else to readable ones) for
the duration of the call; numpy array results are copied into new CachedArrays
allocated through the policy of the (single) manager involved.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Any, Callable, Iterator

import numpy as np

from .array import CachedArray, Status, readable, writable


def _managers(tree: Any, found: set) -> None:
    if isinstance(tree, CachedArray):
        found.add(tree.manager)
    elif isinstance(tree, (list, tuple)):
        for item in tree:
            _managers(item, found)
    elif isinstance(tree, dict):
        for item in tree.values():
            _managers(item, found)


def _on_host(x: CachedArray, write: bool) -> np.ndarray:
    """NumPy runs on the host: a GPU-resident input ``x`` (or a pinned view of it) comes over as
    a copy; a GPU-resident output is refused."""
    if write:
        from .errors import StatusError
        raise StatusError("a GPU-resident CachedArray cannot be a NumPy out= argument; write it through "
                          "writable(x) (a CuPy view) or cachedarrays.assign, or evict it to a host device")
    return np.asarray(x)


def _pin(tree: Any, stack: ExitStack, write: bool) -> Any:
    if isinstance(tree, CachedArray):
        if tree._on_gpu():
            return _on_host(tree, write)
        if tree.status is Status.ReadWrite or (tree.status is Status.ReadOnly and not write):
            return tree.array
        if tree.status is Status.ReadOnly:
            from .errors import StatusError
            raise StatusError("cannot pass a ReadOnly view as an output; use writable(x)")
        pinned = writable(tree) if write else readable(tree)
        view = stack.enter_context(pinned)
        # a policy that inserts on use may have moved it to a GPU as it was pinned
        return view if isinstance(view, np.ndarray) else _on_host(pinned, write)
    if isinstance(tree, list):
        return [_pin(t, stack, write) for t in tree]
    if isinstance(tree, tuple):
        return tuple(_pin(t, stack, write) for t in tree)
    if isinstance(tree, dict):
        return {k: _pin(v, stack, write) for k, v in tree.items()}
    return tree


def _wrap_results(result: Any, manager, outs: tuple) -> Any:
    if isinstance(result, np.ndarray):
        for out_plain, out_cached in outs:
            if result is out_plain:
                return out_cached
        if result.ndim == 0:
            return result[()]
        return CachedArray(result, manager)
    if isinstance(result, tuple):
        return tuple(_wrap_results(r, manager, outs) for r in result)
    if isinstance(result, list):
        return [_wrap_results(r, manager, outs) for r in result]
    return result


def call_pinned(func: Callable, args: tuple, kwargs: dict) -> Any:
    """Run ``func(*args, **kwargs)`` with CachedArrays replaced by pinned views; wrap array results."""
    found: set = set()
    _managers((args, kwargs), found)
    if len(found) > 1:
        raise ValueError("arrays from two different managers in one operation; copy one side first")
    manager = found.pop()
    with ExitStack() as stack:
        out = kwargs.get("out")
        plain_kwargs = {k: v for k, v in kwargs.items() if k != "out"}
        outs: tuple = ()
        if out is not None:
            outs_cached = out if isinstance(out, tuple) else (out,)
            outs_plain = _pin(outs_cached, stack, write=True)
            outs = tuple(zip(outs_plain, outs_cached))
            plain_kwargs["out"] = outs_plain if isinstance(out, tuple) else outs_plain[0]
        plain_args = _pin(args, stack, write=False)
        plain_kwargs = _pin(plain_kwargs, stack, write=False) if out is None else {
            k: (v if k == "out" else _pin(v, stack, write=False)) for k, v in plain_kwargs.items()}
        result = func(*plain_args, **plain_kwargs)
        if isinstance(out, tuple) and isinstance(result, tuple) and len(result) == len(out):
            return out
        return _wrap_results(result, manager, outs)


@contextmanager
def pinned_values(tree: Any) -> Iterator[Any]:
    """Readable numpy views of every CachedArray in ``tree`` for the ``with`` block."""
    with ExitStack() as stack:
        yield _pin(tree, stack, write=False)
