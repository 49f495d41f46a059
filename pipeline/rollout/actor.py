"""Ray wrappers: a rollout engine per actor, and a fleet that spreads requests over several of them and
replaces an engine that dies."""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import ray
import torch
from torch.distributed.tensor import DTensor

from . import create_engine
from .engine import Engine, RequestOutput
from .sampling import SamplingParams

logger = logging.getLogger(__name__)


class RolloutWorker:
    """A rollout engine (``engine.backend``: :class:`Engine` or vLLM) inside a Ray actor, results returned by value.

    :meth:`generate` is one blocking call. Beside it, a thread of its own steps the engine while requests run
    (:meth:`start`, :meth:`result`), so that requests can join and weights arrive while it generates (the actor's
    calls return while the loop runs); a condition lets either the loop step the engine or one call use it, and a
    call waiting for its turn goes before the loop's next step. Callers waiting for results wait on a second
    condition the loop only notifies, never on the engine's, which the loop takes again step after step.
    Weights loaded while sequences run (this package's engine) are what they continue under (partial rollouts);
    each completion then lists where its tokens' weights changed (``weight_versions``)."""

    def __init__(self, model, tokenizer=None, sleep_between_calls: bool = False, **engine_kwargs):
        from ..storage import materialize

        torch.set_num_threads(max(1, int(ray.get_runtime_context().get_assigned_resources().get("CPU", 1))))
        self.source = model if isinstance(model, str) else None
        if isinstance(model, str):  # a local checkpoint, or a stored one this node fetches into its cache
            model = str(materialize(model))
        self.engine = create_engine(model, tokenizer, **engine_kwargs)
        self.sleep_between_calls = sleep_between_calls  # colocated with a trainer: free memory between rollouts
        self.busy_s = 0.0  # seconds spent generating (the rest of its life it waited for the trainer)
        self._cond, self._counting = threading.Condition(), threading.Lock()
        self._finished = threading.Condition()  # notified after a step that finished requests (held for none)
        self._waiting_calls = 0  # calls waiting for the engine: the loop lets them in before its next step
        self._done: dict[str, RequestOutput] = {}
        self._changes: dict[str, list[tuple[int, dict]]] = {}  # request -> (weights version, sample -> tokens before)
        self._error: BaseException | None = None
        self._loop: threading.Thread | None = None
        if sleep_between_calls:  # and until the first: the trainer loads its model after the engines start
            self.engine.sleep()

    @contextmanager
    def _turn(self):
        """The engine to this call, between two steps of the loop (counted before it asks for the lock, which
        the loop would otherwise take again step after step)."""
        with self._counting:
            self._waiting_calls += 1
        try:
            with self._cond:
                yield
        finally:
            with self._counting:
                self._waiting_calls -= 1
            with self._cond:
                self._cond.notify_all()

    def start(self, prompts, sampling_params) -> list[str]:
        """Adds requests (those running go on) and returns their ids at once; :meth:`result` waits for them."""
        with self._turn():
            if not self.engine.has_unfinished():
                self.engine.wake_up()  # a sleeping engine plans its memory before the requests are checked
            ids = [self.engine.add_request(p, sp) for p, sp in zip(prompts, sampling_params)]
            for i in ids:
                self._changes[i] = [(self.engine.weights_version, {})]
        if self._loop is None:
            self._loop = threading.Thread(target=self._serve, name="engine-loop", daemon=True)
            self._loop.start()
        return ids

    def result(self, ids: list[str]) -> list[RequestOutput]:
        """:meth:`start`'s requests once every one has finished, in order. It waits for them apart from the engine,
        then takes its turn: waiting on the engine's condition, it could not get its lock while other requests ran
        (the loop takes it again at once), and returned only once the engine ran dry."""
        with self._finished:
            self._finished.wait_for(lambda: self._error is not None or all(i in self._done for i in ids))
        with self._turn():
            if self._error is not None:
                raise RuntimeError(f"the engine's loop failed: {self._error!r}") from self._error
            outputs = [self._done.pop(i) for i in ids]
            for out in outputs:
                changes = self._changes.pop(out.request_id)
                if len(changes) > 1:  # the weights changed while it ran
                    for completion in out.outputs:
                        completion.weight_versions = weight_versions(changes, completion.index)
            if self.sleep_between_calls and not self.engine.has_unfinished():
                self.engine.sleep()
        return outputs

    def generate(self, prompts, sampling_params) -> list[RequestOutput]:
        """One blocking call: the engine's own ``generate`` in this thread; while the loop runs requests of
        :meth:`start`, these join them (the engine's ``generate`` would step theirs and drop what finished)."""
        with self._turn():
            if not self.engine.has_unfinished():
                start = time.perf_counter()
                outputs = self.engine.generate(prompts, sampling_params)
                if self.sleep_between_calls:
                    self.engine.sleep()
                self.busy_s += time.perf_counter() - start
                return outputs
        return self.result(self.start(prompts, sampling_params))

    def _serve(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self.engine.has_unfinished() and not self._waiting_calls)
                start, finished = time.perf_counter(), False
                try:
                    for out in self.engine.step():
                        self._done[out.request_id], finished = out, True
                except BaseException as error:  # noqa: BLE001 - handed to the callers waiting in result()
                    self._error = error
                self.busy_s += time.perf_counter() - start
            if finished or self._error is not None:  # (waking the callers every step would take the GIL from it)
                with self._finished:
                    self._finished.notify_all()
            if self._error is not None:
                return

    def _load(self, weights, version: int | None) -> int:
        """Loads weights between two steps; requests running continue under them (this package's engine)."""
        with self._turn():
            if not self.engine.has_unfinished():
                self.engine.update_weights(weights, version)
            elif not isinstance(self.engine, Engine):
                raise RuntimeError(f"weights while requests run: the {type(self.engine).__name__} cannot continue "
                                   "them under new weights (partial rollouts need engine.backend: sse)")
            else:
                queued = int(self.engine.overlap)  # a decode step queued before the load used the old weights
                tokens = {}
                for seq in [*self.engine.scheduler.running, *self.engine.scheduler.resuming]:
                    tokens.setdefault(seq.request.id, {})[seq.index] = len(seq.token_ids) + queued
                self.engine.update_weights(weights, version, in_flight=True)
                for request_id, changes in self._changes.items():
                    if request_id not in self._done:  # (finished ones wait for their caller)
                        changes.append((self.engine.weights_version, tokens.get(request_id, {})))
            # inside the turn: no CUDA call from this thread while the loop may capture a graph
            return self._updated()

    def _updated(self) -> int:
        """The engine's weight version once its copies are done on the device: a sync is timed to completion, and
        the trainer may free or change what the engine copied from."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        return self.engine.weights_version

    def update_weights(self, weights, version: int | None = None) -> int:
        return self._load(weights, version)

    def open_weights(self, shared: list, version: int) -> int:
        """Copies the weights from the trainer's GPU buckets (:func:`pipeline.rollout.weight_sync.share`); returns
        once the copies are done, so that the trainer may free its buckets."""
        from .weight_sync import opened

        return self._load(opened(shared), version)

    def broadcast_device(self) -> str:
        """The device broadcast weights arrive on: asked before the sync group forms, so that an engine that cannot
        take them fails the call at once rather than leaving the trainer in the group's timeout."""
        device = getattr(self.engine, "device", None)
        if not isinstance(device, torch.device):
            raise NotImplementedError(f"weight_sync broadcast: the {type(self.engine).__name__} takes no broadcast "
                                      "weights (this package's engine does); use object_store")
        return str(device)

    def join_weight_sync(self, host: str, port: int, rank: int, world_size: int, backend: str) -> None:
        from .weight_sync import process_group

        with self._turn():  # (NCCL may touch the device: not while the loop captures a graph)
            self.sync_group, self.sync_backend = process_group(host, port, rank, world_size, backend), backend

    def receive_weights(self, layout, version: int) -> int:
        """Takes the weights the trainer broadcasts over the sync group, bucket by bucket."""
        from .weight_sync import receive

        device = self.engine.device if self.sync_backend == "nccl" else torch.device("cpu")
        return self._load(receive(self.sync_group, layout, device), version)

    def weight_dtypes(self) -> dict[str, torch.dtype]:
        """The dtype of each of the engine's weights (none known for an engine without a module of ours)."""
        model = getattr(self.engine, "model", None)
        return {k: v.dtype for k, v in model.state_dict().items()} if isinstance(model, torch.nn.Module) else {}

    def get_stats(self) -> dict:
        return {**self.engine.get_stats(), "node": ray.get_runtime_context().get_node_id(), "source": self.source,
                "busy_s": self.busy_s}

    def capacity(self, seq_len: int | None = None) -> int:
        return self.engine.capacity(seq_len)


def weight_versions(changes: list[tuple[int, dict]], sample: int) -> list[tuple[int, int]]:
    """``[(first token, weights version), ...]`` of one sample from its request's changes (a sample not yet started
    at a change generated every token under the new weights; the boundary may be a token late or early, where a
    preemption recomputed the sequence)."""
    out = [(0, changes[0][0])]
    for version, tokens in changes[1:]:
        at = tokens.get(sample, 0)
        out = [(0, version)] if at == 0 else out + [(at, version)]
    return out


def gathered(state_dict, dtypes: dict) -> dict[str, torch.Tensor]:
    """A sharded state dict whole in host memory, each tensor gathered (``DTensor.full_tensor``, a collective over
    the workers that share it) and cast to the dtype the engines keep it in, one at a time."""
    out = {}
    for name, value in state_dict.items():
        full = value.full_tensor() if isinstance(value, DTensor) else value
        out[name] = full.detach().to(dtypes.get(name, full.dtype)).to("cpu", non_blocking=True)
        del full
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()  # the non-blocking copies have landed
    return out


def _put(state_dict, dtypes: dict | None = None) -> ray.ObjectRef:
    """The weights in Ray's object store, once for every engine; each cast (on its device) to ``dtypes[name]``,
    the dtype the engines keep it in: a bf16 engine's copy of float32 master weights is half the bytes to bring to
    the host, store and load, and the same values the engine's own cast would give."""
    dtypes = dtypes or {}
    return ray.put({k: v.detach().to(dtypes.get(k, v.dtype)).cpu() for k, v in state_dict.items()})


@dataclass
class Generation:
    """A generation submitted to a fleet: its requests, each engine's share and the futures not yet collected, the
    weight version the engines start it with, and whether it joins the engines' loops (:meth:`EngineFleet.submit`)."""

    prompts: list
    params: list[SamplingParams]
    shards: list[list[int]]
    pending: dict
    weights_version: int
    joins: bool = True


class EngineFleet:
    """``num_engines`` rollout actors behind one ``generate``: requests are dealt out in turn (all samples
    of a request stay on one engine, where they share its prefill), results come back in order.

    Weights travel through Ray's object store (``weight_sync="object_store"``: put once, every engine loads
    them; works wherever the engines are, including on the trainer's own GPU), are broadcast over a process
    group of the trainer and the engines (``"nccl"`` for engines on GPUs of their own, ``"gloo"`` on CPU), or,
    for engines on the trainer's GPU, are opened by them in the trainer's memory (``"cuda_ipc"``); see
    :mod:`pipeline.rollout.weight_sync`. A sync that fails by broadcast or CUDA IPC goes through the object store
    (CUDA IPC, failed but for a dead engine, is not tried again).

    An engine whose actor dies (its process killed, its node lost) is replaced by a new actor built from the
    same arguments, given the latest synced weights, and its share of the call is submitted again; sampling is
    seeded per request, so the results are those the dead engine would have returned. At most
    ``max_restarts`` replacements per fleet, then the call fails with the cause.
    """

    def __init__(self, model, tokenizer=None, num_engines: int = 1, num_gpus: float = 0, num_cpus: float = 1,
                 resources: dict | None = None, placement_group=None, bundles: list[int] | None = None,
                 max_restarts: int = 3, weight_sync: str = "object_store", **engine_kwargs):
        """``placement_group`` / ``bundles``: the group reserved for the stage and each engine's bundle in it
        (:mod:`pipeline.placement`); a replacement takes its predecessor's bundle."""
        if weight_sync not in ("object_store", "nccl", "gloo", "cuda_ipc"):
            raise ValueError(f"weight_sync must be 'object_store', 'nccl', 'gloo' or 'cuda_ipc', got {weight_sync!r}")
        self._actor = ray.remote(num_gpus=num_gpus, num_cpus=num_cpus, resources=resources or None)(RolloutWorker)
        self._group_of, self._bundles = placement_group, bundles
        self._args, self._kwargs = (model, tokenizer), engine_kwargs
        self.max_restarts, self.restarts = max_restarts, 0
        self.weight_sync = weight_sync
        self.sleeps = bool(engine_kwargs.get("sleep_between_calls"))  # its engines share a trainer's GPU memory
        self._group = None  # the broadcast group, formed at the first sync (again after a replacement)
        # the latest synced weights, for a replacement: an object ref, or (broadcast, CUDA IPC) the trainer's state
        # dict, whose tensors change only when the trainer steps (generating ahead, a replacement made while the
        # trainer trains gets its newer weights; each token's engine log-prob still feeds the correction)
        self._weights, self._source, self._version = None, None, 0
        self._dtypes: dict | None = None  # the engines' weight dtypes, asked once (object-store sync)
        self.busy_s = 0.0  # the engines' seconds spent generating, summed, as of the last sync
        self.workers = [self._start(i) for i in range(num_engines)]

    def _start(self, i: int):
        actor = self._actor
        if self._group_of is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            actor = actor.options(scheduling_strategy=PlacementGroupSchedulingStrategy(self._group_of, self._bundles[i]))
        return actor.remote(*self._args, **self._kwargs)

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams]) -> list[RequestOutput]:
        return self.collect(self.submit(prompts, sampling_params, joins=False))

    def submit(self, prompts, sampling_params: SamplingParams | list[SamplingParams], joins: bool = True) -> Generation:
        """Starts a generation and returns at once: the trainer trains while the engines generate, and
        :meth:`collect` takes the results. ``joins``: the requests join whatever the engines run, on their own
        loops, and weights synced meanwhile reach them (:meth:`RolloutWorker.start`); else one blocking call per
        engine (:meth:`RolloutWorker.generate`), after which a sync waits."""
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        shards = [list(range(i, len(prompts), len(self.workers))) for i in range(len(self.workers))]
        generation = Generation(prompts, params, shards, {}, self._version, joins)
        generation.pending = {i: self._submit_shard(generation, i) for i, idx in enumerate(shards) if idx}
        return generation

    def _submit_shard(self, generation: Generation, i: int):
        """Engine ``i``'s share: started (a future of its requests' ids), or a future of its outputs."""
        shard = generation.shards[i]
        call = self.workers[i].start if generation.joins else self.workers[i].generate
        return call.remote([generation.prompts[j] for j in shard], [generation.params[j] for j in shard])

    def collect(self, generation: Generation) -> list[RequestOutput]:
        """The results of :meth:`submit`'s generation, in request order; an engine that died meanwhile is replaced
        and its share submitted again."""
        results: list[RequestOutput | None] = [None] * len(generation.prompts)
        pending = generation.pending
        while pending:
            i, future = next(iter(pending.items()))
            try:  # (Ray hands result() the ids once they are started)
                outs = ray.get(self.workers[i].result.remote(future) if generation.joins else future)
            except ray.exceptions.RayActorError as error:
                self._replace(i, error)
                pending[i] = self._submit_shard(generation, i)
                continue
            del pending[i]
            for j, out in zip(generation.shards[i], outs):
                results[j] = out
        return results  # type: ignore[return-value]

    def _replace(self, i: int, error: Exception) -> None:
        if self.restarts >= self.max_restarts:
            raise RuntimeError(f"rollout engine {i} died and the fleet has already replaced {self.restarts} "
                               f"(max_restarts={self.max_restarts}): {error}") from error
        self.restarts += 1
        logger.warning("rollout engine %d died (%s); replacing it (%d of at most %d) and resubmitting its requests",
                       i, type(error).__name__, self.restarts, self.max_restarts)
        ray.kill(self.workers[i], no_restart=True)
        self.workers[i] = self._start(i)
        self._group = None  # the broadcast group lost a member: formed anew at the next sync
        if self._weights is None and self._source is not None:
            self._weights = _put(self._source, self._dtypes)
        if self._weights is not None:
            ray.get(self.workers[i].update_weights.remote(self._weights, self._version))

    @property
    def version(self) -> int:
        """The weights version of the last sync."""
        return self._version

    def update_weights(self, state_dict) -> list[int]:
        """Brings every engine to ``state_dict`` (the next version) and returns the engines' versions once each
        holds it. A state dict sharded over data-parallel workers (FSDP's DTensors) is gathered one tensor at a time
        into host memory first (a collective: every worker syncs its engines at the same step), so no GPU holds a
        second whole copy and a replacement engine can be given the weights without the other workers."""
        self._replace_dead()
        self._version += 1
        if any(isinstance(v, DTensor) for v in state_dict.values()):
            if self._dtypes is None:
                self._dtypes = ray.get(self.workers[0].weight_dtypes.remote())
            state_dict = gathered(state_dict, self._dtypes)
        if self.weight_sync == "cuda_ipc":
            try:
                return self._share(state_dict)
            except ray.exceptions.RayActorError as error:  # a dead engine: replaced below, with these weights
                logger.warning("weight sync by CUDA IPC lost an engine (%s); this sync goes through the object store",
                               error)
        elif self.weight_sync != "object_store":
            try:
                return self._broadcast(state_dict)
            except (RuntimeError, ray.exceptions.RayError) as error:  # a member died mid-sync
                logger.warning("weight broadcast failed (%s); this sync goes through the object store", error)
                self._group = None
                self._replace_dead()  # (one that died after this sync's first question, too)
        if self._dtypes is None:
            self._dtypes = ray.get(self.workers[0].weight_dtypes.remote())
        self._weights = _put(state_dict, self._dtypes)
        futures = [w.update_weights.remote(self._weights, self._version) for w in self.workers]
        versions = []
        for i, future in enumerate(futures):
            try:
                versions.append(ray.get(future))
            except ray.exceptions.RayActorError as error:  # the replacement is given these weights
                self._replace(i, error)
                versions.append(self._version)
        return versions

    def _replace_dead(self) -> None:
        """Replaces the engines that died since the last call, with the weights they last had: a broadcast would
        wait for a dead member until the group's timeout, and the other ways would fail on it."""
        pings = [w.get_stats.remote() for w in self.workers]
        busy = 0.0
        for i, ping in enumerate(pings):
            try:
                busy += ray.get(ping)["busy_s"]
            except ray.exceptions.RayActorError as error:
                self._replace(i, error)
        self.busy_s = busy

    def _share(self, state_dict) -> list[int]:
        from .weight_sync import share

        if self._dtypes is None:
            self._dtypes = ray.get(self.workers[0].weight_dtypes.remote())
        self._weights, self._source = None, state_dict  # (a replacement engine gets them by the object store)
        buckets, shared = share(state_dict, self._dtypes)
        versions = ray.get([w.open_weights.remote(shared, self._version) for w in self.workers])
        del buckets  # every engine has copied them
        return versions

    def _broadcast(self, state_dict) -> list[int]:
        from .weight_sync import Layout, process_group, send

        self._weights, self._source = None, state_dict
        if self._group is None:
            from ..distributed import free_port

            ray.get([w.broadcast_device.remote() for w in self.workers])  # refused at once by an engine without one
            host, port = ray.util.get_node_ip_address(), free_port()
            world = len(self.workers) + 1
            joined = [w.join_weight_sync.remote(host, port, i + 1, world, self.weight_sync)
                      for i, w in enumerate(self.workers)]
            self._group = process_group(host, port, 0, world, self.weight_sync)
            ray.get(joined)
            self._dtype = getattr(torch, ray.get(self.workers[0].get_stats.remote())["dtype"])
        layout = Layout.of(state_dict, self._dtype)
        received = [w.receive_weights.remote(layout, self._version) for w in self.workers]
        on_gpu = self.weight_sync == "nccl"  # NCCL sends from this process's GPU, gloo from the host
        device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        send(self._group, state_dict, layout, device)
        return ray.get(received)

    def get_stats(self) -> list[dict]:
        return ray.get([w.get_stats.remote() for w in self.workers])

    def shutdown(self) -> None:
        for worker in self.workers:
            ray.kill(worker)
        self.workers = []
