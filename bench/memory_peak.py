"""What is alive on the GPU at the moment of peak allocated memory, and who allocated it.

Used by bench/run_one.py --memory-peak FILE: PyTorch's allocator history is recorded for the whole
run (model load included); afterwards the trace is replayed, the moment of the highest allocated
total is found, and the blocks alive then are grouped by the Python line that allocated them
(the innermost frame outside torch's own files). Measurement only: recording the history slows
the host a little and changes nothing on the GPU, so it runs in a separate pass.

    python -m bench.memory_peak SNAPSHOT.pickle      # analyse a snapshot saved earlier
"""
from __future__ import annotations

import bisect
import pickle
import sys
from collections import defaultdict

MAX_ENTRIES = 3_000_000  # allocator events kept: a 64-step run makes ~1M


def start_recording() -> bool:
    import torch

    if not torch.cuda.is_available():
        return False
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                             max_entries=MAX_ENTRIES)
    return True


def take_snapshot() -> dict:
    import torch

    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    return snap


_SKIP = ("/torch/", "/contextlib.py", "/functools.py", "<frozen", "/triton/")


def pool_split(segments: list[dict]) -> list[dict]:
    """Reserved and allocated bytes per allocator pool, from torch.cuda.memory_snapshot()'s
    segments (no history needed): pool "(0, 0)" is the ordinary (eager) pool; any other is a
    private pool, such as the one the decoder's CUDA graphs share. A graph pool's blocks count as
    allocated only while a capture holds them: during replays its activations are reserved but
    not allocated, so peak allocated memory leaves them out. Largest pool first."""
    pools: dict[str, dict] = {}
    for seg in segments:
        key = str(tuple(seg.get("segment_pool_id") or (0, 0)))  # (0, 0): DEFAULT_POOL
        p = pools.setdefault(key, {"pool": key, "reserved_bytes": 0, "allocated_bytes": 0, "segments": 0})
        p["reserved_bytes"] += int(seg.get("total_size", 0))
        p["allocated_bytes"] += int(seg.get("allocated_size", 0))
        p["segments"] += 1
    return sorted(pools.values(), key=lambda p: -p["reserved_bytes"])


DEFAULT_POOL = "(0, 0)"  # pool_split's name of the ordinary pool


def private_reserved_bytes(pools: list[dict]) -> int:
    """Reserved bytes of the private pools (the decoder graphs' pool) in a pool_split result."""
    return sum(p["reserved_bytes"] for p in pools if p["pool"] != DEFAULT_POOL)


def _frame(fr: dict) -> str:
    """'file:line function' with the site-packages / checkout prefix cut off."""
    short = fr.get("filename", "?").split("site-packages/")[-1].split("/work/main/")[-1]
    return f"{short}:{fr.get('line')} {fr.get('name')}"


def _site(frames: list[dict]) -> str:
    """The innermost frame that is not torch / Triton plumbing: the line that asked for memory."""
    for fr in frames:
        if not any(s in fr.get("filename", "") for s in _SKIP):
            return _frame(fr)
    return _frame(frames[0]) if frames else "(no Python frame: C++ autograd / allocator)"


def peak_breakdown(snap: dict, device: int = 0) -> dict:
    """Replays the allocation trace; returns the peak, and the blocks alive at it grouped by site."""
    trace = snap["device_traces"][device]
    live: dict[int, int] = {}
    total = peak = 0
    peak_at = -1
    for i, ev in enumerate(trace):
        act = ev["action"]
        if act == "alloc":
            live[ev["addr"]] = ev["size"]
            total += ev["size"]
            if total > peak:
                peak, peak_at = total, i
        elif act == "free_requested":  # the allocated counter drops here
            size = live.pop(ev["addr"], None)
            if size is not None:
                total -= size
    dropped = len(trace) >= MAX_ENTRIES
    return {"peak_bytes": peak, "event_index": peak_at, "events": len(trace), "trace_truncated": dropped,
            "by_site": _alive_by_site(trace, peak_at),
            "peak_frames": trace[peak_at].get("frames", [])[:12] if peak_at >= 0 else []}


def _alive_by_site(trace: list[dict], upto: int, keep=None) -> list[tuple[str, int, int]]:
    """The blocks alive right after event ``upto`` (those ``keep(i)`` accepts, i = the event that
    allocated it; all when None), grouped by allocating site: (site, bytes, blocks), largest first."""
    alive: dict[int, dict] = {}
    for i, ev in enumerate(trace[: upto + 1]):
        if ev["action"] == "alloc" and (keep is None or keep(i)):
            alive[ev["addr"]] = ev
        elif ev["action"] == "free_requested":
            alive.pop(ev["addr"], None)
    by_site: dict[str, list] = defaultdict(lambda: [0, 0])
    for ev in alive.values():
        site = by_site[_site(ev.get("frames", []))]
        site[0] += ev["size"]
        site[1] += 1
    return sorted(((k, v[0], v[1]) for k, v in by_site.items()), key=lambda r: -r[1])


def _site_table(rows: list[tuple[str, int, int]], top: int, header: str) -> list[str]:
    """Markdown lines of ``_alive_by_site`` rows: the ``top`` largest, then the rest summed."""
    lines = [f"| {header} | blocks | allocated at |", "| ---: | ---: | --- |"]
    for site, nbytes, count in rows[:top]:
        lines.append(f"| {nbytes / 2**20:9.1f} | {count} | `{site}` |")
    rest = rows[top:]
    if rest:
        lines.append(f"| {sum(r[1] for r in rest) / 2**20:9.1f} | {sum(r[2] for r in rest)} | ({len(rest)} other sites) |")
    return lines


_remembered_private: list[tuple[int, int]] = []


def _ranges(segments: list[dict]) -> list[tuple[int, int]]:
    return sorted((int(seg["address"]), int(seg["address"]) + int(seg["total_size"]))
                  for seg in segments if tuple(seg.get("segment_pool_id") or (0, 0)) != (0, 0))


def remember_private_ranges(segments: list[dict]) -> None:
    """Keep the private pools' segment ranges seen at the end of training (run_one calls it there):
    the graphs, and so their pool, may be freed before the history's snapshot is taken."""
    _remembered_private[:] = sorted(set(_remembered_private) | set(_ranges(segments)))


def _private_ranges(snap: dict) -> list[tuple[int, int]]:
    """(start, end) address ranges of the private pools' segments (the graph pool): those in the
    snapshot and those remembered at the end of training. A private pool keeps its segments for the
    graphs' lifetime."""
    return sorted(set(_ranges(snap.get("segments", []))) | set(_remembered_private))


def _in_ranges(addr: int, ranges: list[tuple[int, int]]) -> bool:
    """addr inside one of the sorted, disjoint (start, end) ranges."""
    i = bisect.bisect_right(ranges, (addr, float("inf"))) - 1
    return i >= 0 and ranges[i][0] <= addr < ranges[i][1]


_GROW = ("segment_alloc", "segment_map")
_SHRINK = ("segment_free", "segment_unmap")


def reserved_breakdown(snap: dict, device: int = 0) -> dict:
    """Replays the trace's segment events (reserved memory) and block events (allocated memory),
    split into the ordinary (eager) pool and the private pools by address. Returns the moment of
    the peak reserved total with both pools' reserved bytes then, and what the eager pool's share
    of that peak is made of: the window from the eager pool's last shrink (empty_cache) to the
    peak, the highest eager allocated total inside it (reserved minus it is what the eager pool
    keeps cached but never uses at once), and the eager blocks alive at that moment by site."""
    trace = snap["device_traces"][device]
    private = _private_ranges(snap)
    pool_of = [("private" if _in_ranges(int(ev.get("addr", 0)), private) else "eager") for ev in trace]
    res = {"eager": 0, "private": 0}
    by_stream: dict[int, int] = defaultdict(int)  # the eager pool's reserved bytes per stream
    peak = {"reserved": -1}
    last_shrink = -1
    for i, ev in enumerate(trace):
        act, size, pool = ev["action"], int(ev.get("size", 0)), pool_of[i]
        if act in _GROW:
            res[pool] += size
            if pool == "eager":
                by_stream[int(ev.get("stream", 0))] += size
            total = res["eager"] + res["private"]
            if total > peak["reserved"]:
                peak = {"reserved": total, "event": i, "pools_reserved": dict(res), "window_start": last_shrink + 1,
                        "eager_reserved_by_stream": dict(by_stream)}
        elif act in _SHRINK:
            res[pool] -= size
            if pool == "eager":
                by_stream[int(ev.get("stream", 0))] -= size
                last_shrink = i
    live: dict[int, tuple[int, str, int]] = {}
    alloc = {"eager": 0, "private": 0}
    alloc_stream: dict[int, int] = defaultdict(int)  # eager allocated bytes per stream
    stream_top: dict[int, int] = defaultdict(int)  # their highest value inside the window
    top = {"eager_allocated": -1}
    end = peak.get("event", -1)
    while 0 <= end < len(trace) - 1 and trace[end]["action"] != "alloc":
        end += 1  # up to the allocation that the peak's growth was for
    start = peak.get("window_start", 0)
    for i, ev in enumerate(trace[: end + 1]):
        act = ev["action"]
        if act == "alloc":
            stream = int(ev.get("stream", 0))
            live[ev["addr"]] = (int(ev["size"]), pool_of[i], stream)
            alloc[pool_of[i]] += int(ev["size"])
            if pool_of[i] == "eager":
                if i >= start and "eager_allocated_at_start_by_stream" not in top:
                    top["eager_allocated_at_start_by_stream"] = dict(alloc_stream)
                alloc_stream[stream] += int(ev["size"])
                if i >= start:
                    stream_top[stream] = max(stream_top[stream], alloc_stream[stream])
            if i >= start and alloc["eager"] > top["eager_allocated"]:
                top.update(eager_allocated=alloc["eager"], event=i, private_allocated=alloc["private"])
        elif act == "free_requested":
            got = live.pop(ev["addr"], None)
            if got is not None:
                alloc[got[1]] -= got[0]
                if got[1] == "eager":
                    alloc_stream[got[2]] -= got[0]
    top["eager_allocated_top_by_stream"] = dict(stream_top)
    # who made the eager pool grow inside the window: each growth event with the site of the next
    # allocation on its stream (the one the growth was for), largest first
    growth = []
    for i in range(start, end + 1):
        ev = trace[i]
        if ev["action"] in _GROW and pool_of[i] == "eager":
            stream = int(ev.get("stream", 0))
            nxt = next((t for t in trace[i + 1: i + 50] if t["action"] == "alloc" and int(t.get("stream", 0)) == stream), {})
            growth.append((int(ev.get("size", 0)), i, stream, _site(nxt.get("frames", [])), int(nxt.get("size", 0))))
    growth.sort(key=lambda r: -r[0])
    top_ev = trace[top["event"]] if top.get("event") is not None else {}
    return {"peak": peak, "eager_top": top, "events": len(trace),
            # the second replay to the top's moment: the eager blocks alive then, by site
            "eager_by_site": _alive_by_site(trace, top.get("event", -1), keep=lambda i: pool_of[i] == "eager"),
            "eager_top_frames": top_ev.get("frames", [])[:14], "eager_growth": growth[:20],
            "eager_growth_total_by_stream": {st: sum(g[0] for g in growth if g[2] == st) for st in {g[2] for g in growth}}}


def format_reserved(br: dict, top: int = 30) -> str:
    gib = 2**30
    p, e = br["peak"], br["eager_top"]
    lines = ["## Reserved memory (replayed segment events; eager = ordinary pool, private = graph pool)", ""]
    if p.get("event") is not None:
        pr = p["pools_reserved"]
        lines.append(f"peak reserved {p['reserved'] / gib:.3f} GiB at event {p['event']} of {br['events']}: "
                     f"eager {pr['eager'] / gib:.3f} GiB, private {pr['private'] / gib:.3f} GiB; the eager "
                     f"pool's last shrink before it: event {p['window_start'] - 1}")
    if e.get("event") is not None:
        lines.append(f"highest eager allocated between that shrink and the peak: {e['eager_allocated'] / gib:.3f} GiB "
                     f"at event {e['event']} (private allocated then {e['private_allocated'] / gib:.3f} GiB)")
    if p.get("event") is not None:
        tops = e.get("eager_allocated_top_by_stream", {})
        lines.append("eager pool per stream at the peak (reserved / highest allocated in the window, GiB): " + ", ".join(
            f"stream {st}: {r / gib:.3f} / {tops.get(st, 0) / gib:.3f}"
            for st, r in sorted(p.get("eager_reserved_by_stream", {}).items())))
        at_start = e.get("eager_allocated_at_start_by_stream", {})
        lines.append("eager allocated per stream when the window opens (GiB): " + ", ".join(
            f"stream {st}: {b / gib:.3f}" for st, b in sorted(at_start.items())))
    lines += [""] + _site_table(br["eager_by_site"], top, "MiB alive in the eager pool then")
    if br.get("eager_growth"):
        lines += ["", "the eager pool's growth inside the window, by stream (MiB): " + ", ".join(
            f"stream {st}: {b / 2**20:.0f}" for st, b in sorted(br["eager_growth_total_by_stream"].items())),
            "", "| MiB mapped | event | stream | for the allocation at | its MiB |", "| ---: | ---: | ---: | --- | ---: |"]
        lines += [f"| {g[0] / 2**20:.1f} | {g[1]} | {g[2]} | `{g[3]}` | {g[4] / 2**20:.1f} |" for g in br["eager_growth"]]
    lines += ["", "the allocation that set that eager maximum, innermost frame first:"]
    lines += [f"  {_frame(fr)}" for fr in br["eager_top_frames"]]
    return "\n".join(lines)


def format_breakdown(br: dict, top: int = 40) -> str:
    gib = 2**30
    lines = [f"peak allocated (replayed trace): {br['peak_bytes'] / gib:.3f} GiB at event {br['event_index']} "
             f"of {br['events']}" + (" (TRACE TRUNCATED: early blocks missing)" if br["trace_truncated"] else ""),
             ""] + _site_table(br["by_site"], top, "MiB alive at peak")
    lines += ["", "the allocation that set the peak, innermost frame first:"]
    lines += [f"  {_frame(fr)}" for fr in br["peak_frames"]]
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__)
        return 2
    with open(argv[0], "rb") as f:
        snap = pickle.load(f)
    print(format_breakdown(peak_breakdown(snap)))
    print()
    print(format_reserved(reserved_breakdown(snap)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
