"""The DLRM model: embedding tables (any ``embeddings`` table type) plus the jitted dense part.

One training step (:meth:`DLRM.train_step`):

1. *lookup*: ``Ensemble.lookup_into`` writes every table's pooled rows straight into the
   ``(batch, tables, featuresize)`` array that is the interaction input;
2. *dense forward+backward*: one jitted JAX call gives the loss, the logits, the dense gradients
   and the gradient of the interaction input with respect to the embedding outputs;
3. *embedding update*: ``Ensemble.pullback`` with the fused sparse optimizer (SGD or row-wise
   Adagrad) turns that gradient into row updates, no dense table gradient ever exists;
4. *dense update*: jitted SGD of the MLP weights.

With ``device="gpu"`` the tables are GPU tables (in HBM, or cached in HBM over host tables) and
every phase runs on the GPU: the lookup is a JAX array on the GPU that the jitted dense step
takes without a copy, and its gradient goes back to the update kernels the same way. When the
next batch is known (``train_step(batch, next_batch)``), its rows are prefetched into cached
tables before the dense work, so their misses are copied while it runs; with every table in HBM
its indices are uploaded then instead (:func:`dlrm.gpu.upload_indices`).
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cachedarrays.jaxdlpack import from_dlpack
from embeddings import SGD, Ensemble, RowwiseAdagrad, aligned_empty, lookup, pullback
from embeddings.gpu import table_on_gpu
from embeddings.protocol import EmbeddingTable

from .data.batch import Batch
from .dense import DLRMConfig, init_dense, make_grad_step, make_predict, sgd_update, to_device, to_numpy
from .metrics import PhaseTimer, accuracy, bce, roc_auc
from .placement import is_cached, make_room

DEVICES = ("cpu", "gpu")
# the tables' optimizers: "sgd-any" is SGD whose GPU updates sum a row's entries in any order
# (embeddings.SGD(deterministic=False): faster, not reproducible bit for bit; CPU tables as "sgd")
OPTIMIZERS = ("sgd", "sgd-any", "adagrad")


GROUP_SIZE = 8


def _part(xs, a, b):
    return None if xs is None else xs[a:b]


class StepResult:
    """A training step's loss and logits, read from the device when first asked for (then kept
    as a float and a numpy array): a step whose result nobody reads does not wait for it, and a
    trainer that reads the previous step's result after starting the next one (``dlrm.train``)
    finds it done. Reading both at once cost the DLRM step on the H100 about 1.4 ms with GPU
    cached tables and 0.9 ms with tables in HBM (the wait for the step's last kernels and two
    copies to the host)."""

    __slots__ = ("_loss", "_logits")

    def __init__(self, loss: Any, logits: Any) -> None:
        self._loss, self._logits = loss, logits

    @property
    def loss(self) -> float:
        if not isinstance(self._loss, float):
            self._loss = float(self._loss)
        return self._loss

    @property
    def logits(self) -> np.ndarray:
        if not isinstance(self._logits, np.ndarray):
            self._logits = np.asarray(self._logits)
        return self._logits

    def __repr__(self) -> str:
        return f"StepResult(loss={self.loss!r}, logits={self.logits!r})"


class DLRM:
    """``DLRM(config, tables, optimizer="sgd"|"sgd-any"|"adagrad", lr=0.01, seed=0)``.

    ``tables`` are embedding tables (``SimpleEmbedding``, ``CachedEmbeddings``, ...) with
    ``config.table_sizes`` rows and ``config.featuresize`` columns. ``precision`` is the dense
    layers' matmul precision: "f32", or "bf16" (bfloat16 operands, float32 accumulation and
    float32 weights; see :func:`dlrm.dense.linear`). ``device="gpu"``: the tables are GPU tables
    and the dense part runs on JAX's GPU.
    """

    def __init__(self, config: DLRMConfig, tables: Sequence[EmbeddingTable], *, optimizer: str = "sgd",
                 lr: float = 0.01, seed: int = 0, params: dict | None = None, timer: PhaseTimer | None = None,
                 group_size: int = GROUP_SIZE, precision: str = "f32", device: str = "cpu"):
        if device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(map(repr, OPTIMIZERS))}, got {optimizer!r}")
        if len(tables) != config.ntables:
            raise ValueError(f"config has {config.ntables} tables, got {len(tables)}")
        for t, n in zip(tables, config.table_sizes):
            if t.nvectors() != n or t.featuresize() != config.featuresize:
                raise ValueError(f"table {t.name}: {t.nvectors()} x {t.featuresize()}, "
                                 f"expected {n} x {config.featuresize}")
        self.config = config
        self.tables = list(tables)
        # numba compiles the ensemble kernels once per number of tables (tuples are unrolled), and
        # that compile time grows much faster than linearly: groups of at most `group_size` tables
        # keep a 26-table model at two compiled variants of seconds each instead of one of minutes.
        self.device = device
        # On the GPU one ensemble takes every table (there is no per-table-count compile), cached
        # ones included (they also prefetch their next batch); tables left on the host get their
        # own calls.
        self._per_table = device == "gpu" and not all(table_on_gpu(t) for t in self.tables)
        self._prefetching = device == "gpu" and any(is_cached(t) for t in self.tables)
        # every table in HBM: a step's indices go up once, for its lookup and its update (cached
        # tables take host indices, which they match against the batches they prefetched)
        self._upload_indices = device == "gpu" and not self._per_table and not self._prefetching
        self._indices: tuple[Batch, list] | None = None
        # uploaded a step ahead by prefetch: (batch, its device indices, the copy's event), at most two batches
        self._ahead: collections.deque = collections.deque(maxlen=2)
        # (event, what the copy up reads and writes: page-locked blocks, device arrays), kept until it has passed
        self._index_blocks: collections.deque = collections.deque()
        g = max(1, int(group_size)) if device == "cpu" else len(self.tables)
        self.groups = [(a, min(a + g, len(self.tables))) for a in range(0, len(self.tables), g)]
        self.ensembles = [] if self._per_table else [Ensemble(self.tables[a:b]) for a, b in self.groups]
        self.lr = float(lr)
        self.optimizer = optimizer
        self.table_opt = (RowwiseAdagrad(self.lr) if optimizer == "adagrad"
                          else SGD(self.lr, deterministic=optimizer == "sgd"))
        self.params = to_device(init_dense(config, seed) if params is None else params)
        self.precision = precision
        self._grad = make_grad_step(config.interaction, precision)
        self._predict = make_predict(config.interaction, precision)
        self.timer = timer if timer is not None else PhaseTimer()
        self._buf: np.ndarray | None = None
        self._uploaded: tuple[Batch, object, object] | None = None  # (batch, its dense inputs on the GPU)
        self._held: collections.deque = collections.deque()  # (event, gradients its update kernels read)
        self._pending: Any = None  # the background prefetch the last step started (:meth:`finish`)

    # ------------------------------------------------------------------ steps
    def lookup(self, batch: Batch) -> np.ndarray | jax.Array:
        """The (batch, tables, featuresize) interaction input of ``batch``'s sparse features
        (a JAX array on the GPU when ``device="gpu"``)."""
        if self.device == "gpu":
            if self._per_table:
                return jnp.stack([_as_jax(lookup(t, batch.indices[i], _at(batch.offsets, i)))
                                  for i, t in enumerate(self.tables)], axis=1)
            return _as_jax(self.ensembles[0].lookup(self._sparse(batch, upload=True), batch.offsets))
        shape = (len(batch), self.config.ntables, self.config.featuresize)
        if self._buf is None or self._buf.shape != shape:
            self._buf = aligned_empty(shape)
        for (a, b), ens in zip(self.groups, self.ensembles):
            ens.lookup_into(self._buf[:, a:b, :], batch.indices[a:b], _part(batch.offsets, a, b))
        return self._buf

    def _pullback(self, grad, batch: Batch) -> None:
        read = grad  # what the update kernels read
        if self._per_table:
            read = [grad[:, i, :] for i in range(len(self.tables))]
            for i, t in enumerate(self.tables):
                pullback(t, read[i], batch.indices[i], _at(batch.offsets, i), optimizer=self.table_opt)
        elif self.device == "gpu":  # one ensemble, the gradient as it is (no per-table slices of a JAX array)
            self.ensembles[0].pullback(grad, self._sparse(batch), batch.offsets, optimizer=self.table_opt)
        else:
            for (a, b), ens in zip(self.groups, self.ensembles):
                ens.pullback(grad[:, a:b, :], batch.indices[a:b], _part(batch.offsets, a, b),
                             optimizer=self.table_opt)
        if self.device == "gpu":
            self._hold(read)

    def _hold(self, value: Any) -> None:
        """Keep ``value`` (JAX arrays that update kernels queued on CuPy's stream read) alive until
        those kernels are done. JAX frees a dead value's buffer without waiting for CuPy's
        stream; waiting for the kernels here instead cost the main thread 2.5 ms a step on an
        H200 beside a prefetch. At most two steps' values are held."""
        from embeddings.gpu.backend import cuda_backend
        be = cuda_backend()
        held = self._held
        held.append((be.fence(), value))
        while held and (held[0][0].done or len(held) > 2):
            fence, _ = held.popleft()
            be.wait(fence)

    def _sparse(self, batch: Batch, upload: bool = False) -> list:
        """``batch``'s indices for the GPU ensemble. When every table is in HBM, device copies:
        uploaded a step ahead by :meth:`prefetch` (:func:`dlrm.gpu.upload_indices`) or else by
        the lookup (``upload``), and taken by the update of the same batch that follows it, so a
        step does not upload and check on the host twice what it uses twice (the tables check
        device indices on the device, raising the host path's errors). A batch changed in place
        after its prefetch is not seen (as with cached tables' prefetch)."""
        if not self._upload_indices:
            return batch.indices
        memo, self._indices = self._indices, None
        if upload or memo is None or memo[0] is not batch:
            from embeddings.gpu.backend import cuda_backend
            be = cuda_backend()
            ahead = next((a for a in self._ahead if a[0] is batch), None)
            if ahead is not None:
                self._ahead.remove(ahead)
                be.follow(ahead[2])  # the copy up, made on a side stream
                memo = ahead[:2]
            else:
                memo = (batch, [be.asarray(i) for i in batch.indices])
        if upload:
            self._indices = memo
        return memo[1]

    def prefetch(self, batch: Batch, background: bool = True) -> Any:
        """On the GPU: bring ``batch``'s rows into the cached tables while the current batch
        computes (:func:`dlrm.gpu.prefetch_next`): ``background``, start uploading its dense
        features and labels and start the tables that prefetch on a worker thread, returning
        that part for :func:`dlrm.gpu.finish_prefetch` (None: none); otherwise the other cached
        tables, synchronously."""
        if self.device != "gpu":
            return None
        pending = None
        if self._prefetching:  # first: the row traffic is the longer chain
            from .gpu import prefetch_next
            pending = prefetch_next(self.tables, [batch.flat(i) for i in range(len(self.tables))], background)
        if background:
            self._uploaded = (batch, jax.device_put(batch.dense), jax.device_put(batch.labels))
            if self._upload_indices:
                self._upload_ahead(batch)
        return pending

    def _upload_ahead(self, batch: Batch) -> None:
        """Start uploading ``batch``'s indices for its lookup (every table in HBM); the page-locked
        blocks of earlier uploads go back once their copies are done."""
        from .gpu import upload_indices
        blocks = self._index_blocks
        while blocks and blocks[0][0].done:
            blocks.popleft()
        if any(a[0] is batch for a in self._ahead):
            return
        got = upload_indices(self.tables, batch.indices)
        if got is not None:
            views, fence, host = got
            self._ahead.append((batch, views, fence))
            blocks.append((fence, (host, views)))  # an upload dropped unused must not free memory the copy writes

    def _inputs(self, batch: Batch):
        """``batch``'s dense features and labels, from the upload :meth:`prefetch` started if it did."""
        up, self._uploaded = self._uploaded, None
        if up is not None and up[0] is batch:
            return up[1], up[2]
        if self.device == "gpu":  # the same argument kinds as prefetched ones: one compiled variant
            return jax.device_put(batch.dense), jax.device_put(batch.labels)
        return batch.dense, batch.labels

    def finish(self) -> None:
        """Wait for the background prefetch the last :meth:`train_step` started (raising its
        error, if any): the next step does it before its lookup."""
        pending, self._pending = self._pending, None
        if pending is not None:
            from .gpu import finish_prefetch
            with self.timer("prefetch wait"):
                finish_prefetch(pending)

    def train_step(self, batch: Batch, next_batch: Batch | None = None) -> StepResult:
        """One step on ``batch``; ``next_batch`` (when known) is prefetched: by tables that prefetch
        in the background from the start of the step to the start of the next one (joined
        before its lookup, :meth:`finish`), by the others while the dense work runs (dispatched
        before their prefetch, awaited after it). A background prefetch is not joined at the end
        of its step: what follows on the host (this step's loss and logits, the next batch's
        checks and copies) then runs beside its placement, the longer of the two; with the
        update of ``lru`` tables replayed as a CUDA graph the DLRM step took 12.58 ms so against
        13.34 joined at the end on the H100."""
        tm = self.timer
        with tm("cache flush"):
            for t in self.tables:
                make_room(t)
        dense, labels = self._inputs(batch)
        pending = None
        if next_batch is not None:
            with tm("prefetch"):
                pending = self.prefetch(next_batch)  # lru: waits for the previous one, then runs beside this step
        self.finish()  # the previous step's prefetch: this batch's rows
        with tm("lookup"):
            emb = self.lookup(batch)
        step = self._grad(self.params, dense, emb, labels)  # dispatched: the GPU runs it during the prefetch
        if next_batch is not None:
            with tm("prefetch"):
                self.prefetch(next_batch, background=False)
        with tm("dense fwd+bwd"):
            loss, p, g, gemb = jax.block_until_ready(step)
        with tm("embedding update"):
            self._pullback(gemb if self.device == "gpu" else np.asarray(gemb), batch)
        with tm("dense update"):
            self.params = jax.block_until_ready(sgd_update(self.params, g, np.float32(self.lr)))
        self._pending = pending
        return StepResult(loss, p)

    def warmup(self, batch: Batch) -> None:
        """Compile every kernel and jitted function on ``batch`` without changing any weight
        (a zero table gradient and a zero dense gradient are applied), so timings start warm."""
        emb = self.lookup(batch)
        dense, labels = self._inputs(batch)
        loss, p, g, gemb = jax.block_until_ready(self._grad(self.params, dense, emb, labels))
        if self.device == "gpu":
            zero = jnp.zeros_like(gemb)
        else:
            zero = np.zeros(np.shape(gemb), np.float32)
            zero.flags.writeable = False  # read-only like the gradient JAX hands back: same kernel variant
        self._pullback(zero, batch)
        zeros = jax.tree.map(jnp.zeros_like, g)
        self.params = jax.block_until_ready(sgd_update(self.params, zeros, np.float32(self.lr)))
        self._predict(self.params, batch.dense, emb).block_until_ready()

    def predict(self, batch: Batch) -> np.ndarray:
        """Logits (before the sigmoid) for ``batch``; no weights change."""
        self.finish()
        emb = self.lookup(batch)
        return np.asarray(self._predict(self.params, batch.dense, emb))

    def evaluate(self, batches: Iterable[Batch]) -> dict:
        """Loss, accuracy and ROC AUC over held-out ``batches``."""
        logits, labels = [], []
        for b in batches:
            logits.append(self.predict(b))
            labels.append(b.labels)
        p = np.concatenate(logits) if logits else np.zeros(0, np.float32)
        y = np.concatenate(labels) if labels else np.zeros(0, np.float32)
        return {"loss": bce(p, y), "accuracy": accuracy(p, y), "auc": roc_auc(p, y), "samples": int(y.size)}

    # ------------------------------------------------------------------ state
    def dense_numpy(self) -> dict:
        return to_numpy(self.params)

    def set_dense(self, params: dict) -> None:
        self.params = to_device(params)

    def _opt_state(self, t: EmbeddingTable):
        """Where table ``t``'s accumulator lives: on the device for a GPU table in HBM; for a CPU
        table, and for a GPU cached table (its cached rows' values written back first), in the
        optimizer's host array."""
        if self.device == "gpu" and not is_cached(t):
            from embeddings.gpu.tables import state_for
            return state_for(self.table_opt, t)
        if self.device == "gpu":
            t.writeback()
        return self.table_opt.state(t)

    def table_state(self, i: int) -> np.ndarray:
        """A host copy of table ``i``'s row-wise Adagrad accumulator (wherever it lives)."""
        st = self._opt_state(self.tables[i])
        return st.get() if hasattr(st, "get") and not isinstance(st, np.ndarray) else np.array(st)

    def set_table_state(self, i: int, values: np.ndarray) -> None:
        """Overwrite table ``i``'s row-wise Adagrad accumulator (for resuming); a GPU cached table
        then drops its cache (written back first), so its device copy is rebuilt from these values."""
        from cachedarrays.array import assign_into
        t = self.tables[i]
        assign_into(self._opt_state(t), values)
        if self.device == "gpu" and is_cached(t):
            t.invalidate()


def _at(xs, i):
    return None if xs is None else xs[i]


def _as_jax(x):
    """A GPU lookup's output as a JAX array (CuPy outputs through DLPack, without a copy)."""
    return x if isinstance(x, jax.Array) else from_dlpack(x)
