"""Test seams of `lynx train` (`lynx.runtime.config.TrainProbes`): a rank that dies or freezes mid-iteration, a
rank's gradients saved to disk; and a torchrun-style entry that runs `lynx.runtime.train` with them:

    python -m tests.harness.train_probes [--die-at N | --freeze-at N] [--die-rank R] [--save-grads DIR] -- ARGS

(ARGS: `python -m lynx.runtime.train`'s own). Production code has no such flags."""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class FaultAt:
    """In iteration `at`, rank `rank` exits with code 17 (`die`) or stops answering (not `die`) in the middle of
    its second forward (after its first micro-batch went downstream), or at the start with one micro-batch."""

    at: int
    rank: int
    die: bool = True

    def __call__(self, runner: Any, rank: int, it: int) -> None:
        if rank != self.rank or it != self.at:
            return
        orig = runner.before_forward
        first = min(1, runner.layout.num_microbatches - 1)
        die = self.die

        def faulty(stage: int, mb: int) -> None:
            if mb == first:
                if die:
                    os._exit(17)
                time.sleep(10 ** 6)
            orig(stage, mb)

        runner.schedule_hooks.before_forward = faulty


@dataclass(frozen=True)
class SaveGrads:
    """Each rank's gradients of iteration `at` (after its backward) to `folder/grads-rank{r}.pt`."""

    folder: str
    at: int

    def __call__(self, runner: Any, rank: int, it: int) -> None:
        if it != self.at:
            return
        import torch

        Path(self.folder).mkdir(parents=True, exist_ok=True)
        torch.save({n: g.detach().cpu() for n, g in runner.named_grads().items()},
                   Path(self.folder) / f"grads-rank{rank}.pt")


def probe_command(probe_args: list[str], train_args: list[str]) -> list[str]:
    """The command line that runs `lynx.runtime.train` with these probes (see the module docstring)."""
    return [sys.executable, "-m", "tests.harness.train_probes", *probe_args, "--", *train_args]


def probe_env(env: dict[str, str]) -> dict[str, str]:
    """`env` with the repository root importable (for `-m tests.harness.train_probes`)."""
    path = env.get("PYTHONPATH", "")
    return {**env, "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else "")}


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(prog="tests.harness.train_probes")
    p.add_argument("--die-at", type=int)
    p.add_argument("--freeze-at", type=int)
    p.add_argument("--die-rank", type=int, default=1)
    p.add_argument("--save-grads")
    a = p.parse_args(argv[:split])
    train_args = argv[split + 1:]
    from lynx.runtime.config import TrainProbes
    from lynx.runtime.train import main as train_main

    fault = None
    if a.die_at is not None or a.freeze_at is not None:
        fault = FaultAt(a.die_at if a.die_at is not None else a.freeze_at, a.die_rank, die=a.die_at is not None)
    iters = train_args[train_args.index("--iters") + 1] if "--iters" in train_args else "5"
    warmup = train_args[train_args.index("--warmup") + 1] if "--warmup" in train_args else "1"
    grads = SaveGrads(a.save_grads, int(iters) + int(warmup) - 1) if a.save_grads else None
    train_main(train_args, TrainProbes(before_iteration=fault, after_backward=grads))


if __name__ == "__main__":
    main()
