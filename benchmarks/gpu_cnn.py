"""CNN training on the GPU under an HBM budget: our modes against JAX's answers at 2x and 4x the budget.

For a ResNet-50-like and a DenseNet-like model, the batch is chosen so that the model's footprint
(weights, optimiser state and live activations of one unconstrained iteration, measured) is about
``--footprint`` (default 12 GiB: the whole-jitted ResNet-50 step took 243 ms at 25.2 GiB on an
H100, so about 115 ms here), and the HBM budget is the measured footprint / 2 and / 4 (``--ratios``), as
``cnn.train --fast-budget`` would set it.  Side by side in one run, for each model:

- ``whole-jit``: the same model and train step (forward, backward, SGD with momentum) as one jitted
  JAX function, all in HBM: the baseline every ratio is taken against (``speed`` = its step time /
  the row's);
- ``ours, HBM``: our layer-by-layer trainer with everything in HBM (mode ``dram``, budget lifted):
  per-layer dispatch against whole-jit (target: at most 10 % slower);
- ``per-layer, bare``: the kernels of one ``ours, HBM`` step dispatched again in the same order on
  plain JAX arrays (`cnn.execute.replay`): what per-layer execution costs with nothing of ours
  around it (no views, policy or output copies), so that the gap to whole-jit splits into XLA's
  fusion across layers and our executor's own cost;
- ``bare + output copies``: that time plus the GPU time of the copies of kernel outputs into their
  regions that one ``ours, HBM`` step made (as many device-to-device copies of the same bytes, run
  alone and timed with CUDA events): an estimate of the GPU work of a step of ours, which a host
  faster than ours could not go below. XLA writes a kernel's outputs only into buffers of its own
  allocator (donating an imported buffer is ignored), so an output that becomes an object is copied;
- ``ours, HBM, recompute``: the same, for the model that recomputes batch norm + ReLU outputs in
  backward (the same losses; fewer kernels and fewer outputs to store, more arithmetic);
- ``remat``: whole-jit with every residual / dense block under ``jax.checkpoint``;
- ``offload``: whole-jit with every layer output offloaded to ``pinned_host`` memory
  (``save_and_offload_only_these_names``), or the error this JAX version gives;
- at each ratio, ``cap``, ``caLMP``, ``2lm``: our trainer with a GPU heap of the budget over host DRAM.

JAX's own variants cannot be held to the budget (JAX's allocator owns their memory): their row
shows XLA's planned device bytes for the step (arguments + outputs - aliased + temporaries, from
``compiled.memory_analysis()``) instead of a peak under the budget.

Reported per row: step time (median of the steps after the first ``--warmup``), speed against
whole-jit, bytes copied GPU->DRAM and DRAM->GPU per step with GB/s against the host<->GPU bandwidth
measured at the start of this run, copy time hidden behind compute and exposed (a kernel waited;
from CUDA events), learned-prefetch coverage and accuracy (``cap``), peak HBM use, and the PCIe
floor: the larger direction's bytes over the measured link bandwidth (the two directions overlap),
below which no schedule of these copies can bring the step.  Where a target is above what that
floor allows (whole-jit time / max(whole-jit, floor)), the target line says so.

Below each ratio's table, the bound no policy can beat (:func:`bound_seconds`): every byte live at
the iteration's high-water mark is read again later in the step, so all but the budget's worth must
come up the link after that mark, and those the step made itself (all but the weights, momenta and
input batch) went down the link before it, whatever the policy decides: the step takes at least the
two directions' times one after the other, at the bandwidths measured each way.  It is printed for
the model as it runs and
for the same model recomputing batch norm + ReLU outputs in backward (``caLMP, recompute`` rows,
MemFerry's trade of compute for traffic; ``--no-recompute`` leaves them out), whose footprint is
smaller.  A target above the first bound cannot be met by any policy over these objects.

CUDA managed memory is not run (oversubscribing it can hang a shared GPU); DeepUM, the learned
prefetcher over it, is compared on paper (:func:`on_paper`): its published ResNet times against
naive unified memory and IBM LMS (tensor swapping) beside the same ratios of the analogous rows
here, cap against 2lm (whole objects on demand) and against caLMP (program-directed swapping).

Targets: at 2x the budget, cap or caLMP >= 0.9x whole-jit's speed; at 4x >= 0.75x; at both, cap and
caLMP faster than remat; ours all in HBM >= 0.9x whole-jit; whole-jit step >= 100 ms.  Rows print as
they finish and ``results/gpu_cnn.json`` is rewritten after each model and ratio, so a run cut short
keeps what it measured.
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import sys
import time

try:
    from benchmarks import _paths  # noqa: F401
    from benchmarks._common import environment, event_time, median_time, parser, print_table, print_targets, write_json
except ImportError:  # run as a script
    import _paths  # noqa: F401
    from _common import environment, event_time, median_time, parser, print_table, print_targets, write_json

MiB, GiB = 1 << 20, 1 << 30
MODELS = {"resnet": dict(family="resnet", depth=50, width=32, image=112),
          "densenet": dict(family="densenet", depth=41, width=32, image=64)}
QUICK_MODELS = {"resnet": dict(family="resnet", depth=14, width=8, image=32),
                "densenet": dict(family="densenet", depth=13, width=8, image=32)}
OUR_MODES = ("caLMP", "cap", "2lm")
BARE = "per-layer, bare"  # our kernels dispatched one by one on plain JAX arrays (`cnn.execute.replay`)
BARE_COPIES = "bare + output copies"  # and the GPU time of ours' copies of outputs into regions
RECOMPUTE = ", recompute"  # the rows of the model that recomputes batch norm + ReLU outputs (``--recompute``)
TARGET_AT = {2: 0.9, 4: 0.75}
TARGET_HBM = 0.9
# DeepUM (ASPLOS '23), Figure 9(b): seconds for 100 training iterations on one V100 32GB (PCIe 3), by
# batch size: naive CUDA unified memory, IBM LMS (tensor-level swapping; None: out of memory), DeepUM
DEEPUM = {"ResNet-152": {1280: (31002, 3926, 3922), 1536: (38173, 4754, 4767), 1792: (49283, None, 5965)},
          "ResNet-200": {1024: (32420, 4560, 4585), 1280: (44900, 5470, 5835), 1536: (57302, 7187, 7235)}}
DEEPUM_AVERAGE = (3.06, 1.11)  # its average speedup over naive UM and over LMS, all nine models (Section 6.2)
TARGET_MS = 100


def measure_link(nbytes: int = 256 * MiB, repeats: int = 5, down: bool = False) -> float:
    """Host->GPU (``down``: GPU->host) bytes per second between pinned memory and the device
    (median of ``repeats`` copies, CUDA events)."""
    import cupy as cp
    host = cp.cuda.alloc_pinned_memory(nbytes)
    dev = cp.empty(nbytes, dtype=cp.uint8)
    stream = cp.cuda.get_current_stream()
    dst, src, kind = (host.ptr, dev.data.ptr, 2) if down else (dev.data.ptr, host.ptr, 1)
    return nbytes / event_time(lambda: cp.cuda.runtime.memcpyAsync(dst, src, nbytes, kind, stream.ptr), repeats)


# footprint - weights and momenta, over all layer outputs: 0.57-0.66 measured on small models on the CPU;
# 0.76 for ResNet-50 at batch 638 on the H100 (25.2 GiB measured where 0.6 predicted 20)
LIVE_FRACTION = 0.75


def choose(spec: dict, footprint: int, pm_dir, device: str):
    """A config whose footprint should be about ``footprint`` bytes: the batch from the layer outputs'
    bytes (shapes only) and the live fraction measured on small models; the footprint is then measured."""
    from cachedarrays import DRAM, PM, LRUPolicy, Manager
    from cnn.functional import output_bytes
    from cnn.models import build
    from cnn.trainer import Config, measure_footprint
    with Manager(DRAM(256 * MiB), PM(None, 64 * MiB), policy=LRUPolicy()) as m:
        model = build(spec["family"], m, depth=spec["depth"], width=spec["width"], image=spec["image"], classes=10)
        per_sample = LIVE_FRACTION * output_bytes(model, 1)
        persistent = 2 * model.param_bytes
    batch = max(2, int((footprint - persistent) / per_sample))
    cfg = Config(**spec, batch=batch, device=device)
    return cfg, measure_footprint(cfg, pm_dir=pm_dir)


def run_ours(cfg, fp, mode: str, budget: int | None, steps: int, warmup: int, pm_dir) -> dict:
    from cnn.modes import MIN_PM
    from cnn.trainer import Session
    # host DRAM: half the footprint for all-in-HBM (the first steps of the recomputing model
    # spilled a few objects that found no gap in a heap of 1.25x the footprint, until their places
    # settled); the live objects for modes that free; the default (everything an iteration
    # allocates) for 2lm, which frees only when it collects
    slow = {"dram": fp.footprint // 2 + MIN_PM, "cap": int(1.5 * fp.footprint) + MIN_PM, "caLMP": int(1.5 * fp.footprint) + MIN_PM}.get(mode)
    try:
        s = Session(cfg, mode, None if mode == "dram" else budget, fp, pm_dir=pm_dir, slow_bytes=slow)
    except Exception as e:  # a budget below one kernel's operands, or no room
        return {"error": f"{type(e).__name__}: {e}"}
    bare = None
    try:
        for i in range(warmup + steps):
            s.step(i)
        stats = s.trainer.ex.stats  # the last step's kernels
        kernels, host, copies, copied = stats.calls, stats.seconds, stats.copies, stats.copied
        elided, elided_bytes = stats.elided, stats.elided_bytes
        if mode == "dram":  # the same kernels once more, recorded, then dispatched on bare arrays
            bare = bare_seconds(s, warmup + steps, steps)
    except Exception as e:
        s.m.close()
        return {"error": f"{type(e).__name__}: {e}"}
    run = s.close()
    steady = run.records[warmup:]
    med = lambda f: statistics.median(f(r) for r in steady)  # noqa: E731
    last = steady[-1]
    return {"seconds": med(lambda r: r.seconds), "step_seconds": [r.seconds for r in steady],
            "to_slow": med(lambda r: r.dram_to_pm_bytes), "to_fast": med(lambda r: r.pm_to_dram_bytes),
            "hidden": med(lambda r: max(0.0, r.measured_movement_seconds - r.exposed_movement_seconds)),
            "exposed": med(lambda r: r.exposed_movement_seconds), "coverage": last.coverage,
            "accuracy": last.prefetch_accuracy, "peak": max(r.peak_fast_bytes for r in steady),
            "capacity": last.fast_capacity, "losses": [r.loss for r in run.records],
            "policy_report": run.policy_report, "kernels": kernels,
            "host_seconds_per_kernel": host / kernels if kernels else None, "bare_seconds": bare,
            "output_copies": copies, "output_copy_bytes": copied, "outputs_elided": elided,
            "output_bytes_elided": elided_bytes}


def bare_seconds(s, i: int, repeats: int) -> float:
    """Step ``i`` of session ``s`` recorded (:attr:`cnn.execute.Executor.tape`), then the median
    seconds of its kernels dispatched again on bare JAX arrays (:func:`cnn.execute.replay`, after
    one untimed replay): per-layer dispatch with nothing of ours around it."""
    import jax
    from cnn.execute import replay
    ex = s.trainer.ex
    ex.tape = []
    try:
        s.step(i)
        tape = ex.tape
    finally:
        ex.tape = None
    return median_time(replay(tape, jax.devices()[0]), repeats)


def run_jax(cfg, variant: str, steps: int, warmup: int) -> dict:
    """One of `cnn.functional`'s whole-jit variants on the same model and data."""
    import jax
    from cachedarrays import DRAM, PM, LRUPolicy, Manager
    from cnn.data import synthetic_batch
    from cnn.functional import initial_state, train_step
    from cnn.models import build
    try:
        with Manager(DRAM(max(64 * MiB, 2 * _param_bytes(cfg))), PM(None, 64 * MiB), policy=LRUPolicy()) as m:
            model = build(cfg.family, m, depth=cfg.depth, width=cfg.width, image=cfg.image, classes=cfg.classes,
                          in_channels=cfg.channels, seed=cfg.seed)
            params, momenta = initial_state(model, jax.devices()[0])
            # the batches our trainer sees, in HBM before the clock starts, so the losses compare too
            batches = [jax.device_put(synthetic_batch(i, cfg.batch, cfg.image, cfg.channels, cfg.classes, cfg.seed))
                       for i in range(warmup + steps)]
            compiled = train_step(model, cfg.lr, cfg.momentum, variant).lower(params, momenta,
                                                                              *batches[0]).compile()
            mem = compiled.memory_analysis()
            planned = (mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
                       + mem.temp_size_in_bytes) if mem is not None else None
            times, losses = [], []
            for i in range(warmup + steps):
                t0 = time.perf_counter()
                params, momenta, loss = compiled(params, momenta, *batches[i])
                losses.append(float(loss))
                jax.block_until_ready(params)
                times.append(time.perf_counter() - t0)
            stats = jax.devices()[0].memory_stats() or {}
            del params, momenta
            return {"seconds": statistics.median(times[warmup:]), "step_seconds": times[warmup:],
                    "planned": planned, "host_temp": getattr(mem, "host_temp_size_in_bytes", None),
                    "process_peak": stats.get("peak_bytes_in_use"), "losses": losses}
    except Exception as e:
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}


def _param_bytes(cfg) -> int:
    return 4 * cfg.width * cfg.width * 64 * max(cfg.depth, 8) * 16


def gbps(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds else 0.0


COLUMNS = ["variant", "step ms", "speed vs whole-jit", "GPU->DRAM GiB", "DRAM->GPU GiB", "GB/s (of link)",
           "PCIe floor ms", "copy hidden ms", "copy exposed ms", "coverage", "accuracy", "HBM GiB"]


def floor_seconds(r: dict, link: float) -> float:
    """The step time the copies alone need: the larger direction's bytes at the link's bandwidth."""
    return max(r.get("to_slow", 0), r.get("to_fast", 0)) / link if link == link and link > 0 else 0.0


def bound_seconds(footprint: int, budget: int, link: float, down: float | None = None, carried: int = 0) -> float:
    """The step time that no policy over a program's objects can beat at ``budget``: at the
    iteration's high-water mark, ``footprint`` bytes are live and each of them is read again later
    in the step (saved activations in backward, weights in backward and the update, momenta in the
    update); at most ``budget`` of them are in HBM, so at least ``footprint - budget`` must come up
    the link (``link`` bytes a second) after the mark. With ``down`` (the GPU->host bandwidth),
    the bytes beyond the budget that the step made itself (all but ``carried``: weights, momenta
    and the input batch, which may have left HBM before the step began) also went down the link
    before the mark. Every trip down precedes the mark and every trip up follows it, so the step
    takes at least the two one after the other, whatever the schedule: the full-duplex link
    cannot overlap them. Only a program with fewer live bytes (recomputing instead of keeping)
    moves less."""
    if not (link == link and link > 0):
        return 0.0
    over = max(0, footprint - budget)
    made = max(0, over - carried) / down if down is not None and down == down and down > 0 else 0.0
    return over / link + made


def bound_speed(base: float, footprint: int, budget: int, link: float, down: float | None = None,
                carried: int = 0) -> float:
    """The best speed against whole-jit (``base`` seconds a step) that :func:`bound_seconds` allows."""
    return base / max(base, bound_seconds(footprint, budget, link, down, carried))


def carried_bytes(cfg, fp) -> int:
    """The bytes live at the high-water mark that the step did not make: weights and optimiser
    state (``fp.persistent``) and the input batch (float32 images, int32 labels)."""
    return fp.persistent + 4 * cfg.batch * (cfg.channels * cfg.image * cfg.image + 1)


def on_paper(rows: dict, ratio: int) -> dict:
    """DeepUM's published speedups (`DEEPUM`) beside the analogous ones of this run at ``ratio``:
    learned prefetch (DeepUM; cap) over movement on demand without prefetching (naive unified
    memory; 2lm) and over program-directed tensor swapping (LMS; caLMP). Speedups are time ratios;
    a row that did not run gives None."""
    def speedup(slow: str, fast: str) -> float | None:
        a, b = rows.get(f"{slow} {ratio}x", {}), rows.get(f"{fast} {ratio}x", {})
        return a["seconds"] / b["seconds"] if a.get("seconds") and b.get("seconds") else None
    over_um = [um / deepum for runs in DEEPUM.values() for um, _, deepum in runs.values()]
    over_lms = [lms / deepum for runs in DEEPUM.values() for _, lms, deepum in runs.values() if lms]
    return {"deepum_over_um": (min(over_um), max(over_um)), "deepum_over_lms": (min(over_lms), max(over_lms)),
            "deepum_average": DEEPUM_AVERAGE, "cap_over_2lm": speedup("2lm", "cap"),
            "cap_over_caLMP": speedup("caLMP", "cap")}


def on_paper_line(p: dict) -> str:
    fmt = lambda x: "-" if x is None else f"{x:.2f}x"  # noqa: E731
    return (f"on paper, DeepUM (V100, published): ResNet-152/200 {p['deepum_over_um'][0]:.1f}-"
            f"{p['deepum_over_um'][1]:.1f}x naive unified memory, {p['deepum_over_lms'][0]:.2f}-"
            f"{p['deepum_over_lms'][1]:.2f}x LMS (all its models: {p['deepum_average'][0]:.2f}x, "
            f"{p['deepum_average'][1]:.2f}x); here cap {fmt(p['cap_over_2lm'])} 2lm, {fmt(p['cap_over_caLMP'])} caLMP")


def table_row(name: str, r: dict, base: float | None, link: float) -> list:
    if "error" in r:
        return [name, "error: " + r["error"][:100]] + [""] * (len(COLUMNS) - 2)
    speed = base / r["seconds"] if base else float("nan")
    moved = r.get("to_slow", 0) + r.get("to_fast", 0)
    pct = lambda v: "-" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    mem = (f"{r['peak'] / GiB:.2f} of {r['capacity'] / GiB:.2f}" if "peak" in r else
           f"{r['planned'] / GiB:.2f} planned" if r.get("planned") is not None else "-")
    share = f" ({100 * gbps(moved, r['seconds']) * 1e9 / link:.0f}%)" if link == link and link > 0 else ""
    return [name, f"{1e3 * r['seconds']:.1f}", f"{speed:.2f}", f"{r.get('to_slow', 0) / GiB:.2f}",
            f"{r.get('to_fast', 0) / GiB:.2f}", f"{gbps(moved, r['seconds']):.1f}{share}",
            f"{1e3 * floor_seconds(r, link):.1f}", f"{1e3 * r.get('hidden', 0):.1f}",
            f"{1e3 * r.get('exposed', 0):.1f}", pct(r.get("coverage")), pct(r.get("accuracy")), mem]


def ratio_targets(name: str, ratio: int, rows: dict, base: float | None, link: float,
                  bound: float | None = None) -> dict:
    """PASS/MISS lines of one model at one ratio, each naming the PCIe floor where it caps the target:
    the floor of the best row's own copies, and ``bound`` (:func:`bound_speed` of the program the
    targets run) where that is lower than the target."""
    def speed(row):
        r = rows.get(row, {})
        return base / r["seconds"] if base and "seconds" in r else 0.0

    out = {}
    want = TARGET_AT.get(ratio, 0.75)
    best = max(("cap", "caLMP"), key=speed)
    line = f"{name} {ratio}x: cap or caLMP >= {want}x whole-jit speed (best {best} {speed(best):.2f}x)"
    if bound is not None and bound < want:
        line += (f"; no policy over this program's objects can pass it: their live bytes cap it at {bound:.2f}x "
                 f"(only recomputing moves less)")
    elif base and "seconds" in rows.get(best, {}):
        floor = base / max(base, floor_seconds(rows[best], link))
        if floor < want:
            line += (f"; the PCIe floor of {best}'s copies caps it at {floor:.2f}x (a floor this schedule "
                     f"moves; a schedule that moves less could do better)")
    out[line] = speed(best) >= want
    remat = speed("remat")
    line = f"{name} {ratio}x: cap and caLMP faster than remat ({speed('cap'):.2f}x, {speed('caLMP'):.2f}x vs {remat:.2f}x)"
    if bound is not None and bound <= remat:
        line += f"; no policy over this program's objects can pass it: their live bytes cap both at {bound:.2f}x"
    out[line] = min(speed("cap"), speed("caLMP")) > remat > 0
    return out


def copy_seconds(copies: int, nbytes: int, device: str, repeats: int = 5) -> float:
    """Seconds that ``copies`` device-to-device copies of ``nbytes`` in all (equal parts) take
    on the GPU, one after the other on one stream (`event_time`); on the CPU (``device``), as
    many host copies."""
    part = -(-nbytes // max(copies, 1))
    if device != "gpu":
        import numpy as np
        src, dst = np.ones(part, np.uint8), np.empty(part, np.uint8)

        def copy_all():
            for _ in range(copies):
                np.copyto(dst, src)
        return median_time(copy_all, repeats, warmup=0)
    import cupy as cp
    src, dst = cp.ones(part, cp.uint8), cp.empty(part, cp.uint8)
    stream = cp.cuda.get_current_stream()

    def queue():
        for _ in range(copies):
            cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, part, 3, stream.ptr)  # device to device
    return event_time(queue, repeats)


def main(argv=None) -> int:
    p = parser(__doc__, "results/gpu_cnn.json")
    p.add_argument("--footprint", default="12GiB",
                   help="target footprint that sets the batch (default 12GiB; --quick: 160MiB)")
    p.add_argument("--ratios", default="2,4", help="footprint / HBM budget ratios (default 2,4; --quick: 2)")
    p.add_argument("--models", default="resnet,densenet", help="resnet and/or densenet (default both)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per row, after the warm-up (default 5)")
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed first steps (cap learns the order in the first) (default 2)")
    p.add_argument("--pm-dir", default=None, help="directory for a PM file, if host memory is short")
    p.add_argument("--no-recompute", dest="recompute", action="store_false",
                   help="leave out the caLMP rows of the model that recomputes batch norm + ReLU outputs")
    p.add_argument("--device", choices=("gpu", "cpu"), default="gpu",
                   help="cpu: DRAM stands for HBM, a smoke test of this script without a GPU (default gpu)")
    args = p.parse_args(argv)
    from cachedarrays import parse_size
    from cachedarrays.devices import gpu
    from cnn.trainer import measure_footprint
    if args.device == "gpu" and not gpu.available():
        print("error: this benchmark needs a CUDA GPU with CuPy and the JAX CUDA plugin", file=sys.stderr)
        return 2
    footprint = parse_size("160MiB" if args.quick and args.footprint == "12GiB" else args.footprint)
    ratios = [2] if args.quick and args.ratios == "2,4" else [int(r) for r in args.ratios.split(",")]
    if args.steps < 1 or args.warmup < 1 or any(r < 1 for r in ratios):
        p.error("--steps, --warmup and every ratio must be at least 1")
    specs = QUICK_MODELS if args.quick else MODELS
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = [n for n in names if n not in specs]
    if bad:
        p.error(f"unknown model(s) {bad}; choose from {', '.join(specs)}")
    gpu, size = args.device == "gpu", 64 * MiB if args.quick else 256 * MiB
    link = measure_link(size) if gpu else float("nan")
    link_down = measure_link(size, down=True) if gpu else float("nan")
    env = environment()
    print(f"target footprint {footprint / GiB:.2f} GiB; bandwidth measured now: host->GPU {link / 1e9:.1f} GB/s, "
          f"GPU->host {link_down / 1e9:.1f} GB/s; host CPU {env['cpu_model']}", flush=True)
    results, targets = {"environment": env, "link_bytes_per_second": link,
                        "link_down_bytes_per_second": link_down, "runs": []}, {}
    for name in names:
        cfg, fp = choose(specs[name], footprint, args.pm_dir, args.device)
        label = f"{name} {cfg.label}: footprint {fp.footprint / GiB:.2f} GiB"
        print(f"\n{label}", flush=True)
        rows: dict = {}

        def measure(row: str, run) -> None:
            rows[row] = run()
            if "error" in rows[row]:
                print(f"  {row}: {rows[row]['error']}", flush=True)
                return
            gc.collect()  # the row's GPU heap goes once nothing aliases it, before the next row allocates
            base = rows.get("whole-jit", {}).get("seconds")
            r = rows[row]
            extra = (f" | {r['kernels']} kernels a step, {1e3 * r['host_seconds_per_kernel']:.3f} ms of host time "
                     f"each (dispatch to release)" if r.get("kernels") else "")
            if r.get("step_seconds"):
                extra += " | steps ms " + " ".join(f"{1e3 * t:.1f}" for t in r["step_seconds"])
            print("  " + " | ".join(table_row(row, r, base, link)) + extra, flush=True)

        budgets = {ratio: -(-fp.footprint // ratio // 4096) * 4096 for ratio in ratios}
        rc = fp_rc = None
        if args.recompute:  # the same model recomputing batch norm + ReLU outputs in backward: fewer live bytes
            rc = dataclasses.replace(cfg, recompute=True)
            fp_rc = measure_footprint(rc, pm_dir=args.pm_dir)
            print(f"  with recompute: footprint {fp_rc.footprint / GiB:.2f} GiB", flush=True)
        run = {"model": name, "config": dataclasses.asdict(cfg), "footprint": dataclasses.asdict(fp),
               "recompute_footprint": None if fp_rc is None else dataclasses.asdict(fp_rc),
               "rows": rows, "budgets": budgets}
        results["runs"].append(run)

        def ours(mode: str, ratio: int, recompute: bool = False) -> None:
            c, f = (rc, fp_rc) if recompute else (cfg, fp)
            measure(f"{mode}{RECOMPUTE if recompute else ''} {ratio}x",
                    lambda: run_ours(c, f, mode, budgets[ratio], args.steps, args.warmup, args.pm_dir))
            write_json(args.out, {**results, "targets": targets})

        # the rows the targets need first, so that a run cut short still has them; ours all in HBM
        # before any JAX variant, whose allocator keeps the memory it grew to (the 1.25x footprint
        # heap found 30 of 79 GiB free after whole-jit at 25 GiB)
        measure("ours, HBM", lambda: run_ours(cfg, fp, "dram", None, args.steps, args.warmup, args.pm_dir))
        measure("whole-jit", lambda: run_jax(cfg, "whole", args.steps, args.warmup))
        hbm = rows["ours, HBM"]
        if hbm.get("bare_seconds"):
            measure(BARE, lambda: {"seconds": hbm["bare_seconds"]})
            copying = copy_seconds(hbm["output_copies"], hbm["output_copy_bytes"], args.device)
            print(f"  ours, HBM copied {hbm['output_copies']} kernel outputs a step into their regions, "
                  f"{hbm['output_copy_bytes'] / GiB:.2f} GiB: {1e3 * copying:.1f} ms of GPU time alone "
                  f"({gbps(hbm['output_copy_bytes'], copying):.0f} GB/s copied); {hbm['outputs_elided']} more "
                  f"({hbm['output_bytes_elided'] / GiB:.2f} GiB) were never copied (dead or overwritten first)", flush=True)
            measure(BARE_COPIES, lambda: {"seconds": hbm["bare_seconds"] + copying, "copy_seconds": copying})
        if rc is not None:  # fewer kernels and fewer outputs stored: what the per-layer overhead is without them
            measure(f"ours, HBM{RECOMPUTE}",
                    lambda: run_ours(rc, fp_rc, "dram", None, args.steps, args.warmup, args.pm_dir))
        for ratio in ratios:
            for mode in ("caLMP", "cap"):
                ours(mode, ratio)
        measure("remat", lambda: run_jax(cfg, "remat", args.steps, args.warmup))
        for ratio in ratios:
            ours("2lm", ratio)
            if rc is not None:
                ours("caLMP", ratio, recompute=True)
        measure("offload", lambda: run_jax(cfg, "offload", args.steps, args.warmup))
        base = rows["whole-jit"].get("seconds")
        line = (f"{name}: ours all in HBM >= {TARGET_HBM}x whole-jit "
                f"({base / hbm['seconds'] if base and 'seconds' in hbm else 0:.2f}x)")
        if base and rows.get(BARE, {}).get("seconds"):
            line += f"; the same kernels on bare arrays: {base / rows[BARE]['seconds']:.2f}x"
        if base and rows.get(BARE_COPIES, {}).get("seconds"):
            line += f", and with our output copies: {base / rows[BARE_COPIES]['seconds']:.2f}x"
        if base and rows.get(f"ours, HBM{RECOMPUTE}", {}).get("seconds"):
            line += f"; ours recomputing batch norm + ReLU: {base / rows[f'ours, HBM{RECOMPUTE}']['seconds']:.2f}x"
        targets[line] = bool(base and "seconds" in hbm and base / hbm["seconds"] >= TARGET_HBM)
        if base:
            targets[f"{name}: whole-jit step >= {TARGET_MS} ms ({1e3 * base:.0f} ms)"] = base >= TARGET_MS / 1e3
        ref = rows["whole-jit"].get("losses")
        if ref:
            diffs = {row: max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref))
                     for row, r in rows.items() if r.get("losses") and row != "whole-jit"}
            print("  losses against whole-jit's on the same batches, largest relative difference: "
                  + ", ".join(f"{row} {d:.1e}" for row, d in diffs.items()), flush=True)
            run["loss_differences"] = diffs
        for ratio in ratios:
            table = [table_row(row, rows[row], base, link)
                     for row in ("whole-jit", BARE, BARE_COPIES, "ours, HBM", f"ours, HBM{RECOMPUTE}", "remat",
                                 "offload") if row in rows]
            table += [table_row(mode, rows[f"{mode} {ratio}x"], base, link) for mode in OUR_MODES]
            if rc is not None:
                table.append(table_row(f"caLMP{RECOMPUTE}", rows[f"caLMP{RECOMPUTE} {ratio}x"], base, link))
            print_table(f"{label}, HBM budget {budgets[ratio] / GiB:.2f} GiB ({ratio}x)", COLUMNS, table)
            bounds = {"this program": fp} | ({} if fp_rc is None else {"with recompute": fp_rc})
            run.setdefault("bounds", {})[ratio] = {}
            known = bool(base) and link == link  # a GPU run: the link was measured
            for what, f in bounds.items():
                c = rc if f is fp_rc else cfg
                need, carried = max(0, f.footprint - budgets[ratio]), carried_bytes(c, f)
                down_need = max(0, need - carried)
                args_ = (f.footprint, budgets[ratio], link, link_down, carried)
                run["bounds"][ratio][what] = {
                    "bytes_up": need, "bytes_down": down_need, "carried": carried,
                    "seconds": bound_seconds(*args_) if known else None,
                    "seconds_up_only": bound_seconds(*args_[:3]) if known else None,
                    "speed": bound_speed(base, *args_) if known else None}
                if known:
                    print(f"  no policy beats, {what}: {f.footprint / GiB:.2f} GiB live at the high-water mark, "
                          f"{down_need / GiB:.2f} GiB of it down the link before it and {need / GiB:.2f} GiB up after "
                          f"it every step = {1e3 * bound_seconds(*args_):.1f} ms -> "
                          f"{bound_speed(base, *args_):.2f}x whole-jit (up alone: "
                          f"{1e3 * bound_seconds(*args_[:3]):.1f} ms)", flush=True)
            paper = run.setdefault("on_paper", {})[ratio] = on_paper(rows, ratio)
            print("  " + on_paper_line(paper), flush=True)
            targets.update(ratio_targets(name, ratio, {**rows, **{m: rows[f"{m} {ratio}x"] for m in OUR_MODES}},
                                         base, link, bound_speed(base, fp.footprint, budgets[ratio], link, link_down,
                                                                 carried_bytes(cfg, fp)) if known else None))
    write_json(args.out, {**results, "targets": targets})
    print_targets(targets)
    return 0


if __name__ == "__main__":
    sys.exit(main())
