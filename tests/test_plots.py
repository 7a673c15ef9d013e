"""Schedule figures: timeline + memory curves, and the Pareto plot (PNG and SVG)."""

import re
import subprocess
import sys

import pytest

from megatron_pp_ext.schedule import ScheduleError, build_schedule, op_kind, simulate
from megatron_pp_ext.schedule.plots import pareto_front, plot_pareto, plot_timeline

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _ids(svg: str, prefix: str) -> list[str]:
    return re.findall(rf'id="({prefix}[^"]*)"', svg)


def test_plots_module_imports_matplotlib_lazily():
    code = ("import sys, megatron_pp_ext.schedule.plots; "
            "sys.exit(1 if 'matplotlib' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


@pytest.mark.parametrize("name,chunks", [("1f1b", 1), ("interleaved-1f1b", 2), ("zbv", 2)])
def test_timeline_png(tmp_path, name, chunks):
    s, c = build_schedule(name, 4, 8, chunks=chunks)
    path = tmp_path / f"{name}.png"
    res = plot_timeline(s, c, path)
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 10_000
    assert res.makespan == simulate(s, c).makespan


def test_timeline_svg_draws_every_compute_op_with_its_microbatch(tmp_path):
    s, c = build_schedule("zb-h1", 3, 4)
    path = tmp_path / "zb.svg"
    plot_timeline(s, c, path, title="my title")
    svg = path.read_text()
    assert svg.lstrip().startswith("<?xml") and "<svg" in svg
    assert "my title" in svg  # text kept as text
    boxes = _ids(svg, "op-r")
    expected = {f"op-r{op.rank}-{op.stage}{op.kind}{op.microbatch}" for op in s.all_ops()}
    assert set(boxes) == expected and len(boxes) == len(expected)
    # the microbatch number is written in each box
    for op in s.all_ops():
        gid = f"label-r{op.rank}-{op.stage}{op.kind}{op.microbatch}"
        m = re.search(rf'id="{gid}">\s*<text[^>]*>([^<]*)</text>', svg)
        assert m and m.group(1) == str(op.microbatch), gid
    assert _ids(svg, "memory-rank-") == [f"memory-rank-{r}" for r in range(3)]


def test_timeline_skips_comm_ops_and_shades_chunks(tmp_path):
    s, c = build_schedule("v-half", 2, 4, costs=(1, 1, 1, 0.2), with_comm=True)
    assert s.has_comm()
    path = tmp_path / "vh.svg"
    plot_timeline(s, c, path)
    svg = path.read_text()
    compute = [op for op in s.all_ops() if op_kind(op.kind).category == "compute"]
    assert len(_ids(svg, "op-r")) == len(compute) < sum(len(o) for o in s.ops)
    assert "chunk 0" in svg and "chunk 1" in svg  # shade legend for two chunks
    for k in ("F", "B", "W"):
        assert re.search(rf">{k}</text>", svg)


def test_timeline_budget_line(tmp_path):
    s, c = build_schedule("v-budget", 4, 8, memory_budget=3)
    path = tmp_path / "vb.svg"
    plot_timeline(s, c, path)
    assert "budget 3" in path.read_text()


def test_timeline_rejects_unknown_extension(tmp_path):
    s, c = build_schedule("1f1b", 2, 2)
    with pytest.raises(ScheduleError, match="-o"):
        plot_timeline(s, c, tmp_path / "x.jpg")
    assert not (tmp_path / "x.jpg").exists()


ROWS = [
    {"schedule": "1f1b", "bubble_rate": 0.158, "max_peak_memory": 4.0},
    {"schedule": "zbv", "bubble_rate": 0.03, "max_peak_memory": 4.0},
    {"schedule": "v-half", "bubble_rate": 0.07, "peak_memory": [3.0, 3.0]},
    {"name": "v-min", "bubble_rate": 0.3, "max_peak_memory": 2.0},
]


@pytest.mark.parametrize("ext", ["png", "svg"])
def test_pareto(tmp_path, ext):
    path = tmp_path / f"pareto.{ext}"
    plot_pareto(ROWS, path)
    data = path.read_bytes()
    if ext == "png":
        assert data[:8] == PNG_MAGIC and len(data) > 5_000
    else:
        svg = data.decode()
        assert sorted(_ids(svg, "point-")) == sorted(f"point-{r.get('schedule', r.get('name'))}" for r in ROWS)
        for r in ROWS:
            assert f">{r.get('schedule', r.get('name'))}</text>" in svg  # labelled points


def test_pareto_front():
    pts = [(4.0, 0.158), (4.0, 0.03), (3.0, 0.07), (2.0, 0.3), (7.0, 0.1)]
    assert pareto_front(pts) == [(2.0, 0.3), (3.0, 0.07), (4.0, 0.03)]


def test_pareto_needs_rows(tmp_path):
    with pytest.raises(ScheduleError):
        plot_pareto([], tmp_path / "p.png")
    with pytest.raises(ScheduleError):
        plot_pareto([{"schedule": "x"}], tmp_path / "p.png")
