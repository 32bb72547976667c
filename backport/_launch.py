"""Run a function on N local ranks under a gloo process group and collect the results."""

from __future__ import annotations

import faulthandler
import gc
import os
import queue
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable


# One failing rank must fail the run, not leave its peers in a collective until
# gloo's default 30 minute timeout.
PG_TIMEOUT = timedelta(seconds=90)


class RankError(RuntimeError):
    """A rank raised, timed out or died; carries every rank's report."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(rank, world_size, port, fn, args, results) -> None:
    import torch.distributed as dist

    # Native libraries (gloo) log to stdout; keep the parent's stdout for results.
    os.dup2(2, 1)
    # A rank killed by a signal (SIGSEGV, SIGABRT) prints its Python stacks to
    # stderr, which the test's report shows, instead of only its exit code.
    faulthandler.enable()
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    if "OMP_NUM_THREADS" not in os.environ:
        import torch

        # What torchrun does for several ranks on one host: one intra-op
        # thread each, so N ranks do not oversubscribe the cores.
        torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", timeout=PG_TIMEOUT)
        results.put((rank, True, fn(*args)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        # destroy_process_group() unregisters the groups, but a gloo group that
        # something still holds (FSDP2's mesh info, in the reference cycles fn
        # left behind) keeps its worker threads. One that drops the last
        # collective's tensors after the interpreter began to finalize cannot
        # take the GIL and aborts the rank ("terminate called without an active
        # exception", c10d_issue/ISSUE.md). Freeing the groups now joins them.
        gc.collect()


def run_ranks(
    world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = 600.0
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` spawned ranks; return the results by rank.

    ``fn`` must be importable by qualified name and return something picklable.
    Raises RankError naming every rank that raised, timed out or died, also
    one that died at exit after returning its result.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(rank, world_size, port, fn, args, results))
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    reports: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(reports) < world_size and time.monotonic() < deadline:
            try:
                rank, ok, value = results.get(timeout=1.0)
            except queue.Empty:
                # A rank that died before reporting (a crash at start-up, a
                # signal) reports nothing: stop waiting once every silent rank
                # has exited and its last message had time to arrive.
                silent = [p for r, p in enumerate(procs) if r not in reports]
                if all(p.exitcode is not None for p in silent):
                    try:
                        rank, ok, value = results.get(timeout=5.0)
                    except queue.Empty:
                        break
                else:
                    continue
            reports[rank] = (ok, value)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join()
    failures = [
        f"rank {rank}: {reports[rank][1]}" if rank in reports else
        f"rank {rank}: no result (exit code {procs[rank].exitcode})"
        for rank in range(world_size)
        if not reports.get(rank, (False,))[0]
    ]
    # A rank that returned its result and then crashed at exit (after
    # destroy_process_group()) fails the run too: no crash hides behind a result.
    failures += [
        f"rank {rank}: returned its result, then exited with code {procs[rank].exitcode}"
        for rank in range(world_size)
        if reports.get(rank, (False,))[0] and procs[rank].exitcode != 0
    ]
    if failures:
        raise RankError(f"{len(failures)} of {world_size} ranks failed:\n" + "\n".join(failures))
    return [reports[rank][1] for rank in range(world_size)]
