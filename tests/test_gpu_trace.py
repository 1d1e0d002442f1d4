"""The summary ``benchmarks/gpu_trace.py`` prints of a kernel trace (no GPU needed)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the project root, where benchmarks/ is
from benchmarks.gpu_trace import overlap, summarise, union  # noqa: E402


def kernel(name, ts, dur, stream, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


def test_union_and_overlap():
    assert union([(5, 7), (0, 2), (1, 3), (7, 8)]) == [[0, 3], [5, 8]]
    assert overlap([[0, 3], [5, 8]], [[2, 6]]) == 2
    assert overlap([[0, 1]], [[1, 2]]) == 0


def test_the_summary_of_two_streams_and_a_host_call():
    def host(name, ts, dur):
        return {"ph": "X", "cat": "cuda_runtime", "name": name, "ts": ts, "dur": dur, "tid": 9}
    events = [kernel("move", 1000, 4000, 76), kernel("move", 9000, 1000, 76),
              kernel("update", 3000, 3000, 7), kernel("copy", 20000, 500, 7, "gpu_memcpy"),
              kernel("tiny", 4000, 100, 7), kernel("late", 17000, 1000, 76),
              host("cudaEventSynchronize", 1500, 3000), host("cudaLaunchKernel", 2000, 100),
              host("cudaMemcpyAsync", 18000, 500),
              {"ph": "X", "cat": "cpu_op", "name": "not a GPU event", "ts": 0, "dur": 99999}]
    s = summarise(events, timeline_ms=15, shortest_us=600)
    assert s["gpu_events"] == 6
    assert s["span_ms"] == 19.5  # 1.0 ms .. 20.5 ms
    assert s["gpu_busy_ms"] == 7.5  # 1-6, 9-10, 17-18, 20-20.5
    st = s["streams"]
    assert st["76"]["busy_ms"] == 6.0 and st["76"]["overlapped_by_others_ms"] == 2.0
    assert st["7"]["busy_ms"] == 3.5 and st["7"]["overlapped_by_others_ms"] == 2.0
    assert st["76"]["top"] == [("move", 5.0), ("late", 1.0)]
    assert s["host_calls_ms"] == {"9": [("cudaEventSynchronize", 3.0), ("cudaMemcpyAsync", 0.5),
                                        ("cudaLaunchKernel", 0.1)]}
    # long host calls: 200 us or more, within the timeline's 15 ms (not the short launch, not the late copy)
    assert s["long_host_calls"] == [(0.5, 3.0, "9", "cudaEventSynchronize")]
    # the timeline: kernels of 600 us or more within 15 ms (not "tiny", not "late", not the copy)
    assert [e[3] for e in s["timeline"]] == ["move", "update", "move"]
    assert summarise([e for e in events if e["cat"] == "cpu_op"]) == {"gpu_events": 0}
