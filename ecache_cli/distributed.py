"""Data parallelism over processes started by ``torchrun`` or ``accelerate launch``.

The launcher sets ``WORLD_SIZE``, ``RANK`` and ``LOCAL_RANK`` (and ``MASTER_ADDR``/``MASTER_PORT``);
without them everything here is a single process and costs nothing. With them, each rank:

- uses one device: ``cuda:LOCAL_RANK`` when CUDA is available (NCCL backend), else the CPU (gloo);
- works on its shard of the items, a round-robin split (item ``i`` belongs to rank ``i % world``), so
  the union over ranks is every item exactly once and a rank's share never differs by more than one;
- sends its results to the others with ``torch.distributed`` object collectives; rank 0 writes
  every file (tables, JSON, profiles, the calibrate run file).

A rank that dies makes the others' next collective fail; :func:`DistEnv.all_gather_object` turns that
into one :class:`~ecache_cli.errors.EcacheError` naming this rank and the collective, and the launcher
(torchrun's elastic agent, accelerate) reports the rank that failed and its exit code. The wait for a
silent peer is ``ECACHE_DIST_TIMEOUT`` seconds (default 1800, torch's own default for gloo).

Speed across ranks is aggregated as total generated tokens over the wall time of the slowest rank
(:func:`aggregate_speed`): the ranks run at the same time, so that is the throughput a user gets.
"""

from __future__ import annotations

import atexit
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Sequence, TypeVar

import torch

from .errors import EcacheError, UsageError

T = TypeVar("T")


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits: ``rank`` in [0, ``world_size``), ``local_rank`` on its node."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def active(self) -> bool:
        """True under a launcher with more than one process."""
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """True on rank 0, the rank that writes files and prints results."""
        return self.rank == 0

    def owns(self, index: int) -> bool:
        """Whether item ``index`` (0-based) belongs to this rank (round-robin)."""
        return index % self.world_size == self.rank

    def shard(self, items: Sequence[T]) -> list[T]:
        """This rank's items of ``items``: positions rank, rank + world, rank + 2·world, ..."""
        return list(items[self.rank::self.world_size])

    def device(self, requested: str | None = "auto") -> str | None:
        """The device this rank should use: ``cuda:LOCAL_RANK`` when ranks are active and CUDA is there
        (whatever ``requested`` says about CUDA), else ``requested`` unchanged (cpu, auto, ...).

        Raises UsageError when ``requested`` names one CUDA device (``cuda:N``) under several ranks:
        every rank would use the same GPU.
        """
        if not self.active:
            return requested
        if requested not in (None, "auto", "cuda") and str(requested).startswith("cuda:"):
            raise UsageError(f"--device {requested} under {self.world_size} ranks would put every rank on one GPU; "
                             "pass --device cuda (each rank takes cuda:LOCAL_RANK) or auto")
        if requested in (None, "auto", "cuda") and torch.cuda.is_available():
            return f"cuda:{self.local_rank}"
        return requested

    def all_gather_object(self, obj, what: str = "results"):
        """Every rank's ``obj`` as a list indexed by rank (``[obj]`` for one process).

        Raises EcacheError (one line, naming this rank and ``what``) when a peer is gone.
        """
        if not self.active:
            return [obj]
        out = [None] * self.world_size
        try:
            torch.distributed.all_gather_object(out, obj)
        except (RuntimeError, ConnectionError) as e:  # a dead peer: gloo "connection closed", NCCL timeout
            raise EcacheError(f"rank {self.rank}: lost the other ranks while gathering {what} "
                              f"({str(e).splitlines()[0]}); "
                              "the launcher's log names the rank that failed; rerun with --resume to finish") from None
        return out

    def agree(self, fn, what: str):
        """Run ``fn()`` on every rank and fail together: when it raises an EcacheError on some rank, that
        rank re-raises it and every other rank raises one naming it (instead of waiting for it forever
        at the next collective). Returns ``fn()``'s value. One process: just ``fn()``."""
        if not self.active:
            return fn()
        value, failure = None, None
        try:
            value = fn()
        except EcacheError as e:
            failure = e
        msgs = self.all_gather_object(None if failure is None else str(failure), what)
        if failure is not None:
            raise failure
        bad = next(((r, m) for r, m in enumerate(msgs) if m is not None), None)
        if bad is not None:
            raise EcacheError(f"rank {bad[0]} failed while {what}: {bad[1]}")
        return value

    def barrier(self) -> None:
        """Wait for every rank (no-op for one process)."""
        if self.active:
            self.all_gather_object(None, "a barrier")


_ENV: DistEnv | None = None


def from_environment(environ=None) -> DistEnv:
    """Read ``WORLD_SIZE``/``RANK``/``LOCAL_RANK`` (torchrun, accelerate launch) without initialising.

    Raises UsageError for values that are not integers or a rank outside [0, world).
    """
    env = os.environ if environ is None else environ
    try:
        world = int(env.get("WORLD_SIZE", "1"))
        rank = int(env.get("RANK", "0"))
        local = int(env.get("LOCAL_RANK", str(rank)))
    except ValueError:
        raise UsageError(f"WORLD_SIZE={env.get('WORLD_SIZE')!r} RANK={env.get('RANK')!r} "
                         f"LOCAL_RANK={env.get('LOCAL_RANK')!r}: "
                         "launcher variables must be integers (start with torchrun or accelerate launch)") from None
    if world < 1 or not 0 <= rank < world:
        raise UsageError(f"RANK={rank} is outside WORLD_SIZE={world}; "
                         "start the processes with torchrun or accelerate launch")
    return DistEnv(rank=rank, world_size=world, local_rank=local)


def setup() -> DistEnv:
    """The process's :class:`DistEnv`, initialising ``torch.distributed`` once when ranks are active.

    Backend: NCCL when CUDA is available (and the rank's GPU becomes the current device), else gloo.
    Calling it again returns the same object. For one process nothing is initialised.
    """
    global _ENV
    if _ENV is not None:
        return _ENV
    env = from_environment()
    if env.active and not torch.distributed.is_initialized():
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(env.local_rank)
        timeout = timedelta(seconds=float(os.environ.get("ECACHE_DIST_TIMEOUT", "1800")))
        torch.distributed.init_process_group("nccl" if cuda else "gloo", rank=env.rank, world_size=env.world_size,
                                             timeout=timeout)
        atexit.register(_teardown)
    _ENV = env
    return env


def _teardown() -> None:
    """At exit: wait for every rank, then close the process group. Without it a rank that finishes
    first (every rank but 0, which still prints and writes) tears its gloo threads down under a peer
    that is still connected, and the process aborts ("terminate called without an active exception")."""
    if not torch.distributed.is_initialized():
        return
    try:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    except Exception:  # noqa: BLE001 - exiting anyway; a dead peer was reported by the launcher
        pass


def aggregate_speed(per_rank: Sequence[dict]) -> dict:
    """Throughput of ranks that ran side by side.

    ``per_rank``: one dict per rank with ``generated_tokens`` (int) and ``wall_s`` (seconds that rank
    spent decoding). Returns ``generated_tokens`` (sum), ``wall_s`` (the slowest rank's), ``tokens_per_s``
    (sum over slowest; 0 when no time) and ``ranks`` (the inputs, in rank order).
    """
    tokens = sum(int(r["generated_tokens"]) for r in per_rank)
    wall = max((float(r["wall_s"]) for r in per_rank), default=0.0)
    return {"generated_tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall if wall > 0 else 0.0,
            "world_size": len(per_rank), "ranks": [dict(r) for r in per_rank]}
