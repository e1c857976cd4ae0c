"""The forward's tile boundaries in a trace kept by `hopper_timeline_gpu.py --keep-traces DIR`: per compute
warpgroup, the gap from one softmax's end to its next softmax's start inside a tile, against the gap
from a tile's last softmax to the next tile's first; then one program's steps around two tile
boundaries, both compute warpgroups merged by time (SM cycles from that program's start).

    python benchmarks/hopper_timeline_boundaries.py TRACE [--program 0] [--tile 3]

A tile starts at its `q_wait` step (or `tile_head`, the name `flash_fwd_mgpu_boundary_scopes.patch`
gives it). Inside a tile the two warpgroups' softmaxes take turns, so a warpgroup's gap is about the
other's softmax; across a boundary it also holds the output, the next tile's setup and its first
Q K^T, which nothing hides.
"""

from __future__ import annotations

import argparse
import json
import statistics

from jaxattn.jax_core.kernels.mgpu_timeline import outermost_steps, tracks

WARPGROUPS = 3  # two compute warpgroups and the memory warpgroup per program
TILE_STARTS = ("q_wait", "tile_head")


def _tiles(steps):
    tiles, current = [], []
    for step in steps:
        if step[0] in TILE_STARTS and current:
            tiles.append(current)
            current = []
        current.append(step)
    return tiles + [current]


def boundaries(trace: dict) -> dict:
    """{warpgroup: {"inside": [gaps], "across": [gaps], "softmaxes_per_tile": mean}} over all programs."""
    gaps = {wg: dict(inside=[], across=[], counts=[]) for wg in range(WARPGROUPS - 1)}
    for track, events in tracks(trace).items():
        wg = (track - 1) % WARPGROUPS
        if wg == WARPGROUPS - 1:
            continue
        last_end = None
        for tile in _tiles(outermost_steps(events)):
            softmaxes = [s for s in tile if s[0] == "softmax"]
            if not softmaxes:
                continue
            gaps[wg]["counts"].append(len(softmaxes))
            gaps[wg]["inside"] += [b[1] - a[2] for a, b in zip(softmaxes, softmaxes[1:])]
            if last_end is not None:
                gaps[wg]["across"].append(softmaxes[0][1] - last_end)
            last_end = softmaxes[-1][2]
    return {wg: dict(inside=g["inside"], across=g["across"], softmaxes_per_tile=statistics.mean(g["counts"]))
            for wg, g in gaps.items()}


def program_steps(trace: dict, program: int) -> list:
    """[(begin, end, warpgroup, name)] of one program's compute warpgroups, by time."""
    by_track = tracks(trace)
    merged, starts = [], {}
    for wg in range(WARPGROUPS - 1):
        events = by_track[1 + wg + WARPGROUPS * program]
        start, steps = events[0]["ts"] * 1e3, outermost_steps(events)
        starts[wg] = start
        merged += [(start, b, e, wg, name) for name, b, e in steps]
    origin = min(starts.values())
    return sorted((start - origin + b, start - origin + e, wg, name) for start, b, e, wg, name in merged)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", help="a forward case's Chrome trace from hopper_timeline_gpu.py --keep-traces")
    parser.add_argument("--program", type=int, default=0, help="the program whose steps are listed")
    parser.add_argument("--tile", type=int, default=3, help="list from this tile of warpgroup 0 over two more")
    args = parser.parse_args()
    with open(args.trace) as f:
        trace = json.load(f)
    for wg, g in boundaries(trace).items():
        print(f"warpgroup {wg}: softmax to softmax inside a tile mean {statistics.mean(g['inside']):.0f} cycles "
              f"(median {statistics.median(g['inside']):.0f}, {len(g['inside'])}); across a tile boundary mean "
              f"{statistics.mean(g['across']):.0f} (median {statistics.median(g['across']):.0f}, {len(g['across'])}); "
              f"{g['softmaxes_per_tile']:.2f} softmaxes a tile")
    steps = program_steps(trace, args.program)
    starts = [s for s in steps if s[3] in TILE_STARTS and s[2] == 0]
    if len(starts) > args.tile + 2:
        lo, hi = starts[args.tile][0] - 3000, starts[args.tile + 2][0] + 500
        for begin, end, wg, name in steps:
            if lo <= begin <= hi:
                print(f"{begin:9.0f} {end:9.0f} {end - begin:6.0f} {' ' * 24 * wg}wg{wg} {name}")


if __name__ == "__main__":
    main()
