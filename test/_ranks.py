"""The tests' ranks: a function run on N local ranks under a gloo process group.

``run_ranks`` returns each rank's result. Inside ``shared_worlds()`` (test/conftest.py
opens one per test class) consecutive runs reuse one world of ranks, as torch's
``MultiProcContinuousTest`` keeps one per class; that class is private and
unittest-only, so the harness is ours. ``python -m backport`` does not use it: it
starts its ranks once, with torch's launcher (backport/_diagnose.py).

Ranks fork from multiprocessing's forkserver, which imports ``PRELOAD`` once:
a rank that imports torch itself spends seconds of CPU on it, which made up
a third of the suite's time (docs/testing.md). A rank sees the environment of
this process when its first world started (the server's), with its rank's
variables added.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import gc
import os
import pickle
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from multiprocessing.connection import wait
from multiprocessing.reduction import ForkingPickler
from typing import Any


# One failing rank must fail the run, not leave its peers in a collective until
# gloo's default 30 minute timeout.
PG_TIMEOUT = timedelta(seconds=90)
PRELOAD = [
    "torch",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
]


class RankError(RuntimeError):
    """A rank raised, timed out or died; carries every rank's report."""


def host_store(world_size: int):
    """A TCPStore on a port the OS assigns, hosted by this process for ranks it starts.

    As torchrun's agent does: the ranks' environment (``rank_env``) makes
    ``init_process_group``'s env:// rendezvous connect to it as clients, so no
    port is guessed and then bound by another process first. Keep it alive
    until the ranks have joined the group.
    """
    from torch.distributed import TCPStore

    return TCPStore(
        "127.0.0.1", 0, world_size, is_master=True, timeout=PG_TIMEOUT, wait_for_workers=False
    )


def rank_env(store, rank: int, world_size: int) -> dict[str, str]:
    """torchrun's environment for ``rank``, with ``store`` as the agent's store."""
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
    }


def _reset_after_run(environ: dict[str, str], stdio: tuple[int, int]) -> None:
    """Undo what a function may have changed in this process that the next one would see."""
    os.environ.clear()
    os.environ.update(environ)
    os.dup2(stdio[0], 1)
    os.dup2(stdio[1], 2)
    backport = sys.modules.get("backport")
    if backport is not None and backport.is_applied():
        backport.revert()
    # The next run's collectives must not meet this run's groups' threads.
    gc.collect()


def _rank_main(env, tasks, results) -> None:
    import torch.distributed as dist

    # Native libraries (gloo) log to stdout; keep the parent's stdout for results.
    os.dup2(2, 1)
    stdio = (os.dup(1), os.dup(2))
    # A rank killed by a signal (SIGSEGV, SIGABRT) prints its Python stacks to
    # stderr, which the test's report shows, instead of only its exit code.
    faulthandler.enable()
    os.environ.update(env)
    if "OMP_NUM_THREADS" not in os.environ:
        import torch

        # What torchrun does for several ranks on one host: one intra-op
        # thread each, so N ranks do not oversubscribe the cores.
        torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", timeout=PG_TIMEOUT)
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises
        results.send((False, traceback.format_exc(), False))
        return
    try:
        # One function after another until the parent sends None.
        for task in iter(tasks.get, None):
            fn, args = pickle.loads(task)
            environ = dict(os.environ)
            try:
                report = (True, fn(*args))
            except BaseException:  # noqa: BLE001 - reported to the parent
                report = (False, traceback.format_exc())
            _reset_after_run(environ, stdio)
            # A function that destroyed the group leaves no world to reuse.
            results.send((*report, dist.is_initialized()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        # destroy_process_group() unregisters the groups, but a gloo group that
        # something still holds (FSDP2's mesh info, in the reference cycles fn
        # left behind) keeps its worker threads. One that drops the last
        # collective's tensors after the interpreter began to finalize cannot
        # take the GIL and aborts the rank ("terminate called without an active
        # exception", upstream/c10d_issue/ISSUE.md). Freeing the groups now joins them.
        gc.collect()
        # A forked rank leaves through os._exit(), which skips atexit: run the
        # handlers (torch's among them) as a spawned rank's exit would.
        atexit._run_exitfuncs()


def _pickled(fn: Callable[..., Any], args: tuple[Any, ...]) -> bytes:
    """``(fn, args)`` as the ranks receive it; raises at once for what cannot be sent.

    A queue pickles in a background thread, which only prints the error: the
    run would wait for results until its timeout.
    """
    try:
        return bytes(ForkingPickler.dumps((fn, args)))
    except Exception as err:
        raise pickle.PicklingError(
            f"run_ranks cannot send {getattr(fn, '__qualname__', repr(fn))} and its "
            f"arguments to the ranks ({type(err).__name__}: {err}): pass a function "
            "defined at module level and picklable arguments"
        ) from err


class RankWorld:
    """``world_size`` ranks in one gloo group, running functions one after another.

    As torch's ``MultiProcContinuousTest`` keeps one world per test class:
    ``run`` starts the ranks the first time and reuses them after a run that
    every rank completed. A run in which a rank raised, died or timed out
    raises RankError and ends the world (its peers may be stuck in a
    collective); the next run starts a new one. Between runs each rank restores
    its environment variables and standard streams, reverts the backport if a
    function left it applied, and collects garbage. ``close`` stops the ranks
    and raises RankError for one that exits with a non-zero code.
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._procs: list[Any] = []
        self._tasks: list[Any] = []
        self._results: list[Any] = []
        self._store: Any = None
        self._previous_run = ""

    def _start(self) -> None:
        import torch.multiprocessing as mp

        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        # A pipe per rank for its results, not one queue for all: a rank killed
        # right after reporting can die holding a shared queue's write lock,
        # and its peers' results then never arrive.
        pipes = [ctx.Pipe(duplex=False) for _ in range(self.world_size)]
        self._results = [reader for reader, _ in pipes]
        self._store = host_store(self.world_size)
        self._procs = [
            ctx.Process(
                target=_rank_main,
                args=(rank_env(self._store, rank, self.world_size), self._tasks[rank], writer),
            )
            for rank, (_, writer) in enumerate(pipes)
        ]
        for proc in self._procs:
            proc.start()
        # Each rank now holds the only writing end of its pipe: when it dies,
        # its reader reaches end of file.
        for _, writer in pipes:
            writer.close()

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 600.0) -> list[Any]:
        """Run ``fn(*args)`` on every rank; return the results by rank.

        ``fn`` must be importable by qualified name and return something
        picklable. Raises RankError naming every rank that raised, timed out
        or died.
        """
        dead = [
            f"rank {rank}: died after {self._previous_run} returned (exit code {proc.exitcode})"
            for rank, proc in enumerate(self._procs)
            if not proc.is_alive()
        ]
        if dead:
            self._kill()
            raise RankError(f"{len(dead)} of {self.world_size} ranks failed:\n" + "\n".join(dead))
        task = _pickled(fn, args)
        if not self._procs:
            self._start()
        self._previous_run = getattr(fn, "__qualname__", repr(fn))
        for tasks in self._tasks:
            tasks.put(task)
        reports: dict[int, tuple[bool, Any, bool]] = {}
        silent = dict(zip(self._results, range(self.world_size)))
        deadline = time.monotonic() + timeout
        while silent:
            ready = wait(list(silent), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for conn in ready:
                rank = silent.pop(conn)
                try:
                    reports[rank] = conn.recv()
                except EOFError:
                    # Died before reporting (a crash at start-up, a signal).
                    self._procs[rank].join(timeout=5.0)
        failures = [
            f"rank {rank}: {reports[rank][1]}" if rank in reports else
            f"rank {rank}: no result (exit code {self._procs[rank].exitcode})"
            for rank in range(self.world_size)
            if not reports.get(rank, (False,))[0]
        ]
        if failures:
            self._kill()
            raise RankError(
                f"{len(failures)} of {self.world_size} ranks failed:\n" + "\n".join(failures)
            )
        if not all(reusable for _, _, reusable in reports.values()):
            self.close()
        return [reports[rank][1] for rank in range(self.world_size)]

    def _kill(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
            proc.join()
        self._procs = []
        self._close_results()

    def _close_results(self) -> None:
        for conn in self._results:
            conn.close()
        self._results = []

    def close(self) -> None:
        """Stop the ranks; raise RankError for one that exits with a non-zero code.

        A rank that returned its results and then crashed at exit (after
        ``destroy_process_group()``) fails here: no crash hides behind a result.
        """
        for tasks, proc in zip(self._tasks, self._procs):
            if proc.is_alive():
                tasks.put(None)
        procs, self._procs = self._procs, []
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._close_results()
        failures = [
            f"rank {rank}: returned its results, then exited with code {proc.exitcode}"
            for rank, proc in enumerate(procs)
            if proc.exitcode != 0
        ]
        if failures:
            raise RankError(
                f"{len(failures)} of {self.world_size} ranks failed:\n" + "\n".join(failures)
            )


# The worlds that run_ranks reuses, by world size, while shared_worlds() is open.
_shared_worlds: dict[int, RankWorld] | None = None


@contextlib.contextmanager
def shared_worlds() -> Iterator[None]:
    """Within this block, run_ranks reuses one RankWorld per world size; closed at exit."""
    global _shared_worlds
    outer, _shared_worlds = _shared_worlds, {}
    try:
        yield
    finally:
        worlds, _shared_worlds = _shared_worlds, outer
        errors = []
        for world in worlds.values():
            try:
                world.close()
            except RankError as e:
                errors.append(str(e))
        if errors:
            raise RankError("\n".join(errors))


def run_ranks(
    world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = 600.0
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` ranks; return the results by rank.

    ``fn`` must be importable by qualified name and return something picklable.
    Raises RankError naming every rank that raised, timed out or died, also
    one that died at exit after returning its result. Inside ``shared_worlds()``
    the ranks are those of the block's world of that size (``RankWorld``), and
    the exit codes are checked when the block ends.
    """
    if _shared_worlds is None:
        world = RankWorld(world_size)
        try:
            results = world.run(fn, *args, timeout=timeout)
        finally:
            world.close()
        return results
    world = _shared_worlds.setdefault(world_size, RankWorld(world_size))
    return world.run(fn, *args, timeout=timeout)
