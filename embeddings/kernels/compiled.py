"""Keep numba's on-disk cache of compiled kernels in step with the kernel sources.

numba (``cache=True``) checks a cached kernel against its *own* source file only. The kernels
here inline functions from their sibling modules (row access, intrinsics, SIMD helpers), so an
edit to ``rowaccess.py`` would leave ``lookup.py``'s cached kernels running the old row access.
:func:`drop_stale` keys the whole directory's cache on a digest of every module in it: when any
source changed since the cache was written, all cached kernels of the directory are dropped and
recompile on first use.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

STAMP = "kernels.digest"


def sources_digest(directory: Path) -> str:
    """SHA-1 over the names and contents of the directory's ``.py`` files."""
    h = hashlib.sha1()
    for p in sorted(directory.glob("*.py")):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def drop_stale(directory: Path) -> bool:
    """Delete the directory's numba cache files (``__pycache__/*.nbi``, ``*.nbc``) when its
    sources changed since the last call; return whether anything was dropped. A read-only
    install (numba then caches elsewhere, per user) is left alone."""
    cache = directory / "__pycache__"
    stamp = cache / STAMP
    digest = sources_digest(directory)
    try:
        if stamp.read_text() == digest:
            return False
    except OSError:
        pass
    try:
        cache.mkdir(exist_ok=True)
        dropped = False
        for f in list(cache.glob("*.nbi")) + list(cache.glob("*.nbc")):
            f.unlink(missing_ok=True)
            dropped = True
        stamp.write_text(digest)
    except OSError:
        return False
    return dropped
