"""`python launch.py ARGS`, many times, each in a fork of one interpreter that imported
launch.py's torch-free modules once.

A refusal at compose time costs a new interpreter about 0.7 s, half of it importing Hydra, numpy
and the trainer's config modules; the bad-input table has hundreds of such rows. Here one server
process imports what `import launch` imports (asserting torch is not among it), then forks a child
per command: the child takes the command's environment and sys.argv, points fds 1 and 2 at its
own files, and runs launch.py as __main__ (runpy), exiting with the code the interpreter would
(SystemExit's, or 1 after printing an uncaught exception's traceback). What the child runs is
the real CLI from its first line; only the imports are already done. A child given a torch
blocker puts it first on sys.path, so a check that imports torch still fails its row.

    python tests/config/warm_cli.py JOBS.json   # runs them, at most `parallel` at a time
"""
from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_all(jobs: list[dict], parallel: int) -> list[int]:
    """Each job: argv (after launch.py), env, cwd, stdout and stderr paths, no_torch (a folder
    or None). Returns the exit codes in order."""
    sys.path.insert(0, str(ROOT))
    import launch  # noqa: F401  (the imports the children share)
    assert "torch" not in sys.modules, "launch.py's module imports brought torch"
    codes: list[int | None] = [None] * len(jobs)
    running: dict[int, int] = {}  # pid -> job index
    for index, job in enumerate(jobs):
        while len(running) >= parallel:
            _reap(running, codes)
        pid = os.fork()
        if pid == 0:
            _child(job)  # never returns
        running[pid] = index
    while running:
        _reap(running, codes)
    return [int(c) for c in codes]


def _reap(running: dict[int, int], codes: list) -> None:
    pid, status = os.wait()
    codes[running.pop(pid)] = os.waitstatus_to_exitcode(status)


def _child(job: dict) -> None:
    code = 1
    try:
        os.environ.clear()
        os.environ.update(job["env"])
        os.chdir(job["cwd"])
        for fd, path in ((1, job["stdout"]), (2, job["stderr"])):
            out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(out, fd)
            os.close(out)
        if job["no_torch"]:
            sys.path.insert(0, job["no_torch"])
        launch = str(ROOT / "launch.py")
        sys.argv = [launch, *job["argv"]]
        try:
            runpy.run_path(launch, run_name="__main__")
            code = 0
        except SystemExit as stop:
            if stop.code is None or isinstance(stop.code, int):
                code = stop.code or 0
            else:  # sys.exit("message"): the interpreter prints it and exits 1
                print(stop.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001  (as the interpreter: the traceback, exit 1)
            traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_warm(jobs: list[dict], parallel: int, folder: Path) -> list[int]:
    """Runs the jobs in one fresh server interpreter (the caller's may have imported torch)."""
    spec = folder / "jobs.json"
    spec.write_text(json.dumps({"jobs": jobs, "parallel": parallel}))
    out = subprocess.run([sys.executable, __file__, str(spec)], capture_output=True, text=True,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=600)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


if __name__ == "__main__":
    request = json.loads(Path(sys.argv[1]).read_text())
    print(json.dumps(run_all(request["jobs"], request["parallel"])))
