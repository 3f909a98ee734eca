"""Stalls on purpose in a real run's processes, for the tests of hangs and background saves: a
sitecustomize.py on the processes' path wraps one function of the project's code, so that its
N-th call on a chosen rank (or on every rank) sleeps first. Nothing of the project knows."""
from __future__ import annotations

import os
from pathlib import Path

from config_helpers import ROOT

SITE = '''
import importlib.abc, importlib.util, os, sys, time

MODULE, FUNCTION = os.environ["GTP_TEST_STALL_IN"].rsplit(".", 1)


class _Stall(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            real, calls = getattr(module, FUNCTION), []

            def stalled(*args, **kwargs):
                import torch.distributed as dist
                calls.append(1)
                rank = int(os.environ["GTP_TEST_STALL_RANK"])
                if (rank in (-1, dist.get_rank())
                        and len(calls) == int(os.environ["GTP_TEST_STALL_CALL"])):
                    time.sleep(float(os.environ["GTP_TEST_STALL_S"]))
                return real(*args, **kwargs)
            setattr(module, FUNCTION, stalled)
        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Stall())
'''


def stall_env(folder: Path, function: str, call: int, rank: int = -1,
              seconds: float = 3600) -> dict[str, str]:
    """The environment that makes call number `call` of `function` ("package.module.name") on
    `rank` (-1: every rank) sleep `seconds` before it runs."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(SITE)
    return {"PYTHONPATH": os.pathsep.join([str(folder), str(ROOT)]),
            "GTP_TEST_STALL_IN": function, "GTP_TEST_STALL_CALL": str(call),
            "GTP_TEST_STALL_RANK": str(rank), "GTP_TEST_STALL_S": str(seconds)}
