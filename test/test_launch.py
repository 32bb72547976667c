"""test/_ranks.py: one world of ranks for several runs, and what ends it."""

import atexit
import ctypes
import gc
import multiprocessing.queues
import os
import pickle
import threading
import time
import unittest

import pytest
import torch.distributed as dist

import backport
from _ranks import RankError, RankWorld, run_ranks, shared_worlds


# This module manages its worlds itself.
pytestmark = [pytest.mark.ranks, pytest.mark.fresh_ranks, pytest.mark.tooling]

# The whole report of a run in which rank 0 segfaulted and rank 1 returned.
ONLY_RANK_0_SEGFAULTED = r"^1 of 2 ranks failed:\nrank 0: no result \(exit code -11\)$"


def pid_after_barrier() -> int:
    dist.barrier()
    return os.getpid()


def set_env_apply_backport_and_redirect_stderr() -> int:
    os.environ["LEFT_BY_A_RUN"] = "1"
    backport.apply()
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
    return os.getpid()


def what_a_run_left() -> tuple[int, str | None, bool, bool]:
    stderr_is_devnull = os.path.samestat(os.fstat(2), os.stat(os.devnull))
    return os.getpid(), os.environ.get("LEFT_BY_A_RUN"), backport.is_applied(), stderr_is_devnull


def raise_on_rank_1() -> int:
    if dist.get_rank() == 1:
        raise ValueError("raised by rank 1")
    return os.getpid()


def segfault_on_rank_0() -> None:
    if dist.get_rank() == 0:
        ctypes.string_at(0)


def segfault_holding_queue_locks_on_rank_0() -> None:
    # What a rank killed right after reporting can leave behind: the write
    # lock of a multiprocessing queue, taken by its feeder thread.
    if dist.get_rank() == 0:
        for obj in gc.get_objects():
            if isinstance(obj, multiprocessing.queues.Queue):
                obj._wlock.acquire()
        ctypes.string_at(0)


def exit_with_3_later() -> None:
    atexit.register(os._exit, 3)


def rendezvous_env() -> tuple[str, str]:
    return os.environ["MASTER_PORT"], os.environ["TORCHELASTIC_USE_AGENT_STORE"]


class RankWorldTest(unittest.TestCase):
    def test_runs_share_a_world_and_see_nothing_a_run_left(self) -> None:
        with shared_worlds():
            first = run_ranks(2, set_env_apply_backport_and_redirect_stderr)
            after = run_ranks(2, what_a_run_left)
        self.assertEqual([pid for pid, *_ in after], first)
        self.assertEqual([rest for _, *rest in after], [[None, False, False]] * 2)

    def test_a_failed_run_fails_alone_and_the_next_starts_a_new_world(self) -> None:
        with shared_worlds():
            before = run_ranks(2, pid_after_barrier)
            with self.assertRaisesRegex(
                RankError, r"(?s)^1 of 2 ranks failed:\nrank 1: .*ValueError: raised by rank 1"
            ):
                run_ranks(2, raise_on_rank_1)
            after_raise = run_ranks(2, pid_after_barrier)
            with self.assertRaisesRegex(RankError, ONLY_RANK_0_SEGFAULTED):
                run_ranks(2, segfault_on_rank_0)
            after_crash = run_ranks(2, pid_after_barrier)
        self.assertTrue(set(before).isdisjoint(after_raise))
        self.assertTrue(set(after_raise).isdisjoint(after_crash))

    def test_a_rank_killed_holding_a_queue_lock_does_not_stall_its_peers(self) -> None:
        # Rank 1 returns at once: its result must arrive, not time out.
        with self.assertRaisesRegex(RankError, ONLY_RANK_0_SEGFAULTED):
            run_ranks(2, segfault_holding_queue_locks_on_rank_0, timeout=60)

    def test_a_rank_that_exits_non_zero_fails_the_close(self) -> None:
        world = RankWorld(2)
        world.run(exit_with_3_later)
        with self.assertRaisesRegex(
            RankError, r"rank 0: returned its results, then exited with code 3"
        ):
            world.close()
        # Outside shared_worlds(), the run itself.
        with self.assertRaisesRegex(RankError, r"then exited with code 3"):
            run_ranks(2, exit_with_3_later)

    def test_what_cannot_be_sent_fails_at_once(self) -> None:
        """A function or arguments that do not pickle raise before any rank starts."""

        def local_function() -> int:
            return 1

        unsendable = {
            "lambda": (lambda: 1, ()),
            "local function": (local_function, ()),
            "unpicklable argument": (pid_after_barrier, (threading.Lock(),)),
        }
        for label, (fn, args) in unsendable.items():
            with self.subTest(label), shared_worlds():
                start = time.monotonic()
                with self.assertRaisesRegex(
                    pickle.PicklingError, r"^run_ranks cannot send .* to the ranks \("
                ):
                    run_ranks(2, fn, *args, timeout=60)
                self.assertLess(time.monotonic() - start, 5.0)

    def test_ranks_meet_at_the_launchers_store(self) -> None:
        envs = run_ranks(2, rendezvous_env)
        self.assertEqual(envs[0], envs[1])
        self.assertEqual(envs[0][1], "True")


if __name__ == "__main__":
    unittest.main()
