"""GPU timing and the HBM copy ceiling, shared by the benchmarks.

- :func:`time_cuda`: median milliseconds of one call, from CUDA events around each call. The call
  is captured once into a CUDA graph and replayed (no host launch overhead in the numbers; falls
  back to eager launches when capture fails, e.g. an op that syncs), and by default the L2 cache is
  flushed before every timed call so the numbers are HBM numbers, not L2 numbers. The flush READS
  a 512 MiB buffer: L2 then holds clean lines only (a memset flush, as triton's do_bench uses,
  leaves ~50 MiB of dirty lines whose write-back would be charged to the timed call: +10 us, which
  more than doubles a decode-sized op).
- :func:`copy_gbps`: the HBM copy ceiling (bytes read + written), the best of ``dst.copy_(src)``
  (cudaMemcpy: eager and as a graph memcpy node) and an SM copy kernel (Triton, in a graph), timed
  the same way and cached per process so every benchmark of a run compares against one number.
- :func:`device_time`: median device span of one call (first kernel start to last kernel end,
  profiler timestamps) under the same replay and flush, without the graph's launch on the device;
  :func:`replay_floor_ms` is that launch cost as :func:`time_cuda` sees it (a one-kernel graph);
  :func:`kernel_us` splits the same call's device time by kernel name.
- :func:`wall_ms`: wall-clock milliseconds of each of ``iters`` calls (CPU runs: no CUDA events).
- :func:`host_us`: host µs per eager call, the GPU kept busy behind a sleep kernel (launches only
  queue, nothing waits for the device).
- :func:`record`: put rates, ceiling and baseline in ``benchmark.extra_info`` (keys ``gbps`` and
  ``ceiling_gbps`` are what ``epmoe bench`` reports) and let pytest-benchmark time the replay too.

Import from a benchmark module as ``import _timing`` (pytest puts ``benchmarks/`` on sys.path).
"""

import functools
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Dict, Optional

import torch
import triton
import triton.language as tl

KERNEL_NAME_CHARS = 80  # kernel_us's key: a kernel name's template arguments past it are cut
FLUSH_BYTES = 512 * 2**20  # > 8x the H100/H200 L2 (50 MiB): a memset of it evicts everything
COPY_BYTES = 2 * 2**30  # ceiling buffer: 2 GiB read + 2 GiB written
ITERS = 100  # timed calls per measurement (median)
WARMUP = 3  # eager calls before capture: compiles Triton kernels, faults pages in
HOST_CALLS, HOST_REPEATS = 40, 7  # host_us: calls per timed pass, passes (median)
HOST_SLEEP_CYCLES = 200_000_000  # ~100 ms of GPU sleep at H200 clocks: covers HOST_CALLS calls


@dataclass
class Timing:
    ms: float  # median of the timed calls
    min_ms: float
    iters: int
    method: str  # "cuda_graph" or "eager"

    def gbps(self, nbytes: int) -> float:
        return nbytes / self.ms / 1e6


@functools.cache
def _flush_buffer(device: int) -> torch.Tensor:
    return torch.zeros(FLUSH_BYTES // 8, dtype=torch.int64, device=device)


def _flush(buf: torch.Tensor) -> None:
    """Evict L2 by reading ``buf`` (leaves clean lines: no write-back lands in the timed call)."""
    buf.sum()


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=m), mask=m)


def sm_copy(dst: torch.Tensor, src: torch.Tensor, block: int = 4096) -> None:
    """Copy by an SM kernel (int32 words), the access pattern of the stage kernels."""
    s, d = src.view(torch.int32), dst.view(torch.int32)
    _copy_kernel[(triton.cdiv(s.numel(), block),)](s, d, s.numel(), BLOCK=block, num_warps=4)


def _capture(fn: Callable[[], object]) -> Optional[Callable[[], None]]:
    """Replay of a CUDA graph of one ``fn()`` call, or None when ``fn`` cannot be captured."""
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except Exception:  # noqa: BLE001 - any capture failure means: time it eagerly
        torch.cuda.synchronize()
        return None
    return graph.replay


def time_cuda(
    fn: Callable[[], object],
    iters: int = ITERS,
    warmup: int = WARMUP,
    flush_l2: bool = True,
    use_graph: bool = True,
    ahead_cycles: int = 0,
) -> Timing:
    """Median CUDA-event time (ms) of one call of ``fn`` on the current device. ``ahead_cycles``:
    a GPU sleep of that many cycles between the flush and the start event, so the host queues the
    whole call before the device reaches it (the call's device time, its host time hidden)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up off the default stream, as graph capture requires
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    run = _capture(fn) if use_graph else None
    method = "cuda_graph" if run is not None else "eager"
    run = run or fn
    run()  # first replay uploads the graph
    flush = _flush_buffer(torch.cuda.current_device()) if flush_l2 else None
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for s, e in zip(starts, ends, strict=True):
        if flush is not None:
            _flush(flush)
        if ahead_cycles:
            torch.cuda._sleep(ahead_cycles)
        s.record()
        run()
        e.record()
    torch.cuda.synchronize()
    times = [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]
    return Timing(statistics.median(times), min(times), iters, method)


def device_activities(prof) -> list:
    """(name, start_us, end_us) of every device-side activity (kernel, memcpy, memset) of a
    torch.profiler run, by start."""
    out = []
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            out.append((ev.name, ev.time_range.start, ev.time_range.end))
    return sorted(out, key=lambda a: a[1])


def device_time(fn: Callable[[], object], iters: int = 50) -> Optional[Timing]:
    """Median device span (ms) of one call of ``fn``: from its first kernel's start to its last
    kernel's end, from the profiler's (CUPTI) timestamps, as DeepGEMM's and DeepEP's benchmarks
    time kernels. The call is a CUDA-graph replay after an L2 flush, as in :func:`time_cuda`, but
    the graph's launch on the device (the gap between the stream reaching the replay and its
    first kernel starting, ~3 us on the H200, which a real layer's graph or stream overlaps with
    the work before it) is not counted. None when ``fn`` cannot be captured or its activities
    cannot be told from the flush's."""
    run = _capture(fn)
    if run is None:
        return None
    spans = [_span(c) for c in profiled_calls(run, iters)]
    if len(spans) != iters:
        return None
    ms = [us / 1e3 for us in spans]
    return Timing(statistics.median(ms), min(ms), iters, "device_span")


def kernel_us(fn: Callable[[], object], iters: int = 20) -> Optional[Dict[str, float]]:
    """Median device µs of each kernel (and copy) launch of one call of ``fn``, by name (see
    :func:`per_kernel_us`), under the replay and flush of :func:`device_time`: where a call's time
    goes. None when ``fn`` cannot be captured."""
    run = _capture(fn)
    if run is None:
        return None
    return per_kernel_us(profiled_calls(run, iters))


def per_kernel_us(calls: list) -> Dict[str, float]:
    """{key: median µs over ``calls``} (each call a list of (name, start, end) activities in
    launch order). The key is the name cut to KERNEL_NAME_CHARS, and for the n-th launch of that
    cut name in a call (n >= 2) the cut name + " #n": GEMM1 and GEMM2 of one kernel template stay
    apart. An activity counts from its start or, if later, the end of the ones before it: a
    kernel launched with PDL starts while the one before it runs, and waits (the call's µs then
    sum to its span less the gaps). A call without a key counts 0."""
    per_key: Dict[str, list] = {}
    for call in calls:
        seen: Dict[str, int] = {}
        done = float("-inf")
        for name, start, end in call:
            cut = name[:KERNEL_NAME_CHARS]
            n = seen[cut] = seen.get(cut, 0) + 1
            per_key.setdefault(cut if n == 1 else f"{cut} #{n}", []).append(
                max(end - max(start, done), 0.0)
            )
            done = max(done, end)
    return {k: round(statistics.median(v + [0.0] * (len(calls) - len(v))), 1)
            for k, v in per_key.items()}  # fmt: skip


def profiled_calls(run: Callable[[], object], iters: int) -> list:
    """The device activities (name, start_us, end_us) of each of ``iters`` calls of ``run``, each
    after an L2 flush, from one torch.profiler run (``run`` is called once before, untimed)."""
    run()
    device = torch.cuda.current_device()
    flush, flush_names = _flush_buffer(device), _flush_names(device)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            _flush(flush)
            run()
        torch.cuda.synchronize()
    return split_calls(device_activities(prof), flush_names)


@functools.cache
def _flush_names(device: int) -> frozenset:
    """Names of the device activities one L2 flush launches (told apart from a timed call's)."""
    flush = _flush_buffer(device)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            _flush(flush)
        torch.cuda.synchronize()
    return frozenset(a[0] for a in device_activities(prof))


def split_calls(activities, flush_names) -> list:
    """The runs of ``activities`` ((name, start, end) by start) between flushes, a flush being any
    activity named in ``flush_names``: one list of activities a call."""
    calls, cur = [], None
    for act in activities:
        if act[0] in flush_names:
            cur = None
            continue
        if cur is None:
            cur = []
            calls.append(cur)
        cur.append(act)
    return calls


def _span(call) -> float:
    """End of a call's last activity - start of its first (activities by start)."""
    return max(end for _, _, end in call) - call[0][1]


def call_spans(activities, flush_names) -> list:
    """Span (end of the last - start of the first) of each run of activities between flushes
    (:func:`split_calls`)."""
    return [_span(c) for c in split_calls(activities, flush_names)]


@functools.cache
def copy_device_gbps(nbytes: int = COPY_BYTES) -> float:
    """The copy ceiling by :func:`device_time` (best of memcpy and the SM copy kernel): the bar
    for ``device_gbps``, measured the same way."""
    nbytes, src, dst = _copy_buffers(nbytes, torch.cuda.current_device())
    best = 0.0
    for fn in (lambda: dst.copy_(src), lambda: sm_copy(dst, src)):
        t = device_time(fn, iters=10)
        if t is not None:
            best = max(best, t.gbps(2 * nbytes))
    return best


@triton.jit
def _tiny_kernel(ptr):
    tl.store(ptr, tl.load(ptr) + 1)


@functools.cache
def replay_floor_ms() -> float:
    """:func:`time_cuda` of a graph of one trivial kernel (one word read and written): the fixed
    cost of the replay timing itself, in every op's ``ms`` (measured once per process)."""
    word = torch.zeros(1, dtype=torch.int32, device="cuda")
    return time_cuda(lambda: _tiny_kernel[(1,)](word, num_warps=1)).ms


def launch_ms(fn: Callable[[], object], iters: int) -> float:
    """Median CUDA-event time (ms) of ``iters`` single eager launches of ``fn`` (no L2 flush)."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for s, e in zip(starts, ends, strict=True):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))


def wall_ms(fn: Callable[[], object], iters: int, warmup: int = 1) -> list:
    """Wall-clock ms of each of ``iters`` calls of ``fn`` after ``warmup`` calls (CPU timing)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def host_us(
    fn: Callable[[], object],
    calls: int = HOST_CALLS,
    repeats: int = HOST_REPEATS,
    sleep_cycles: int = HOST_SLEEP_CYCLES,
) -> float:
    """Host µs per eager call of ``fn``: wall time of ``calls`` calls / ``calls``, each pass behind
    a GPU sleep of ``sleep_cycles`` (the final sync is outside the timed span); median of
    ``repeats`` passes."""
    fn()
    torch.cuda.synchronize()
    vals = []
    for _ in range(repeats):
        if hasattr(torch.cuda, "_sleep"):
            torch.cuda._sleep(sleep_cycles)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        vals.append((t1 - t0) / calls * 1e6)
    return statistics.median(vals)


def paired_ms(
    rounds: int,
    iters: int,
    warmup: int = 1,
    after_warmup: Optional[Callable[[], object]] = None,
    **fns: Callable[[], object],
) -> Dict[str, float]:
    """Median ms per launch of each function, measured in alternating rounds (same clocks, same
    thermals for both sides of a comparison). ``after_warmup``: e.g. a barrier across ranks."""
    for fn in fns.values():  # warm-up: compiles, autotunes, faults pages in
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    if after_warmup is not None:
        after_warmup()
    times: Dict[str, list] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            times[k].append(launch_ms(fn, iters))
    return {k: statistics.median(v) for k, v in times.items()}


def _copy_buffers(nbytes: int, device: int):
    """(nbytes rounded to 16, a filled uint8 source, a destination) for the copy ceilings."""
    nbytes = max(nbytes // 16 * 16, 16)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    return nbytes, src, torch.empty_like(src)


@functools.cache
def copy_timings(nbytes: int = COPY_BYTES, device: Optional[int] = None) -> Dict[str, float]:
    """GB/s (read + written) of an ``nbytes`` device copy by method: memcpy in a graph, memcpy
    eager, SM kernel in a graph."""
    device = torch.cuda.current_device() if device is None else device
    nbytes, src, dst = _copy_buffers(nbytes, device)
    kw = dict(iters=20 if nbytes >= 2**28 else ITERS, flush_l2=nbytes < 4 * FLUSH_BYTES)

    def memcpy():
        dst.copy_(src)

    def kernel():
        sm_copy(dst, src)

    return {
        "memcpy_graph": time_cuda(memcpy, **kw).gbps(2 * nbytes),
        "memcpy_eager": time_cuda(memcpy, use_graph=False, **kw).gbps(2 * nbytes),
        "sm_kernel_graph": time_cuda(kernel, **kw).gbps(2 * nbytes),
    }


def copy_gbps(nbytes: int = COPY_BYTES, device: Optional[int] = None) -> float:
    """Device-to-device copy ceiling (GB/s, bytes read + written): best of :func:`copy_timings`."""
    return max(copy_timings(nbytes, device).values())


def same_size_copy_gbps(nbytes: int) -> float:
    """Copy ceiling at this op's traffic (nbytes / 2 read, nbytes / 2 written): what a copy of the
    same size achieves, the fair bar for small (decode) ops that cannot fill the GPU."""
    half = max(nbytes // 2, 4096)
    return copy_gbps(half // 4096 * 4096)  # rounded: nearby sizes share one cached measurement


def record(
    benchmark,
    fn: Callable[[], object],
    nbytes: int,
    baseline: Optional[Callable[[], object]] = None,
    target: Optional[float] = None,
    target_vs_baseline: Optional[float] = None,
    **info,
) -> Dict[str, float]:
    """Time ``fn`` (and ``baseline``), fill ``benchmark.extra_info`` and run pytest-benchmark.

    ``nbytes``: bytes the op must move (read + written) for its GB/s; the baseline is charged the
    same bytes, so its GB/s is the same work over its time. ``target``: required fraction of the
    HBM copy ceiling; ``target_vs_baseline``: required speedup over the baseline.
    """
    t = time_cuda(fn)
    ceiling = copy_gbps()
    extra = dict(
        gpu=torch.cuda.get_device_name(),
        ms=t.ms,
        min_ms=t.min_ms,
        timing=t.method,
        bytes=nbytes,
        gbps=t.gbps(nbytes),
        ceiling_gbps=ceiling,
        ceiling_by_method=copy_timings(),
        frac_of_ceiling=t.gbps(nbytes) / ceiling,
        same_size_copy_gbps=same_size_copy_gbps(nbytes),
    )
    extra["frac_of_same_size_copy"] = extra["gbps"] / extra["same_size_copy_gbps"]
    dt = device_time(fn)
    if dt is not None:
        ceiling_device = copy_device_gbps()
        extra.update(
            device_ms=dt.ms,
            device_gbps=dt.gbps(nbytes),
            ceiling_device_gbps=ceiling_device,
            # against the higher of the two ceilings (the copy's own device span is the same bar)
            frac_of_ceiling_device=dt.gbps(nbytes) / max(ceiling, ceiling_device),
            replay_floor_ms=replay_floor_ms(),
        )
    if target is not None:
        extra["target_frac"] = target
        extra["meets_target"] = extra["frac_of_ceiling"] >= target
        if dt is not None:
            extra["meets_target_device"] = extra["frac_of_ceiling_device"] >= target
    if baseline is not None:
        tb = time_cuda(baseline, iters=max(ITERS // 4, 10))
        extra.update(
            eager_ms=tb.ms,
            eager_gbps=tb.gbps(nbytes),
            eager_timing=tb.method,
            speedup_vs_eager=tb.ms / t.ms,
        )
        if target_vs_baseline is not None:
            extra["target_speedup"] = target_vs_baseline
            extra["meets_speedup"] = extra["speedup_vs_eager"] >= target_vs_baseline
    extra.update(info)
    benchmark.extra_info.update(extra)
    call = _capture(fn) or fn

    def synced():
        call()
        torch.cuda.synchronize()

    benchmark.pedantic(synced, rounds=20, iterations=1, warmup_rounds=2)
    return extra
