"""Run the setups test's worker on 2 ranks under valgrind memcheck; report heap errors.

Not a test (nothing collects it): the check behind docs/testing.md's note on
the intermittent SIGSEGV. Each rank is its own ``valgrind python`` process, started
with torchrun's environment, and runs ``setups_worker`` of
``test_eval_state_dict_setups.py`` (torch as installed, then with the
backport), or only the stock half of the setups named on the command line.
Prints each rank's memcheck error kinds; exits 1 if any invalid access lies
outside the dynamic loader (whose start-up reads memcheck always reports).

    python test/memcheck_ranks.py                    # the whole worker: 6 minutes
    python test/memcheck_ranks.py explicit_unshard   # one setup, stock torch only
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from datetime import timedelta


HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

from _ranks import host_store, rank_env


WORLD_SIZE = 2
LOADER_FRAMES = ("dl-load.c", "strcmp-sse2.S")


def rank_main(names: list[str]) -> None:
    import gc

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from _fsdp_cases import run_case
    from test_eval_state_dict_setups import SETUPS, _calls, setups_worker

    # Ranks run ten times slower under memcheck: no short timeout here.
    dist.init_process_group("gloo", timeout=timedelta(minutes=50))
    try:
        if names:
            for name in names:
                case = SETUPS[name]
                print(name, run_case(case, _calls(case), check_losses=True))
        else:
            print(setups_worker(SETUPS))
    finally:
        dist.destroy_process_group()
        gc.collect()


ERROR_HEADER = re.compile(
    r"==\d+== ((?:Invalid (?:read|write) of size \d+|Invalid free\(\)[^\n]*"
    r"|Mismatched free\(\)[^\n]*|Syscall param [^\n]*))\n"
    r"((?:==\d+==\s+(?:at|by) [^\n]*\n)+)"
)


def heap_errors(log: str) -> list[str]:
    """Each invalid access memcheck reports outside the loader, with its frames."""
    return [
        match.group(1) + "\n" + match.group(2)
        for match in ERROR_HEADER.finditer(log)
        if not any(frame in match.group(2) for frame in LOADER_FRAMES)
    ]


def main(names: list[str]) -> int:
    store = host_store(WORLD_SIZE)
    with tempfile.TemporaryDirectory() as logs:
        procs = []
        for rank in range(WORLD_SIZE):
            env = dict(
                os.environ,
                **rank_env(store, rank, WORLD_SIZE),
                # Python's own allocator hides its blocks from memcheck.
                PYTHONMALLOC="malloc",
            )
            cmd = [
                "valgrind", "--tool=memcheck", "--error-limit=no", "--num-callers=30",
                "--undef-value-errors=no", f"--log-file={logs}/rank{rank}.log",
                sys.executable, os.path.abspath(__file__), "--rank", *names,
            ]
            procs.append(subprocess.Popen(cmd, env=env))
        codes = [proc.wait() for proc in procs]
        failed = False
        for rank, code in enumerate(codes):
            with open(f"{logs}/rank{rank}.log") as log_file:
                log = log_file.read()
            kinds = sorted({match.group(1) for match in ERROR_HEADER.finditer(log)})
            errors = heap_errors(log)
            summary = re.search(r"ERROR SUMMARY: [^\n]*", log)
            print(
                f"rank {rank}: exit code {code}; "
                f"{summary.group(0) if summary else 'no summary'}; "
                f"kinds: {kinds or 'none'}; outside the loader: {len(errors)}"
            )
            for error in errors[:5]:
                print(error)
            failed |= code != 0 or bool(errors)
    return 1 if failed else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank"]:
        rank_main(sys.argv[2:])
    else:
        sys.exit(main(sys.argv[1:]))
