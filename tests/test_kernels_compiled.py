"""numba's cached kernels are dropped when any kernel module changes (numba checks only each
kernel's own file, and the kernels inline their siblings' helpers)."""

from embeddings.kernels.compiled import STAMP, drop_stale


def _cached(d):
    (d / "__pycache__").mkdir(exist_ok=True)
    for name in ("lookup.f-1.py311.nbi", "lookup.f-1.py311.1.nbc"):
        (d / "__pycache__" / name).write_bytes(b"x")


def _left(d):
    return sorted(p.name for p in (d / "__pycache__").iterdir() if p.suffix in (".nbi", ".nbc"))


def test_cache_dropped_only_when_a_sibling_source_changes(tmp_path):
    (tmp_path / "lookup.py").write_text("def f(): pass\n")
    (tmp_path / "rowaccess.py").write_text("def g(): return 1\n")
    _cached(tmp_path)
    assert drop_stale(tmp_path)  # no stamp yet: whatever is cached may be stale
    assert _left(tmp_path) == [] and (tmp_path / "__pycache__" / STAMP).exists()
    _cached(tmp_path)
    assert not drop_stale(tmp_path)  # sources unchanged: the cache stays
    assert len(_left(tmp_path)) == 2
    (tmp_path / "rowaccess.py").write_text("def g(): return 2\n")  # a callee changed, lookup.py did not
    assert drop_stale(tmp_path)
    assert _left(tmp_path) == []
    _cached(tmp_path)
    assert not drop_stale(tmp_path)
    assert len(_left(tmp_path)) == 2


def test_unusable_cache_directory_is_left_alone(tmp_path):
    """Where ``__pycache__`` cannot hold files (here it is a plain file; a read-only install is
    the real case) nothing is dropped and importing the kernels does not fail."""
    (tmp_path / "k.py").write_text("x = 1\n")
    (tmp_path / "__pycache__").write_text("not a directory")
    assert drop_stale(tmp_path) is False
    assert (tmp_path / "__pycache__").read_text() == "not a directory"
