"""The deterministic tables of docs/benchmarks/*.md match what their commands print now.

Each benchmark script regenerates a subset of its simulated tables (``doc_tables(quick=True)``,
seconds each) and benchmarks/doccheck.py requires every regenerated row in the document, under
the same heading, caption and header. ``python -m benchmarks.doccheck`` checks every
configuration (minutes); measured tables and timings are never compared.
"""

from __future__ import annotations

import functools
import importlib
from pathlib import Path

import pytest

from benchmarks import doccheck

ROOT = Path(__file__).resolve().parents[1]


@functools.lru_cache(maxsize=None)
def generated(name: str) -> str:
    return importlib.import_module(f"benchmarks.{name}").doc_tables(quick=True)


def doc(name: str) -> str:
    return (ROOT / "docs" / "benchmarks" / doccheck.DOCS[name]).read_text(encoding="utf-8")


@pytest.mark.parametrize("name", list(doccheck.DOCS))
def test_benchmark_doc_tables_match_their_command(name):
    gen = generated(name)
    assert doccheck.tables(gen), "the quick regeneration produced no table"
    problems = doccheck.check(doc(name), gen, where=f"docs/benchmarks/{doccheck.DOCS[name]}")
    assert not problems, "\n".join(problems) + "\nregenerate: python benchmarks/" + name + ".py"


@pytest.mark.parametrize("name", ["vocab", "bpipe"])
def test_a_changed_number_in_the_doc_is_caught(name):
    gen = generated(name)
    row = doccheck.tables(gen)[0].rows[0]
    cells = row.split("|")
    cells[-2] = cells[-2] + "9"          # one cell of one regenerated row, changed in the document
    drifted = doc(name).replace(row, "|".join(cells), 1)
    assert drifted != doc(name)
    problems = doccheck.check(drifted, gen)
    assert len(problems) == 1 and row in problems[0]


def test_check_rules():
    md = "## A\n\np = 4\n\n| x | y |\n|---|---|\n| 1 | 2 |\n| 3 | 4 |\n"
    assert doccheck.check(md, md) == [] and doccheck.check(md, md, exact=True) == []
    assert doccheck.check(md, md.replace("| 1 | 2 |", "| 1 | 5 |"))          # a row drifted
    assert doccheck.check(md, md.replace("## A", "## B"))                      # another heading
    assert doccheck.check(md, md.replace("p = 4", "p = 8"))                    # another caption
    assert doccheck.check(md, md.replace("| x | y |", "| x | z |"))            # another header
    subset = md.replace("| 3 | 4 |\n", "")
    assert doccheck.check(md, subset) == []                                    # a subset of the rows
    assert doccheck.check(md, subset, exact=True)                              # ... but not all of them
    assert doccheck.check(md, "no table here")


def test_update_rewrites_only_the_generated_tables():
    md = "## A\n\n| x | y |\n|---|---|\n| 1 | 2 |\n\n## Measured\n\n| x | y |\n|---|---|\n| 7 | 7 |\n"
    gen = "## A\n\n| x | y |\n|---|---|\n| 1 | 3 |\n| 2 | 4 |\n"
    new, missing = doccheck.update(md, gen)
    assert missing == [] and doccheck.check(new, gen, exact=True) == []
    assert "| 7 | 7 |" in new and "| 1 | 2 |" not in new
    _, missing = doccheck.update(md, gen.replace("## A", "## C"))
    assert missing == ["## C / | x | y |"]


def test_moe_doc_shows_the_benchmark_table():
    """docs/moe.md's when-it-pays table has the rows ``python benchmarks/moe.py --simulated`` prints."""
    rows = [r for t in doccheck.tables(generated("moe")) for r in t.rows]
    shown = [r for t in doccheck.tables((ROOT / "docs" / "moe.md").read_text(encoding="utf-8")) for r in t.rows]
    missing = [r for r in rows if r not in shown]
    assert rows and not missing, missing
def test_published_rows_that_miss_the_goal_name_their_cause():
    """docs/benchmarks/published.md: every row that misses a part of the goal names a cause (no
    `?`), and each cause it names is a bullet of the page's *Rows that miss the goal*."""
    import re

    rows = [r for t in doccheck.tables(generated("published")) if t.header.endswith("goal missed (cause) |")
            for r in t.rows]
    assert rows
    cells = [r.rstrip(" |").rsplit("|", 1)[1].strip() for r in rows]
    assert all(c == "met" or re.fullmatch(r"(\w+ \([A-Z](, [A-Z])*\)(; )?)+", c) for c in cells), cells
    page = doc("published")
    for key in {k for c in cells for k in re.findall(r"[A-Z]", c)}:
        assert f"- ({key}) " in page, key


def test_moe_doc_cell_command_runs_as_written():
    """docs/moe.md and docs/benchmarks/moe.md say how one cell of the table is made: the command as
    they spell it (``--chunks 2`` for an interleaved schedule; ``mppx simulate`` has no ``--vp``)
    prints the cell's makespans (interleaved-1f1b, p=4, m=16, all-to-all 35%: 52.5 -> 43.05)."""
    import re
    import subprocess
    import sys
    for page in ("moe.md", "benchmarks/moe.md"):
        assert "with `--chunks 2`" in re.sub(r"\s+", " ", (ROOT / "docs" / page).read_text()), page
    row = next(ln for ln in (ROOT / "docs" / "moe.md").read_text().splitlines()
               if ln.startswith("| interleaved-1f1b | 4 | 16 |"))
    cell = row.split("|")[5].strip()                     # the 35% column: "52.5 → 43.05 (1.22x, ...)"
    unpaired, paired = re.match(r"([\d.]+) → ([\d.]+)", cell).groups()
    cmd = [sys.executable, "-m", "megatron_pp_ext.cli", "simulate", "--schedule", "interleaved-1f1b", "--pp", "4",
           "--microbatches", "16", "--a2a-time", "0.35", "--chunks", "2"]
    for extra, want in (([], unpaired), (["--overlap-moe-expert-parallel-comm"], paired)):
        out = subprocess.run(cmd + extra, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert re.search(r"^makespan\s+([\d.]+)", out.stdout, re.M).group(1) == want, out.stdout


def test_planner_doc_deepseek_memory_figures_are_what_the_command_prints():
    """planner.md's busiest-GPU figures of the DeepSeek-V3-like model under full recomputation
    (1F1B, zbv and V-Half, and interleaved-zb's rejection over memory) are what the command it
    gives prints."""
    import re
    import subprocess
    import sys
    text = re.sub(r"\s+", " ", (ROOT / "docs" / "planner.md").read_text())
    m = re.search(r"the busiest GPU: 1F1B ([\d.]+) GiB, zbv and V-Half ([\d.]+) GiB, interleaved-zb over memory "
                  r"\((OOM on rank \d+ by [\d.]+ GiB)\): `mppx plan ([^`]+)`", text)
    assert m, "the sentence moved"
    out = subprocess.run([sys.executable, "-m", "megatron_pp_ext.cli", "plan", *m.group(4).split(), "--no-baseline",
                          "--features", "none"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    peak = {row.split()[12].split("(")[0]: row.split()[4] for row in out.stdout.splitlines()
            if re.match(r"^\d+\s+[\d.]+\s", row)}
    assert (peak["1f1b"], peak["zbv"]) == m.groups()[:2], out.stdout
    assert peak["v-half"] == peak["zbv"] and "interleaved-zb" not in peak, out.stdout
    assert f"interleaved-zb(v=2) mbs=1 rc=full: {m.group(3)}" in out.stdout, out.stdout


def test_planner_doc_paired_plan_figures_are_what_the_plans_give(tmp_path, monkeypatch):
    """planner.md's overlapped-pairs figures (Mixtral-8x7B at 50 and 6.25 GB/s) are what
    tests/test_planner.py's _paired_plans give now: the all-to-all's share of F, the paired winner
    and its time, the best unpaired plan and its time."""
    import re

    from test_planner import _paired_plans
    monkeypatch.setenv("MPPX_CACHE_DIR", str(tmp_path))   # (never the user's ~/.cache)
    text = re.sub(r"\s+", " ", (ROOT / "docs" / "planner.md").read_text())
    m = re.search(r"at 50 GB/s per GPU on the network the all-to-all is ([\d.]+)% of F and (\S+) predicts ([\d.]+) s "
                  r"per iteration against ([\d.]+) s for the best unpaired plan \((\S+)\); at 6\.25 GB/s it is "
                  r"([\d.]+)% of F and (\S+) predicts ([\d.]+) s against ([\d.]+) s\.", text)
    assert m, "the sentence moved"
    got = []
    for bw in (50.0, 6.25):
        paired, plain = _paired_plans(bw)
        share = sum(paired.costs.a2a) / sum(paired.costs.t_f)
        got.append((f"{share:.1%}"[:-1], paired.candidate.label(), f"{paired.iteration_time:.3f}",
                    f"{plain.iteration_time:.3f}", plain.candidate.label()))
    doc = [(m[1], m[2], m[3], m[4], m[5]), (m[6], m[7], m[8], m[9], got[1][4])]
    assert got == doc


def test_vocab_one_queue_timings_quote_their_command():
    """docs/benchmarks/vocab.md's timed one-queue table (measured: never regenerated here) names
    the script that made it and the exact ``mppx train`` command that script runs."""
    from benchmarks import vocab_one_queue_timed as timed
    text = doc("vocab")
    assert "python benchmarks/vocab_one_queue_timed.py" in text
    assert f"`{timed.template(6)}`" in text, timed.template(6)
    assert [c[0] for c in timed.CONFIGS] == ["threaded", "one-queue mode", "one-queue mode, one queue"]
