"""Data-parallel training over Ray workers: one process per GPU (on CPU, per share of the cores), joined into
one ``torch.distributed`` group that TRL's trainers use through accelerate (DDP, gradients averaged).

The workers are Ray actors, so a stage spreads over the GPUs of one node or of a cluster alike. Each gets the
environment ``torchrun`` would give it (``MASTER_ADDR``/``MASTER_PORT`` of rank 0, ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``) and, on GPUs, sees the GPUs of all workers on its node so that ``LOCAL_RANK`` picks its own.
A stage's batch size stays the global batch (each worker takes ``batch_size / world_size`` rows), so a recipe
computes the same steps on any number of workers, and its checkpoints resume on any that divides the batch.
"""

from __future__ import annotations

import os
import socket
from typing import Any, Callable

import ray


def world() -> tuple[int, int]:
    """``(rank, world_size)`` of this process (``(0, 1)`` outside data-parallel training)."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def free_port() -> int:
    """A TCP port free on this node now (for a process group's store)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def is_main_process() -> bool:
    """The process that writes a stage's files (metrics, plots, the final model)."""
    return world()[0] == 0


class TrainWorker:
    """One data-parallel training process (a Ray actor)."""

    def where(self) -> tuple[str, list[str]]:
        """This worker's node address and the GPUs Ray gave it."""
        return ray.util.get_node_ip_address(), [str(g) for g in ray.get_gpu_ids()]

    def free_port(self) -> int:
        return free_port()

    def run(self, fn: Callable, env: dict[str, str], *args) -> Any:
        os.environ.update(env)
        try:
            return fn(*args)
        finally:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def run_data_parallel(fn: Callable, args: tuple, options: list[dict], what: str) -> Any:
    """Runs ``fn(*args)`` in one process per entry of ``options`` (its Ray resources and scheduling), joined into
    one process group; returns rank 0's result.

    A worker that dies (or raises) fails the whole stage with a message naming ``what`` and the cause; the
    stage's checkpoints are what a re-run resumes from.
    """
    num_workers = len(options)
    actor = ray.remote(TrainWorker)
    workers = [actor.options(**o).remote() for o in options]
    try:
        places = ray.get([w.where.remote() for w in workers])
        master = places[0][0]
        port = ray.get(workers[0].free_port.remote())
        envs = []
        for rank, (node, gpus) in enumerate(places):
            on_node = [p for p in places if p[0] == node]
            env = {"MASTER_ADDR": master, "MASTER_PORT": str(port), "RANK": str(rank),
                   "WORLD_SIZE": str(num_workers), "LOCAL_WORLD_SIZE": str(len(on_node)),
                   "LOCAL_RANK": str([i for i, p in enumerate(places) if p[0] == node].index(rank))}
            if gpus:  # every worker of the node sees the node's training GPUs; LOCAL_RANK picks its own
                visible = sorted({g for p in on_node for g in p[1]}, key=int)
                env["CUDA_VISIBLE_DEVICES"] = ",".join(visible)
                env["LOCAL_RANK"] = str(visible.index(gpus[0]))
            envs.append(env)
        futures = [w.run.remote(fn, env, *args) for w, env in zip(workers, envs)]
        pending = list(futures)
        try:
            while pending:  # the first worker to fail stops the stage: the others would wait in a collective
                done, pending = ray.wait(pending, num_returns=1)
                ray.get(done)
            return ray.get(futures[0])
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as error:
            raise RuntimeError(
                f"{what}: a data-parallel training worker failed ({type(error).__name__}); the stage stopped. "
                f"Run `{rerun_command()}` again to resume from its last complete checkpoint (on any number of GPUs "
                f"that divides the batch). Cause: {error}") from error
    finally:
        for w in workers:
            ray.kill(w)


def rerun_command() -> str:
    """The command line this driver was started with, as a user would type it again."""
    import shlex
    import sys

    program = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "sse-pipeline"
    program = "sse-pipeline" if program in ("cli.py", "__main__.py") else program
    return shlex.join([program, *sys.argv[1:]])
