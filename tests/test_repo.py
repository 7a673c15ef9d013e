"""Repository contract: README's two opening commands and .ci/run agree."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _readme_blocks():
    return re.findall(r"```bash\n(.*?)\n```", (ROOT / "README.md").read_text(), flags=re.S)


def test_readme_opens_with_two_commands():
    text = (ROOT / "README.md").read_text()
    blocks = _readme_blocks()
    assert len(blocks) >= 2
    first, second = blocks[0].strip(), blocks[1].strip()
    # the two commands come before any other content but the title
    assert text.index(first) < text.index(second) < text.index("\n\n", text.index(second))
    assert "torch==2.13.0" in first and "mppx" in first
    assert "torch==2.13.0" in second and "pytest" in second


def test_ci_runs_the_readme_test_command_verbatim():
    test_cmd = _readme_blocks()[1].strip()
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_cmd in ci, ".ci/run must call README's test command exactly"


def test_every_doc_path_named_in_setup_readme_and_docs_exists():
    # setup.py once pointed at docs/gpu.md before it existed
    missing = []
    for src in [ROOT / "setup.py", ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = src.read_text()
        for path in re.findall(r"\bdocs/[\w./-]+\.md\b", text):
            if not (ROOT / path).exists():
                missing.append(f"{src.relative_to(ROOT)}: {path}")
        if src.suffix == ".md":
            for link in re.findall(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)", text):
                if "://" not in link and not (src.parent / link).resolve().exists():
                    missing.append(f"{src.relative_to(ROOT)}: {link}")
    assert not missing, missing
