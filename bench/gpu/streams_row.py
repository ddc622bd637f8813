#!/usr/bin/env python3
"""One table row of bench/gpu/streams.sh from a run's logs.

frames/s: frames of all streams over gst-launch's PLAYING -> EOS time ("Execution ended
after"); GPU and decoder busy: the mean of nvidia-smi's 200 ms samples while a decoder was
busy; CPU busy: all cores' share not idle over the whole run (start-up included), from
/proc/stat before and after; GPU memory: the peak over the run less the memory in use before it; time in
trtclassify: each element logs its p50, p99 and slowest frame at stop, the row gives the
median of the streams' p50, the median and the worst of the streams' p99, and the slowest
frame of all (its wait and its number in its stream: start-up, steady state or end); the same
p99s and slowest frame after each stream's start-up (frames that came in 2 s or more after its
first); and the longest any stream waited for the shared engine's lock.
"""
import argparse
import re
import statistics


def seconds(text):
    value, unit = re.fullmatch(r"([0-9.]+)(ns|µs|us|ms|s)", text).groups()
    return float(value) * {"ns": 1e-9, "µs": 1e-6, "us": 1e-6, "ms": 1e-3, "s": 1.0}[unit]


def main():
    p = argparse.ArgumentParser()
    for name in ("label", "launch", "log", "smi"):
        p.add_argument("--" + name, required=True)
    for name in ("streams", "frames", "idle-mib", "rc"):
        p.add_argument("--" + name, type=int, required=True)
    p.add_argument("--cpu", nargs=2, required=True, help="/proc/stat's cpu line before, after")
    a = p.parse_args()

    # user nice system idle iowait irq softirq steal ...: idle and iowait are not busy.
    before, after = ([int(x) for x in line.split()[1:9]] for line in a.cpu)
    delta = [y - x for x, y in zip(before, after)]
    cpu = 1 - (delta[3] + delta[4]) / sum(delta) if sum(delta) else 0.0

    launch = open(a.launch, errors="replace").read()
    m = re.search(r"Execution ended after (\d+):(\d+):([0-9.]+)", launch)
    playing = int(m[1]) * 3600 + int(m[2]) * 60 + float(m[3]) if m else 0.0
    total = a.streams * a.frames
    fps = total / playing if playing else 0.0

    busy, dec, mem = [], [], []
    for line in open(a.smi, errors="replace"):
        parts = [x.strip() for x in line.split(",")]
        try:
            g, d, u = (float(x) for x in parts[:3])
        except ValueError:
            continue
        mem.append(u)
        if d > 0:
            busy.append(g)
            dec.append(d)
    mean = lambda xs: statistics.fmean(xs) if xs else 0.0
    added = max(mem) - a.idle_mib if mem else 0.0

    p50s, p99s, slowest, lock_waits = [], [], [], []
    frames_out = 0
    duration = r"([0-9.]+(?:ns|µs|us|ms|s))"
    steady_p99s, steady_slowest = [], []
    pattern = re.compile(
        r"(\d+) frames out; time in the element \(buffer in to out\): "
        rf"p50 {duration}, p99 {duration}, max {duration} \(frame (\d+)\)"
        rf"(?:; after the first \S+: \d+ frames, p50 {duration}, p99 {duration}, "
        rf"max {duration} \(frame (\d+)\))?"
        rf"(?:; longest wait for the shared engine {duration})?"
    )
    for m in pattern.finditer(open(a.log, errors="replace").read()):
        frames_out += int(m[1])
        p50s.append(seconds(m[2]) * 1e3)
        p99s.append(seconds(m[3]) * 1e3)
        slowest.append((seconds(m[4]) * 1e3, int(m[5])))
        if m[7]:
            steady_p99s.append(seconds(m[7]) * 1e3)
            steady_slowest.append((seconds(m[8]) * 1e3, int(m[9])))
        if m[10]:
            lock_waits.append(seconds(m[10]) * 1e3)
    if p50s:
        wait, frame = max(slowest)
        lock_wait = f"{max(lock_waits):.1f}" if lock_waits else "–"
        if steady_p99s:
            swait, sframe = max(steady_slowest)
            steady = (
                f"{statistics.median(steady_p99s):.1f} | {max(steady_p99s):.1f} | "
                f"{swait:.1f} (frame {sframe})"
            )
        else:
            steady = "– | – | –"
        latency = (
            f"{statistics.median(p50s):.1f} | {statistics.median(p99s):.1f} | "
            f"{max(p99s):.1f} | {wait:.1f} (frame {frame}) | {steady} | {lock_wait}"
        )
    else:
        latency = "– | – | – | – | – | – | – | –"
    out = f"{frames_out}" if p50s else "–"
    print(
        f"| {a.label} | {a.streams} | {total} | {out} | {playing:.2f} s | {fps:,.0f} | "
        f"{fps / a.streams:,.0f} | {mean(busy):.0f}% | {mean(dec):.0f}% | {cpu:.0%} | {added:,.0f} MiB | "
        f"{added / a.streams:,.0f} | {latency} | {a.rc} |"
    )


if __name__ == "__main__":
    main()
