"""The Criteo Kaggle Display Advertising format: parse, preprocess to a binary file, load batches.

Input lines are tab-separated: a 0/1 label, 13 integer features, 26 categorical features as
(up to) 8 hex digits. Empty fields are missing and read as 0; negative integers are clamped to 0;
integer features become ``log(x + 1)`` (float32). Categorical values are mapped per feature to
dense ids: hashing modulo ``max_ind_range`` when it is positive, otherwise a dictionary pass (the
sorted unique values of each feature over all input files, ``np.unique`` over the preprocessed
column, so no Python dict of millions of entries is ever built).

Files may be plain or gzip (detected by magic). Lines are streamed and converted in chunks of
``CHUNK`` records; a whole day is never held as Python objects. Malformed lines (wrong field
count, bad label, bad hex, non-numeric integers) are counted, the first ``MAX_EXAMPLES`` reported
with file and line number, and skipped; ``strict=True`` raises ``ValueError`` at the first one.

The preprocessed file is one 4 KiB header (magic ``DLRMCRT1`` and JSON metadata: record count,
table sizes, sources, the parse report) followed by fixed-size records (label f4, 13 x dense f4,
26 x sparse i4; 160 bytes) that :func:`read_processed` memory-maps.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from .batch import Batch

NUM_DENSE = 13
NUM_SPARSE = 26
NUM_FIELDS = 1 + NUM_DENSE + NUM_SPARSE
RECORD = np.dtype([("label", "<f4"), ("dense", "<f4", (NUM_DENSE,)), ("sparse", "<i4", (NUM_SPARSE,))])
MAGIC = b"DLRMCRT1"
HEADER = 4096
CHUNK = 1 << 16
MAX_EXAMPLES = 20
_HEX = b"0123456789abcdefABCDEF"


class MalformedLine(ValueError):
    pass


@dataclass
class ParseReport:
    """What preprocessing saw: lines read, records kept, malformed lines (first few with reasons)."""

    lines: int = 0
    records: int = 0
    malformed: int = 0
    examples: list[tuple[str, int, str]] = field(default_factory=list)

    def add_bad(self, path: str, lineno: int, reason: str) -> None:
        self.malformed += 1
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append((path, lineno, reason))

    def summary(self) -> str:
        s = f"{self.lines} lines, {self.records} records, {self.malformed} malformed lines skipped"
        for path, n, why in self.examples:
            s += f"\n  {path}:{n}: {why}"
        if self.malformed > len(self.examples):
            s += f"\n  ... and {self.malformed - len(self.examples)} more"
        return s

    def to_dict(self) -> dict:
        return {"lines": self.lines, "records": self.records, "malformed": self.malformed,
                "examples": [list(e) for e in self.examples]}


def open_text(path: str):
    """Open a plain or gzip file for binary line iteration (gzip detected by its magic bytes)."""
    with open(path, "rb") as f:
        magic = f.read(2)
    return gzip.open(path, "rb") if magic == b"\x1f\x8b" else open(path, "rb")


def parse_line(line: bytes, label_out: np.ndarray, dense_out: np.ndarray, sparse_out: np.ndarray) -> None:
    """Parse one line into the given record slots (raw 32-bit categorical values); raises MalformedLine."""
    f = line.rstrip(b"\r\n").split(b"\t")
    if len(f) != NUM_FIELDS:
        raise MalformedLine(f"expected {NUM_FIELDS} tab-separated fields, got {len(f)}")
    lab = f[0]
    if lab not in (b"0", b"1"):
        raise MalformedLine(f"label must be 0 or 1, got {lab[:20]!r}")
    label_out[...] = 1.0 if lab == b"1" else 0.0
    for j in range(NUM_DENSE):
        x = f[1 + j]
        if not x:
            dense_out[j] = 0.0
            continue
        digits = x[1:] if x[:1] == b"-" else x
        if not digits or not digits.isdigit():
            raise MalformedLine(f"integer feature {j + 1} is not an integer: {x[:20]!r}")
        v = int(x)
        dense_out[j] = float(v) if v > 0 else 0.0
    for j in range(NUM_SPARSE):
        x = f[1 + NUM_DENSE + j]
        if not x:
            sparse_out[j] = 0
            continue
        if len(x) > 8 or x.strip(_HEX):
            raise MalformedLine(f"categorical feature {j + 1} is not 32-bit hex: {x[:20]!r}")
        sparse_out[j] = int(x, 16)


def iter_chunks(paths: Sequence[str], report: ParseReport, strict: bool = False) -> Iterator[np.ndarray]:
    """Parsed records (raw uint32 categoricals in the ``sparse`` field, dense not yet transformed)
    in chunks of up to ``CHUNK``."""
    buf = np.zeros(CHUNK, RECORD)
    sparse_u = buf["sparse"].view(np.uint32)
    n = 0
    for path in paths:
        with open_text(path) as fh:
            for lineno, line in enumerate(fh, 1):
                report.lines += 1
                if not line.strip():
                    report.add_bad(path, lineno, "empty line")
                    if strict:
                        raise ValueError(f"{path}:{lineno}: malformed line: empty line")
                    continue
                try:
                    parse_line(line, buf["label"][n:n + 1], buf["dense"][n], sparse_u[n])
                except MalformedLine as e:
                    report.add_bad(path, lineno, str(e))
                    if strict:
                        raise ValueError(f"{path}:{lineno}: malformed line: {e}") from None
                    continue
                n += 1
                report.records += 1
                if n == CHUNK:
                    yield buf[:n]
                    n = 0
    if n:
        yield buf[:n]


def _write_header(f, meta: dict) -> None:
    blob = MAGIC + json.dumps(meta).encode()
    if len(blob) > HEADER:
        raise ValueError("header metadata too large")
    f.seek(0)
    f.write(blob.ljust(HEADER, b"\0"))


def preprocess(raw_files: str | Sequence[str], out_path: str, *, max_ind_range: int = 0, strict: bool = False,
               verbose: bool = False) -> ParseReport:
    """Convert raw Criteo files into the memory-mappable binary form at ``out_path``; returns the report."""
    paths = [raw_files] if isinstance(raw_files, (str, os.PathLike)) else list(raw_files)
    paths = [str(p) for p in paths]
    report = ParseReport()
    tmp = out_path + ".partial"
    with open(tmp, "wb") as f:
        f.write(b"\0" * HEADER)
        for chunk in iter_chunks(paths, report, strict):
            np.log1p(chunk["dense"], out=chunk["dense"])
            if max_ind_range > 0:
                u = chunk["sparse"].view(np.uint32)
                u %= np.uint32(max_ind_range)
            f.write(chunk.tobytes())
        n = report.records
        meta = {"records": n, "max_ind_range": int(max_ind_range), "sources": paths,
                "mode": "hash" if max_ind_range > 0 else "dictionary", "report": report.to_dict()}
        if n == 0:
            meta["table_sizes"] = [1] * NUM_SPARSE
            _write_header(f, meta)
    if n > 0:
        mm = np.memmap(tmp, RECORD, mode="r+", offset=HEADER, shape=(n,))
        sizes = []
        for j in range(NUM_SPARSE):
            col = mm["sparse"][:, j].view(np.uint32)
            if max_ind_range > 0:
                sizes.append(int(max_ind_range))
            else:
                uniq, inv = np.unique(np.array(col), return_inverse=True)
                mm["sparse"][:, j] = inv.astype(np.int32)
                sizes.append(max(1, int(uniq.size)))
        mm.flush()
        del mm
        meta["table_sizes"] = sizes
        with open(tmp, "r+b") as f:
            _write_header(f, meta)
    os.replace(tmp, out_path)
    if verbose:
        print(f"preprocessed {', '.join(paths)} -> {out_path}: {report.summary()}")
    return report


def read_processed(path: str) -> tuple[np.ndarray, dict]:
    """Memory-map a preprocessed file: ``(records, metadata)``."""
    with open(path, "rb") as f:
        head = f.read(HEADER)
    if not head.startswith(MAGIC):
        raise ValueError(f"{path} is not a preprocessed DLRM Criteo file (magic {head[:8]!r})")
    meta = json.loads(head[len(MAGIC):].rstrip(b"\0"))
    n = int(meta["records"])
    size = os.path.getsize(path)
    if size != HEADER + n * RECORD.itemsize:
        raise ValueError(f"{path}: {size} bytes, expected {HEADER + n * RECORD.itemsize} for {n} records (truncated?)")
    if n == 0:
        return np.zeros(0, RECORD), meta
    return np.memmap(path, RECORD, mode="r", offset=HEADER, shape=(n,)), meta


class CriteoDataset:
    """Batches of a preprocessed file; the last ``test_fraction`` of the records is held out.

    ``batch(i, split)`` is a pure function of ``i`` (epochs wrap around), so a resumed run sees
    the same batches. Partial final batches are dropped.
    """

    def __init__(self, path: str, batch_size: int, test_fraction: float = 0.1):
        self.records, self.meta = read_processed(path)
        self.batch_size = int(batch_size)
        n = self.records.shape[0]
        ntest = int(n * test_fraction)
        self.ranges = {"train": (0, n - ntest), "test": (n - ntest, n)}
        self.table_sizes = [int(s) for s in self.meta["table_sizes"]]
        self.dense_dim = NUM_DENSE

    def nbatches(self, split: str = "train") -> int:
        a, b = self.ranges[split]
        return (b - a) // self.batch_size

    def batch(self, i: int, split: str = "train") -> Batch:
        nb = self.nbatches(split)
        if nb == 0:
            raise ValueError(f"the {split} split has fewer than {self.batch_size} records")
        a, _ = self.ranges[split]
        s = a + (int(i) % nb) * self.batch_size
        rec = self.records[s:s + self.batch_size]
        sparse = rec["sparse"].T.astype(np.int64)  # int64 like the synthetic data: one compiled kernel variant
        return Batch(np.array(rec["dense"], np.float32), [sparse[t] for t in range(NUM_SPARSE)],
                     np.array(rec["label"], np.float32))
