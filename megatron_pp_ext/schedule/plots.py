"""Figures of schedules: a per-rank timeline with the activation-memory curves beneath,
and the bubble / memory Pareto plot of many schedules.

matplotlib is imported lazily inside the functions and drawn on its non-interactive Agg
canvas (pyplot and the global backend are not touched), so the rest of the schedule core
stays free of it. The output format follows the file
extension: ``.png`` or ``.svg`` (``.pdf`` works too).
"""

from __future__ import annotations

import functools
import os
from typing import Any, Iterable, Mapping

from .costs import CostModel
from .ir import Schedule, ScheduleError, op_kind
from .simulate import SimResult, simulate

#: Base colour of each compute kind; the chunk is shown by shade (chunk 0 darkest).
KIND_COLORS: dict[str, str] = {
    "F": "#3b6fb6",   # forward: blue
    "B": "#e07b39",   # backward for inputs: orange
    "W": "#3a9a5b",   # backward for weights: green
    "BW": "#8c5aa8",  # full backward: purple
    "F&B": "#2a9d9d",   # overlapped pair, forward + backward for inputs: teal
    "F&BW": "#b5476b",  # overlapped pair, forward + full backward: rose
}
#: Colours given, in order, to compute kinds registered by features (offload, vocab, ...).
_EXTRA_COLORS = ["#c8b631", "#c0504d", "#4bacc6", "#7f7f7f", "#b65f9b", "#6b8e23"]

_FORMATS = (".png", ".svg", ".pdf")


def _literal_text(fn):
    """Draw every text of ``fn``'s figure as given: titles and names (``--title``, an imported
    schedule's name) may hold ``$``, which matplotlib would parse as mathematics at save time and
    fail on (``$\\frac{1}{$``)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        import matplotlib
        if "text.parse_math" not in matplotlib.rcParams:  # pragma: no cover - matplotlib < 3.6
            return fn(*args, **kwargs)
        with matplotlib.rc_context({"text.parse_math": False}):
            return fn(*args, **kwargs)
    return wrapper


def _figure(**kw):
    """A matplotlib Figure on the Agg canvas. pyplot is not used, so the caller's backend and
    open figures (e.g. in a notebook) are left alone."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(**kw)
    FigureCanvasAgg(fig)
    return fig


def check_figure_path(path: str | os.PathLike) -> str:
    """Refuse a figure path with an unknown extension, a missing directory or one that cannot
    be written (flag: -o), before any work is spent on the figure."""
    path = os.fspath(path)
    ext = os.path.splitext(path)[1].lower()
    if ext not in _FORMATS:
        raise ScheduleError(f"figure {path!r}: unknown format {ext or '(none)'!r}; "
                            f"end the file name with {', '.join(_FORMATS)} (-o)")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ScheduleError(f"figure {path!r}: directory {parent!r} does not exist (-o)")
    existed = os.path.exists(path)
    try:
        with open(path, "ab"):
            pass
    except OSError as e:
        raise ScheduleError(f"figure {path!r}: cannot write it ({e.strerror or e}); give a writable file "
                            "path (-o)") from None
    if not existed:
        os.remove(path)
    return path


#: a timeline is drawn one box per compute op on figures at most 40 inches wide: beyond these
#: counts the boxes are narrower than a few pixels and matplotlib needs gigabytes
MAX_FIGURE_OPS_PER_RANK = 2048
MAX_FIGURE_OPS = 65536
MAX_FIGURE_RANKS = 128


def check_figure_size(num_ranks: int, ops_per_rank: int, *, microbatches: int | None = None) -> None:
    """Refuse a timeline that cannot be drawn legibly (ScheduleError naming the flag and the
    largest --microbatches that can), before the schedule is built or drawn."""
    if num_ranks > MAX_FIGURE_RANKS:
        raise ScheduleError(f"--pp {num_ranks}: a timeline of more than {MAX_FIGURE_RANKS} ranks cannot be drawn "
                            f"legibly; draw at most --pp {MAX_FIGURE_RANKS} (the schedule's pattern is the same "
                            "at a smaller size)")
    limit = min(MAX_FIGURE_OPS_PER_RANK, MAX_FIGURE_OPS // max(1, num_ranks))
    if ops_per_rank > limit:
        if microbatches:
            per_mb = max(1, ops_per_rank // microbatches)
            fix = f"use --microbatches {max(1, limit // per_mb)} or fewer"
        else:
            fix = "draw fewer microbatches"
        raise ScheduleError(f"--microbatches {microbatches if microbatches else '?'}: {ops_per_rank} ops per rank "
                            f"on {num_ranks} ranks cannot be drawn legibly (at most {limit} per rank at this "
                            f"--pp); {fix} (the pattern repeats), or use mppx simulate for the numbers")


def _save(fig, path: str, dpi: int) -> None:
    """Save; SVG keeps text as text (small, searchable, editable) and ids (gid) on the op
    boxes and their labels (``op-r<rank>-<stage><kind><microbatch>``, ``label-r...``), the
    memory curves (``memory-rank-<r>``) and the Pareto points (``point-<schedule>``)."""
    import matplotlib

    try:
        with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "mppx"}):
            fig.savefig(path, dpi=dpi)
    except OSError as e:
        raise ScheduleError(f"figure {path!r}: cannot write it ({e.strerror or e}); give a writable file "
                            "path (-o)") from None


def _shade(color: str, chunk: int, chunks: int) -> tuple[float, float, float]:
    """``color`` mixed with white: chunk 0 is the full colour, the last chunk the lightest."""
    from matplotlib.colors import to_rgb

    r, g, b = to_rgb(color)
    mix = 0.0 if chunks <= 1 else 0.55 * chunk / (chunks - 1)
    return (r + (1 - r) * mix, g + (1 - g) * mix, b + (1 - b) * mix)


def _kind_color(kind: str, extra: dict[str, str]) -> str:
    if kind in KIND_COLORS:
        return KIND_COLORS[kind]
    if kind not in extra:
        extra[kind] = _EXTRA_COLORS[len(extra) % len(_EXTRA_COLORS)]
    return extra[kind]


def _label(op) -> str:
    """The microbatch written in an op's box; an overlapped pair (one box) shows both: ``7/3``."""
    pr = getattr(op, "pair", None)
    return str(op.microbatch) if pr is None else f"{op.microbatch}/{pr[1]}"


def _text_color(rgb: tuple[float, float, float]) -> str:
    lum = 0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2]
    return "black" if lum > 0.6 else "white"


@_literal_text
def plot_timeline(schedule: Schedule, cost: CostModel, path: str | os.PathLike, title: str | None = None, *,
                  result: SimResult | None = None, memory_budget: float | None = None, dpi: int = 110,
                  title_suffix: str = "") -> SimResult:
    """Draw ``schedule`` under ``cost`` to ``path`` (PNG/SVG by extension).

    Top: one lane per rank, one box per compute op (F, B, W, BW coloured distinctly, the
    model chunk shown by shade, the microbatch number written in the box); communication
    ops are not drawn (their effect on timing is). Bottom: the activation memory of every
    rank over time (units), with the memory budget as a dashed line when there is one.
    ``result``: a simulation of the same schedule and cost to reuse; ``memory_budget``: the
    dashed line (default: the schedule's own budget from its meta); ``title_suffix``: appended to
    the default title (e.g. the comm model ``result`` was simulated under). Returns the simulation used.
    """
    path = check_figure_path(path)
    compute_per_rank = [sum(op_kind(op.kind).category == "compute" for op in ops) for ops in schedule.ops]
    check_figure_size(schedule.num_ranks, max(compute_per_rank, default=0), microbatches=schedule.num_microbatches)
    if result is None:
        result = simulate(schedule, cost)
    if memory_budget is None:
        memory_budget = schedule.meta.get("memory_budget", schedule.meta.get("budget_units"))
    import matplotlib
    from matplotlib.patches import Patch, Rectangle

    p, v = schedule.num_ranks, schedule.chunks_per_rank
    makespan = result.makespan or 1.0
    compute = [(op, result.times[op]) for op in schedule.all_ops()
               if op in result.times and op_kind(op.kind).category == "compute"]
    durations = [e - s for _, (s, e) in compute if e > s]
    shortest = min(durations) if durations else makespan
    # Width: enough that the shortest box holds a two-digit label, within sane bounds.
    width = min(40.0, max(9.0, 0.2 * makespan / shortest + 1.5))
    lane_h = 0.42
    height = 0.9 + p * lane_h + 1.9
    fig = _figure(figsize=(width, height))
    ax, axm = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [p * lane_h, 1.6], "hspace": 0.08})
    axes_w_in = width - 2.4

    extra: dict[str, str] = {}
    kinds_seen: list[str] = []
    for op, (start, end) in compute:
        dur = end - start
        if dur <= 0:
            continue
        chunk = schedule.chunk_of(op.stage)
        base = _kind_color(op.kind, extra)
        if op.kind not in kinds_seen:
            kinds_seen.append(op.kind)
        rgb = _shade(base, chunk, v)
        y = op.rank
        ax.add_patch(Rectangle((start, y - 0.4), dur, 0.8, facecolor=rgb, edgecolor="white", linewidth=0.6,
                               gid=f"op-r{op.rank}-{op.stage}{op.kind}{op.microbatch}"))
        label = _label(op)
        box_pt = dur / makespan * axes_w_in * 72.0
        size = min(8.0, box_pt / (0.65 * len(label) + 0.3))
        if size >= 4.0:
            ax.text(start + dur / 2, y, label, ha="center", va="center", fontsize=size, color=_text_color(rgb),
                    gid=f"label-r{op.rank}-{op.stage}{op.kind}{op.microbatch}")
    ax.set_xlim(0, makespan)
    ax.set_ylim(p - 0.5, -0.5)
    ax.set_yticks(range(p))
    ax.set_yticklabels([f"rank {r}" for r in range(p)])
    ax.tick_params(axis="y", length=0)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    if title is None:
        title = (f"{schedule.name}: p={p}, m={schedule.num_microbatches}, v={v} | "
                 f"bubble {result.bubble_rate:.1%} | peak {result.max_peak_memory:g} units | "
                 f"makespan {result.makespan:g}{title_suffix}")
    ax.set_title(title, fontsize=10, loc="left")

    handles = [Patch(facecolor=_kind_color(k, extra), label=k) for k in kinds_seen]
    if v > 1:
        for c in range(v):
            handles.append(Patch(facecolor=_shade("#555555", c, v), label=f"chunk {c}"))
    ax.legend(handles=handles, loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=len(handles),
              fontsize=7, frameon=False, handlelength=1.2, columnspacing=1.0)

    cmap = matplotlib.colormaps["viridis"]
    for r, tl in enumerate(result.memory_timeline):
        # Several changes at one instant (a W ends as an F starts): keep the level after the last.
        last: dict[float, float] = {}
        for t, u in tl:
            last[t] = u
        xs = list(last) + [makespan]
        ys = list(last.values()) + [tl[-1][1] if tl else 0.0]
        color = cmap(r / max(1, p - 1) * 0.85)
        axm.step(xs, ys, where="post", color=color, linewidth=1.2, gid=f"memory-rank-{r}",
                 label=f"rank {r} (peak {result.peak_memory[r]:g})")
    if memory_budget is not None:
        axm.axhline(float(memory_budget), color="#c0392b", linestyle="--", linewidth=0.9,
                    label=f"budget {float(memory_budget):g}")
    top = max([result.max_peak_memory] + ([float(memory_budget)] if memory_budget is not None else []))
    axm.set_ylim(0, top * 1.12 + 0.1)
    axm.set_ylabel("activation\n(units)", fontsize=8)
    axm.set_xlabel("time")
    axm.grid(axis="y", linewidth=0.3, alpha=0.6)
    for side in ("top", "right"):
        axm.spines[side].set_visible(False)
    axm.legend(fontsize=7, frameon=False, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.subplots_adjust(left=0.9 / width, right=1 - 1.5 / width, top=1 - 0.45 / height,
                        bottom=0.5 / height)
    _save(fig, path, dpi=dpi)
    return result


@_literal_text
def plot_measured_vs_simulated(schedule: Schedule, simulated: Mapping, measured: Mapping, path: str | os.PathLike,
                               title: str | None = None, *, marks: Iterable[tuple[Any, str]] = (),
                               dpi: int = 110) -> None:
    """Two timelines of one schedule on one time axis (seconds): the simulator's above, the
    measured one (e.g. ``mppx train --emulate-compute``) below, one lane per rank and one box per
    op (``simulated`` / ``measured``: op -> (start, end), in seconds from the start). Ops of
    other streams (offload's copies) are drawn as thin boxes under their rank's lane. ``marks``:
    ``(op, text)`` pairs annotated on the measured timeline (e.g. the largest stalls)."""
    path = check_figure_path(path)
    from matplotlib.patches import Patch, Rectangle

    p, v = schedule.num_ranks, schedule.chunks_per_rank
    end = max([e for _, e in simulated.values()] + [e for _, e in measured.values()] + [1e-9])
    lane_h = 0.38
    height = 1.4 + 2 * p * lane_h + 0.8
    width = 16.0
    fig = _figure(figsize=(width, height))
    axes = fig.subplots(2, 1, sharex=True, gridspec_kw={"hspace": 0.28})
    extra: dict[str, str] = {}
    kinds_seen: list[str] = []
    for ax, times, label in ((axes[0], simulated, "simulated"), (axes[1], measured, "measured")):
        for op, (start, stop) in times.items():
            dur = stop - start
            if dur <= 0:
                continue
            cat = op_kind(op.kind).category
            if cat == "comm":
                continue
            base = _kind_color(op.kind, extra)
            if op.kind not in kinds_seen:
                kinds_seen.append(op.kind)
            rgb = _shade(base, schedule.chunk_of(op.stage), v)
            y, h = (op.rank - 0.4, 0.8) if cat == "compute" else (op.rank + 0.28, 0.14)
            ax.add_patch(Rectangle((start, y), dur, h, facecolor=rgb, edgecolor="white", linewidth=0.4,
                                   gid=f"{label}-r{op.rank}-{op.stage}{op.kind}{op.microbatch}"))
            if cat == "compute" and dur / end * (width - 2.0) * 72 > 9:
                ax.text(start + dur / 2, op.rank, _label(op), ha="center", va="center", fontsize=6,
                        color=_text_color(rgb))
        ax.set_ylim(p - 0.5, -0.5)
        ax.set_yticks(range(p))
        ax.set_yticklabels([f"rank {r}" for r in range(p)], fontsize=8)
        ax.tick_params(axis="y", length=0)
        for side in ("top", "right", "left"):
            ax.spines[side].set_visible(False)
        mk = max((e for _, e in times.values()), default=0.0)
        ax.axvline(mk, color="#c0392b", linewidth=0.8, linestyle="--")
        ax.set_title(f"{label}: makespan {mk:.3f} s", fontsize=9, loc="left")
    for op, text in marks:
        if op in measured:
            s0 = measured[op][0]
            axes[1].annotate(text, (s0, op.rank - 0.4), xytext=(0, 9), textcoords="offset points", fontsize=7,
                             color="#c0392b", ha="center", arrowprops={"arrowstyle": "-", "color": "#c0392b"})
    axes[0].set_xlim(0, end * 1.01)
    axes[1].set_xlabel("time (s)")
    handles = [Patch(facecolor=_kind_color(k, extra), label=k) for k in kinds_seen]
    axes[0].legend(handles=handles, loc="lower right", bbox_to_anchor=(1.0, 1.02), ncol=len(handles), fontsize=7,
                   frameon=False, handlelength=1.2)
    if title:
        fig.suptitle(title, fontsize=10, x=0.01, ha="left")
    fig.subplots_adjust(left=0.9 / width, right=1 - 0.3 / width, top=1 - 0.75 / height, bottom=0.45 / height)
    _save(fig, path, dpi=dpi)


def _row_get(row: Any, *names: str, default=None):
    for n in names:
        if isinstance(row, Mapping):
            if n in row:
                return row[n]
        elif hasattr(row, n):
            return getattr(row, n)
    return default


def pareto_front(points: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Non-dominated (memory, bubble) points, by increasing memory."""
    front: list[tuple[float, float]] = []
    for mem, bub in sorted(points, key=lambda x: (x[0], x[1])):
        if not front or bub < front[-1][1] - 1e-12:
            front.append((mem, bub))
    return front


@_literal_text
def plot_pareto(rows: Iterable[Any], path: str | os.PathLike, title: str | None = None, *,
                dpi: int = 120) -> None:
    """Bubble rate vs peak activation memory (units) of many schedules of one configuration.

    ``rows``: mappings (or objects) with ``schedule`` (or ``name``), ``bubble_rate`` and
    ``max_peak_memory`` (or ``peak_memory``: a number or the per-rank list). Each schedule is a
    labelled point; the non-dominated ones are joined by the Pareto front.
    """
    path = check_figure_path(path)
    pts = []
    for row in rows:
        name = _row_get(row, "schedule", "name")
        bubble = _row_get(row, "bubble_rate")
        peak = _row_get(row, "max_peak_memory", "peak_memory")
        if name is None or bubble is None or peak is None:
            raise ScheduleError("plot_pareto: each row needs schedule (or name), bubble_rate and max_peak_memory")
        if isinstance(peak, (list, tuple)):
            peak = max(peak)
        pts.append((str(name), float(peak), float(bubble)))
    if not pts:
        raise ScheduleError("plot_pareto: no schedules to plot")
    fig = _figure(figsize=(6.4, 4.4))
    ax = fig.subplots()
    front = pareto_front((m, b) for _, m, b in pts)
    if len(front) > 1:
        xs, ys = [], []
        for i, (m, b) in enumerate(front):
            if i:
                xs.append(m)
                ys.append(front[i - 1][1])
            xs.append(m)
            ys.append(b)
        ax.plot(xs, [y * 100 for y in ys], color="#999999", linewidth=1, linestyle="--", zorder=1, label="Pareto front")
    on_front = set(front)
    for name, m, b in pts:
        best = (m, b) in on_front
        ax.scatter([m], [b * 100], s=42, zorder=3, color="#3b6fb6" if best else "#bbbbbb",
                   edgecolor="black", linewidth=0.5, gid=f"point-{name}")
    # Labels: offset points that share a position so they do not overlap.
    placed: dict[tuple[float, float], int] = {}
    for name, m, b in sorted(pts, key=lambda x: (x[1], x[2], x[0])):
        key = (round(m, 3), round(b, 4))
        k = placed.get(key, 0)
        placed[key] = k + 1
        ax.annotate(name, (m, b * 100), xytext=(6, 4 - 11 * k), textcoords="offset points", fontsize=8)
    if len(front) > 1:
        ax.legend(fontsize=7, frameon=False, loc="upper right")
    ax.set_xlabel("peak activation memory (units, busiest rank)")
    ax.set_ylabel("bubble rate (%)")
    xmax = max(m for _, m, _ in pts)
    ymax = max(b for _, _, b in pts) * 100
    ax.set_xlim(0, xmax * 1.25 + 0.5)
    ax.set_ylim(-max(1.0, ymax * 0.05), ymax * 1.15 + 1.0)
    ax.grid(linewidth=0.3, alpha=0.6)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    if title:
        ax.set_title(title, fontsize=10, loc="left")
    fig.tight_layout()
    _save(fig, path, dpi=dpi)
