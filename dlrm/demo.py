"""``python -m dlrm.demo``: one minute of DLRM training on synthetic Zipf data with the embedding
tables under the ``dynamic`` policy (CachedEmbeddings: rows cached in DRAM on access, the full
tables in a PM heap file in a temporary directory), then the summary: time per phase, cache hit
rates, bytes moved between devices and peak memory per device. Extra arguments go to
``dlrm.train``.
"""

from __future__ import annotations

import sys


DEMO_ARGS = [
    "--arch-embedding-size", "400000-200000-100000-50000-20000-10000-5000-1000",
    "--arch-sparse-feature-size", "16",
    "--arch-mlp-bot", "13-256-64-16", "--arch-mlp-top", "256-64-1",
    "--mini-batch-size", "1024", "--num-batches", "2000",
    "--num-indices-per-lookup", "4", "--index-distribution", "zipf",
    "--learning-rate", "0.1", "--cache-fraction", "0.1",
    "--print-freq", "250", "--test-freq", "500",
]


def main(argv: list[str] | None = None) -> dict:
    from . import train

    argv = list(sys.argv[1:] if argv is None else argv)
    policy = "dynamic"
    print(f"DLRM demo: synthetic Zipf data, policy {policy}, DRAM heap + PM heap file in a temporary directory",
          flush=True)
    return train.main(DEMO_ARGS + ["--policy", policy] + argv)


if __name__ == "__main__":
    main()
