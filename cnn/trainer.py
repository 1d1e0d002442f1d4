"""Training loop, footprint measurement and per-iteration traffic reports for one operating mode.

`measure_footprint` runs one ``dram``-mode iteration on a fast device big
enough for everything and records the fast high-water mark (the footprint),
the bytes allocated in an iteration, and the largest kernel working set (the
smallest budget that works).  `run_mode` then sizes the DRAM device to the
budget, trains, and returns one record per iteration; with ``save`` it writes
a checkpoint (weights, momentum, iteration) at an interval and at the end, and
with ``load`` it resumes from one.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterator

import jax.numpy as jnp
import numpy as np

from cachedarrays import CachedArray, Manager, OutOfMemoryError, format_size, readable
from cachedarrays.checkpoint import CheckpointError, Interval, open_npz, save_npz
from cachedarrays.policies.correlation import accuracy_and_coverage

from .annotate import Annotations
from .data import synthetic_batch
from .execute import Executor
from .graph import Tape, plan_last_uses
from .layers import SoftmaxCrossEntropy
from .models import Model, build
from .modes import MIN_PM, BudgetTooSmallError, check_budget, fast_limit, make_manager, parse_budget
from .optim import SGD


@dataclass
class Config:
    """What to train: model family and shape, batch, optimiser, annotation granularity, data seed."""

    family: str = "resnet"
    depth: int = 50
    width: int = 16
    batch: int = 32
    image: int = 64
    classes: int = 10
    channels: int = 3
    lr: float = 0.01
    momentum: float = 0.9
    seed: int = 0
    granularity: str = "layer"
    device: str = "cpu"            # "gpu": the fast level is GPU memory (HBM) over host DRAM
    recompute: bool = False        # batch norm + ReLU outputs recomputed in backward, not kept (BNReLUConv)
    wide: bool = True              # a residual join or a DenseNet concatenation inside its layer's chain kernels

    @property
    def label(self) -> str:
        extra = (", recompute" if self.recompute else "") + ("" if self.wide else ", narrow kernels")
        return f"{self.family}{self.depth} (width {self.width}, batch {self.batch}, image {self.image}{extra})"


class Trainer:
    """A model, its optimiser and the annotated executor on one manager."""

    def __init__(self, cfg: Config, manager: Manager, timeline=None):
        self.cfg = cfg
        self.m = manager
        self.ex = Executor(manager, timeline=timeline)
        self.ann = Annotations(manager, granularity=cfg.granularity)
        self.model: Model = build(cfg.family, manager, depth=cfg.depth, width=cfg.width, image=cfg.image,
                                  classes=cfg.classes, in_channels=cfg.channels, seed=cfg.seed,
                                  recompute=cfg.recompute, wide=cfg.wide)
        self.opt = SGD(self.model.params, cfg.lr, cfg.momentum)
        self.loss_layer = SoftmaxCrossEntropy()
        self.plan = plan_last_uses(self.model.forward, self.loss_layer)
        self._batch: tuple | None = None  # the uploaded batch (`Executor.upload`) until `run` places it
        self.m.collect()

    def step(self, x_np: np.ndarray, y_np: np.ndarray) -> float:
        """One training iteration (forward, backward, SGD); returns the loss before the update."""
        self.begin(x_np, y_np)
        return self.run()

    def begin(self, x_np: np.ndarray, y_np: np.ndarray) -> None:
        """Bring the batch to the fast device (`Executor.upload`), for `run` to train on: what a
        whole-jitted step has before it starts. Nothing of the policy runs here."""
        self._batch = (self.ex.upload(x_np), self.ex.upload(y_np.astype(np.int32)))

    def run(self) -> float:
        """The iteration `begin` prepared: the boundary marked for the policy (`Policy.mark_iteration`:
        a policy that learns the order of uses, mode ``cap``, learns one step's and prefetches the
        next), the batch placed as objects, forward, backward, SGD; returns the loss before the update."""
        if self._batch is None:
            raise RuntimeError("Trainer.run trains on the batch of Trainer.begin, which was not called")
        batch, self._batch = self._batch, None
        self.m.policy.mark_iteration()
        x, y = (CachedArray(a, self.m) for a in batch)
        del batch
        tape = Tape(self.ex, self.ann, self.plan)
        loss = tape(self.loss_layer, self.model.forward(tape, x), y)
        with readable(loss) as v:  # a copy read at the end: on a GPU reading it now would wait for the forward pass
            value = jnp.array(v, copy=True)
        pgrads = tape.backward(loss)
        self.opt.step(self.ex, self.ann, pgrads)
        value = float(value)
        self.ann.release_dead((x, y, loss), ())
        # End of iteration: drop the tape (the dissertation ran the GC here) and free what died.
        del tape, pgrads, loss, x, y
        self.m.collect()
        self.ex.sync()  # a step's time includes the GPU work it dispatched
        return value

    def predict(self, x_np: np.ndarray, chunk: int | None = None) -> np.ndarray:
        """Class predictions, ``chunk`` images at a time (default: the training batch, padded, so the
        jitted kernels of training are reused); batch norm uses each chunk's statistics."""
        chunk = chunk or self.cfg.batch
        out = []
        for i in range(0, len(x_np), chunk):
            part = x_np[i:i + chunk]
            n = len(part)
            if n < chunk:  # pad with copies of the chunk, so the shape (and the statistics' scale) stays
                part = np.concatenate([part] * (-(-chunk // n)))[:chunk]
            x = CachedArray(np.ascontiguousarray(part), self.m)
            tape = Tape(self.ex, self.ann)
            logits = self.model.forward(tape, x)
            out.append(np.asarray(logits)[:n].argmax(axis=-1))
            self.ann.release_dead((tape.nodes, x), self.model.params)
            del tape, logits, x
            self.m.collect()
        return np.concatenate(out)


@dataclass
class Footprint:
    """What one unconstrained (``dram``) iteration needed."""

    footprint: int            # fast high-water mark over the iteration (weights, state, live activations)
    persistent: int           # weights and optimiser state
    allocated: int            # bytes allocated during the iteration
    min_budget: int           # the largest kernel working set: the smallest budget that works
    min_budget_kernel: str
    seconds: float


def _estimate(cfg: Config) -> int:
    act = cfg.batch * cfg.image * cfg.image * max(cfg.width, cfg.channels) * 4
    return max(16 << 20, 6 * act * max(cfg.depth, 8))


def measure_footprint(cfg: Config, data: Callable[[int], tuple] | None = None, pm_dir: str | None = None) -> Footprint:
    """Run one ``dram`` iteration with a fast device that holds everything (doubled until it does).

    On the GPU the fast device grows up to half the free GPU memory; a model whose iteration needs more
    is measured on the CPU instead (the same objects are allocated there, only slower)."""
    data = data or (lambda i: synthetic_batch(i, cfg.batch, cfg.image, cfg.channels, cfg.classes, cfg.seed))
    # half the free GPU memory at most: JAX allocates the kernels' outputs (until they are stored) and
    # temporaries outside the heap, several GiB each at large batches (they ran out beside a 90 % heap)
    limit = fast_limit(cfg.device, 0.5)
    fast = _estimate(cfg) if limit is None else min(_estimate(cfg), limit)
    while True:
        with make_manager("dram", fast, MIN_PM, pm_dir, cfg.device) as m:
            tr = Trainer(cfg, m)
            persistent = m.fast.used_bytes
            m.reset_telemetry()
            t0 = time.perf_counter()
            tr.step(*data(0))
            seconds = time.perf_counter() - t0
            tele = m.telemetry()
            spilled = tele["counters"].get(f"allocations:{m.slow.name}", 0) or tele["bytes_moved"]
            if not spilled:
                return Footprint(tele["occupancy"][m.fast.name]["high_water"], persistent,
                                 tele["counters"].get(f"bytes_allocated:{m.fast.name}", 0),
                                 _round_up(tr.ex.stats.max_working_set), tr.ex.stats.max_working_set_kernel,
                                 seconds)
            del tr
        if limit is not None and fast >= limit:
            return measure_footprint(dataclasses.replace(cfg, device="cpu"), data, pm_dir)
        fast = fast * 2 if limit is None else min(fast * 2, limit)


def _round_up(n: int, page: int = 4096) -> int:
    return -(-n // page) * page


@dataclass
class IterationRecord:
    iteration: int
    loss: float
    seconds: float
    dram_to_pm_bytes: int
    pm_to_dram_bytes: int
    peak_fast_bytes: int
    fast_capacity: int
    measured_movement_seconds: float
    modeled_movement_seconds: float
    modeled_seconds: float        # compute (measured time minus measured movement) + modeled movement
    kernel_slow_read_bytes: int   # kernel operands read straight from the slow device
    kernel_slow_write_bytes: int  # kernel outputs written straight to the slow device
    fast_device: str = "DRAM"      # the budgeted level (GPU on the GPU) and the one below it, whose
    slow_device: str = "PM"        # copies the *_bytes fields count (DRAM on the GPU)
    exposed_movement_seconds: float = 0.0  # of the measured movement, what a use waited for
    coverage: float | None = None  # uses that found their object in fast memory (policies that count uses)
    prefetch_accuracy: float | None = None  # learned prefetches used before eviction, of those resolved
    counters: dict = field(default_factory=dict)


def iteration_record(i: int, loss: float, seconds: float, m: Manager, ex: Executor) -> IterationRecord:
    """Summarise the manager's telemetry and the executor's counters for one iteration."""
    tele = m.telemetry()
    moved = tele["bytes_moved"]
    f, s = m.fast.name, m.levels[1].name
    compute = max(0.0, seconds - tele["measured_movement_seconds"])
    accuracy, coverage = accuracy_and_coverage(tele["counters"])
    return IterationRecord(
        i, loss, seconds, moved.get(f"{f}->{s}", 0), moved.get(f"{s}->{f}", 0),
        tele["occupancy"][f]["high_water"], tele["occupancy"][f]["capacity"],
        tele["measured_movement_seconds"], tele["modeled_movement_seconds"],
        compute + tele["modeled_movement_seconds"], ex.stats.read_slow, ex.stats.written_slow, f, s,
        tele["exposed_movement_seconds"], coverage, accuracy, dict(tele["counters"]))


@dataclass
class RunResult:
    mode: str
    budget: int
    footprint: Footprint
    records: list[IterationRecord]
    telemetry: dict            # the manager's telemetry of the last iteration (with its timeline)
    policy_report: dict | None = None  # the policy's own `report()` over the run, where it has one

    def as_dict(self) -> dict:
        out = {"mode": self.mode, "budget_bytes": self.budget, "footprint": asdict(self.footprint),
               "iterations": [asdict(r) for r in self.records]}
        if self.policy_report is not None:
            out["policy_report"] = self.policy_report
        return out


class Session:
    """One mode's manager (DRAM sized to the budget) and trainer; `step` trains one iteration and reports it.

    Several sessions can live side by side, so a benchmark can interleave their
    iterations and expose them to the same machine noise.  A budget below the smallest that the
    model's kernels need, where narrower kernels (``Config.wide`` False) need less, runs those:
    ``cfg`` and ``fp`` are then the narrow model's.
    """

    def __init__(self, cfg: Config, mode: str, budget: "str | int | float | None", fp: Footprint,
                 data: Callable[[int], tuple] | None = None, pm_dir: str | None = None, slow_bytes: int | None = None):
        self.cfg, self.mode, self.fp = cfg, mode, fp
        self.data = data or (lambda i: synthetic_batch(i, cfg.batch, cfg.image, cfg.channels, cfg.classes, cfg.seed))
        if mode == "dram":
            self.fast = _round_up(int(fp.footprint * 1.25) + (1 << 20))
        else:
            self.fast = parse_budget(budget, fp.footprint)
            if self.fast < fp.min_budget and cfg.wide:  # narrower kernels need less fast memory at once
                narrow = dataclasses.replace(cfg, wide=False)
                narrow_fp = measure_footprint(narrow, data, pm_dir)
                if narrow_fp.min_budget < fp.min_budget:
                    cfg, fp = narrow, narrow_fp
                    self.cfg, self.fp = cfg, fp
            check_budget(self.fast, fp.min_budget, fp.footprint, cfg.label)
        # below the budget: room for everything allocated in an iteration (modes that ignore frees)
        slow = int(1.3 * (fp.footprint + fp.allocated)) + MIN_PM if slow_bytes is None else slow_bytes
        timeline = None
        if cfg.device == "gpu":
            from cachedarrays.devices.gpu import DeviceClock
            timeline = DeviceClock()
        self.m = make_manager(mode, self.fast, slow, pm_dir, cfg.device, stamps=timeline)
        self.trainer = Trainer(cfg, self.m, timeline)
        self.records: list[IterationRecord] = []

    def step(self, i: int) -> IterationRecord:
        m, tr = self.m, self.trainer
        batch = self.data(i)
        m.reset_telemetry()
        tr.ex.stats.reset()
        try:
            # the clock starts with the batch on the device, as whole-jit's does (benchmarks/gpu_cnn.py):
            # its upload from pageable host memory is synchronous; placing it as objects is timed
            tr.begin(*batch)
            t0 = time.perf_counter()
            loss = tr.run()
        except OutOfMemoryError as e:
            raise BudgetTooSmallError(f"{self.mode} ran out of memory with a fast budget of {format_size(self.fast)} "
                                      f"(smallest that should work: {format_size(self.fp.min_budget)}): {e}") from e
        rec = iteration_record(i, loss, time.perf_counter() - t0, m, tr.ex)
        self.records.append(rec)
        if len(self.records) == 1:
            # what lives now (the model, JAX's compiled kernels, the kept imports) lives for the run: the
            # collector's full passes skip frozen objects (about 6 ms a step of a tiny DenseNet on the CPU)
            gc.collect()
            gc.freeze()
        return rec

    def save(self, path: str, iteration: int) -> str:
        """Write the weights, the momentum buffers and ``iteration`` (steps done) to ``path`` atomically."""
        params = self.trainer.model.params
        arrays = {f"param{i}": np.asarray(p) for i, p in enumerate(params)}
        for i, p in enumerate(params):
            v = self.trainer.opt.state.get(p.object.id)
            if v is not None:
                arrays[f"momentum{i}"] = np.asarray(v)
        return save_npz(path, arrays, {"iteration": int(iteration), "mode": self.mode, "config": asdict(self.cfg)})

    def load(self, path: str) -> int:
        """Restore weights and momentum from ``path``; returns the iteration to continue at.

        Raises `CheckpointError` for a file that is not a checkpoint of this model."""
        with open_npz(path) as ck:
            if _portable(ck.meta.get("config")) != _portable(asdict(self.cfg)):
                raise CheckpointError(f"checkpoint {path} is for another model or training setup: "
                                      f"{ck.meta.get('config')}, this run {asdict(self.cfg)}")
            for i, p in enumerate(self.trainer.model.params):
                for name, target in ((f"param{i}", p), (f"momentum{i}", self.trainer.opt.state.get(p.object.id))):
                    if target is None:
                        continue
                    a = ck[name]
                    if a.shape != target.shape:
                        raise CheckpointError(f"checkpoint {path}: {name} has shape {a.shape}, expected {target.shape}")
                    target[...] = a
            return int(ck.meta["iteration"])

    def close(self) -> RunResult:
        """Check the manager's invariants, close the devices, and return the run's records."""
        tele = self.m.telemetry()
        self.m.check()
        report = getattr(self.m.policy, "report", None)
        del self.trainer
        self.m.close()
        gc.unfreeze()
        gc.collect()
        return RunResult(self.mode, self.fast, self.fp, self.records, tele, report() if report else None)


def _portable(config: dict | None) -> dict | None:
    """A config without what a checkpoint may change between runs (the device, the kernels' fusion)."""
    return None if config is None else {k: v for k, v in config.items() if k not in ("device", "wide")}


def run_mode(cfg: Config, mode: str, budget: "str | int | float", iterations: int, fp: Footprint,
             data: Callable[[int], tuple] | None = None, pm_dir: str | None = None,
             on_iteration: Callable[[IterationRecord], None] | None = None,
             progress: Callable[[Iterator[int]], Iterator[int]] | None = None,
             after: Callable[[Trainer], None] | None = None, save: str | None = None, load: str | None = None,
             interval: Interval | None = None, on_save: Callable[[str, int], None] | None = None) -> RunResult:
    """Train up to iteration ``iterations`` in ``mode`` with a fast device of ``budget`` (``dram``: no budget).

    ``load``: resume from this checkpoint (at its iteration).  ``save``: write a checkpoint there
    whenever ``interval`` is due and at the end (``on_save(path, iteration)`` is told of each).
    """
    session = Session(cfg, mode, budget, fp, data, pm_dir)
    try:
        start = session.load(load) if load else 0
        its = range(start, iterations)
        for i in (progress(its) if progress else its):
            rec = session.step(i)
            if on_iteration:
                on_iteration(rec)
            if save and interval is not None and interval.enabled and i + 1 < iterations and interval.due(i + 1):
                session.save(save, i + 1)
                interval.done()
                if on_save:
                    on_save(save, i + 1)
        if save:
            session.save(save, max(iterations, start))
            if on_save:
                on_save(save, max(iterations, start))
        if after:
            after(session.trainer)
    except BaseException:
        session.m.close()
        raise
    return session.close()
