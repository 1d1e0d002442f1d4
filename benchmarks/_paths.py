"""Import first in a benchmark that imports a package whose name is also a benchmark's file name.

Python puts the script's folder first on ``sys.path``, so ``import embeddings`` would find
``benchmarks/embeddings.py`` instead of the package.  This puts the project root first and the
benchmarks folder last: packages resolve to the project, and ``_common`` is still found.
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
sys.path[:] = [_ROOT] + [p for p in sys.path if os.path.abspath(p or ".") not in (_HERE, _ROOT)] + [_HERE]
