"""The commands README.md and docs/ show are the ones tests run. A fence after the marker
`<!-- tested here -->` runs here as written (a dry run's folder moved under tmp_path); one whose
lines start with `$ ` also has its output checked. A fence after `<!-- tested by PATH ... -->`
names the tests that run its commands: they must exist and run the same program. Cheap by
choice: only dry runs and refusals run here."""
from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARK = re.compile(r"^<!-- (tested here|tested by (.*?)) -->$")
TEST_FILE = re.compile(r"tests/[\w/]+\.py")


def fences(page: Path) -> list[tuple[str, int, str, list[str]]]:
    """(marker, line, info string, body lines) of each fence right after a marker line."""
    lines, found = page.read_text().split("\n"), []
    for i, line in enumerate(lines[:-1]):
        if MARK.match(line) and lines[i + 1].startswith("```"):
            end = next(j for j in range(i + 2, len(lines)) if lines[j].startswith("```"))
            found.append((line, i + 2, lines[i + 1][3:], lines[i + 2:end]))
    return found


def commands(body: list[str]) -> list[str]:
    """Each command of a fence: comments dropped, backslash continuations joined, a `$ ` prompt
    taken off (its output lines are not commands)."""
    joined, prompt = [], any(line.startswith("$ ") for line in body)
    for line in body:
        if prompt and not (line.startswith("$ ") or (joined and joined[-1].endswith("\\"))):
            continue
        line = line.removeprefix("$ ").split("  #")[0].rstrip()
        if not line or line.startswith("#"):
            continue
        if joined and joined[-1].endswith("\\"):
            joined[-1] = joined[-1][:-1].rstrip() + " " + line.strip()
        else:
            joined.append(line)
    return joined


def expected_output(body: list[str]) -> str:
    """What a `$ ` fence shows after its command, as one line of words (the page wraps it)."""
    if not any(line.startswith("$ ") for line in body):
        return ""
    lines, in_command = [], False
    for line in body:
        if line.startswith("$ "):
            in_command = line.endswith("\\")
        elif in_command:
            in_command = line.endswith("\\")
        else:
            lines.append(line)
    return " ".join(" ".join(lines).split())


TESTED_HERE = [(page, line, body) for page in PAGES for marker, line, _, body in fences(page)
               if marker == "<!-- tested here -->"]
TESTED_BY = [(page, line, marker, body) for page in PAGES
             for marker, line, _, body in fences(page) if marker != "<!-- tested here -->"]


@pytest.mark.parametrize("page,line,body", TESTED_HERE,
                         ids=[f"{p.relative_to(ROOT)}:{n}" for p, n, _ in TESTED_HERE])
def test_a_fence_marked_tested_here_runs_as_shown(page, line, body, tmp_path):
    for command in commands(body):
        argv = shlex.split(command)
        assert argv[:2] == ["python", "launch.py"], f"only launch.py commands run here: {command}"
        if "dry_run=true" in argv:  # its layout.json goes to tmp_path, not the repo's outputs/
            argv.append(f"hydra.run.dir={tmp_path / 'run'}")
        done = subprocess.run([sys.executable, *argv[1:]], cwd=ROOT, capture_output=True,
                              text=True, timeout=120)
        said = done.stdout + done.stderr
        shown = expected_output(body)
        if shown:  # a refusal: exits non-zero with the lines the page shows
            assert done.returncode != 0, said
            assert shown in " ".join(said.split()), said
        else:
            assert done.returncode == 0, said


@pytest.mark.parametrize("page,line,marker,body", TESTED_BY,
                         ids=[f"{p.relative_to(ROOT)}:{n}" for p, n, _, _ in TESTED_BY])
def test_a_fence_marked_tested_by_names_tests_that_run_its_program(page, line, marker, body):
    cited = TEST_FILE.findall(marker)
    assert cited and all((ROOT / path).exists() for path in cited), marker
    text = "".join((ROOT / path).read_text() for path in cited)
    for command in commands(body):
        program = next(word for word in shlex.split(command)
                       if word not in ("python", "-m", "torchrun") and not word.startswith("-"))
        program = program.removesuffix(".py") if program == "launch.py" else program
        assert program.split(".")[-1] in text or program in text, (command, cited)


def test_the_pages_have_marked_fences_of_both_kinds():
    assert len(TESTED_HERE) >= 5 and len(TESTED_BY) >= 5


def test_the_readme_test_command_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text().strip().split("\n")
    command = next(line for line in ci if line.startswith("python3 -m venv"))
    assert f"```bash\n{command}\n```" in readme
