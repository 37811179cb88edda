"""
Draw a --trace file as a picture: one lane per rank (compute and waits), one more under it
for the communication that ran asynchronously, compute and communication in two colours,
the idle time left white.

    torchrun --nproc_per_node=2 ddp.py --model=tiny --max_iters=5 --trace=ddp.json
    python bench/trace_timeline.py ddp.json [more.json ...] --png ddp.png [--step=3] [--title="DDP, overlapped" ...]

--step=median draws each trace's step of median length (its slowest rank's), of the steps it
recorded: one step on a shared machine can be the one another process disturbed.

The same file opens as it is in ui.perfetto.dev or chrome://tracing, with every span's
op, group, peers and bytes. matplotlib is optional (not in requirements.txt: the training
never needs it); without it this prints one line and exits with code 1.
"""
import argparse
import json
import sys

COLOURS = {"compute": "#4c78a8", "comm": "#f58518", "wait": "#e45756"}


def lanes(events, step=None):
    """-> ({(rank, row): [(start ms, length ms, category, name)]}, the steps drawn)."""
    spans = [e for e in events if e.get("ph") == "X" and (step is None or e["args"].get("step") == step)]
    out = {}
    for e in spans:
        if e["cat"] not in ("step", "interval"):  # an interval (ddp's exposed communication) spans the spans drawn
            out.setdefault((e["pid"], e["tid"]), []).append((e["ts"] / 1e3, e["dur"] / 1e3, e["cat"], e["name"]))
    return out, sorted({e["args"]["step"] for e in spans if e["cat"] == "step"})


def median_step(events):
    """The recorded step whose length (its slowest rank's) is the median (the lower one of two)."""
    length = {}
    for e in events:
        if e.get("cat") == "step":
            length[e["args"]["step"]] = max(length.get(e["args"]["step"], 0), e["dur"])
    ranked = sorted(length, key=length.get)
    return ranked[(len(ranked) - 1) // 2] if ranked else None


def fitting(name, cat, pixels, world=None):
    """The span's name if it fits in its bar, else for compute a short form ("forward mb 3" ->
    "F3"; a pipeline rank's later chunk, numbered world or more, in lower case: "forward mb 3
    chunk 2" -> "f3", as pipeline_parallel.py's --timeline writes it), else nothing. About 5
    pixels a character at this font size."""
    if len(name) * 5 < pixels:
        return name
    words = name.split()
    numbers = [w for w in words if w.isdigit()]
    later = world is not None and "chunk" in words and int(words[words.index("chunk") + 1]) >= world
    short = (name[0].lower() if later else name[0].upper()) + (numbers[0] if numbers else "")
    return short if cat == "compute" and len(short) * 5 < pixels else ""


def draw(traces, png, step=None, titles=()):
    """Each trace a panel, one above the other, on one time axis (so two runs compare)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    panels = []
    for trace in traces:
        rows, steps = lanes(trace["traceEvents"], median_step(trace["traceEvents"]) if step == "median" else step)
        if not rows:
            sys.exit(f"error: no spans{f' in step {step}' if step is not None else ''} in the trace")
        t0 = min(s for spans in rows.values() for s, *_ in spans)
        ranks = sorted({r for r, _ in rows})
        order = [(r, tid) for r in ranks for tid in (0, 1) if (r, tid) in rows or tid == 0]
        panels.append((trace, rows, steps, t0, order))
    width = max(max(s + d for spans in rows.values() for s, d, *_ in spans) - t0 for _, rows, _, t0, _ in panels)
    heights = [len(order) for *_, order in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 0.9 + 0.42 * sum(heights) + 0.5 * len(panels)), dpi=90,
                             sharex=True, gridspec_kw=dict(height_ratios=heights), squeeze=False)
    for i, (ax, (trace, rows, steps, t0, order)) in enumerate(zip(axes[:, 0], panels)):
        info = trace.get("otherData", {})
        for y, lane in enumerate(order):
            # compute first, communication over it: a sync collective sits inside the compute that issued it
            for start, length, cat, name in sorted(rows.get(lane, []), key=lambda s: s[2] != "compute"):
                ax.broken_barh([(start - t0, length)], (y - 0.4, 0.8), facecolors=COLOURS.get(cat, "#999999"),
                               edgecolor="white", linewidth=0.3)
                inside = cat != "compute" and any(c == "compute" and s0 <= start and start + length <= s0 + d0
                                                  for s0, d0, c, _ in rows[lane])
                # a span inside a compute one: the compute's label is there
                label = "" if inside else fitting(name, cat, length / width * 850, info.get("world"))
                if label:
                    ax.text(start - t0 + length / 2, y, label, ha="center", va="center", fontsize=7, color="white",
                            clip_on=True)
        ax.set_yticks(range(len(order)))
        ax.set_yticklabels([f"rank {r}" if tid == 0 else f"rank {r} async" for r, tid in order], fontsize=8)
        ax.set_ylim(len(order) - 0.5, -0.5)
        title = titles[i] if i < len(titles) else f"{info.get('strategy', '')} {info.get('world', '')} ranks"
        ax.set_title(f"{title}, step{'s' * (len(steps) > 1)} {', '.join(map(str, steps))}", fontsize=9)
    axes[-1, 0].set_xlim(0, width)
    axes[-1, 0].set_xlabel("ms from the step's start")
    fig.legend(handles=[Patch(color=c, label=k) for k, c in COLOURS.items()], loc="lower right", fontsize=8, ncol=3,
               frameon=False)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(png)
    print(f"wrote {png}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("traces", nargs="+", help="--trace files (Chrome trace JSON): one panel each, one time axis")
    p.add_argument("--png", required=True, help="the picture to write")
    p.add_argument("--step", type=lambda x: x if x == "median" else int(x), default=None,
                   help="one traced step (default: all of them), or median: each trace's step of median length")
    p.add_argument("--title", action="append", default=[], help="a panel's title (once per trace, in order)")
    args = p.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("trace_timeline.py needs matplotlib (pip install matplotlib); the trace itself opens in ui.perfetto.dev",
              file=sys.stderr)
        sys.exit(1)
    traces = []
    for path in args.traces:
        try:
            with open(path) as f:
                traces.append(json.load(f))
        except (OSError, ValueError) as e:
            sys.exit(f"error: cannot read {path} as a trace: {e}")
    draw(traces, args.png, args.step, args.title)


if __name__ == "__main__":
    main()
