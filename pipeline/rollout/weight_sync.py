"""Weights from the trainer to the rollout engines over a collective (NCCL between GPUs, gloo on CPU), or by CUDA
IPC to engines on the trainer's own GPU.

The trainer is rank 0 of a process group of its own with the engines (ranks 1..n), built on a TCP store
rather than ``init_process_group``, so it never touches the default group a data-parallel trainer uses. A
sync broadcasts the weights in the engines' dtype, packed into a few flat buckets (one collective per ~256 MB
instead of one per tensor), and each engine copies them into its parameters: no trip through Ray's object
store or the disk. NCCL needs each rank on its own GPU; engines that share the trainer's GPU take the weights
through the object store (a copy to the host and back) or, with :func:`share`, straight from the trainer's memory:
the trainer packs them into flat buckets on its GPU and sends CUDA IPC handles, which each engine opens and copies
from on the device (``pipeline.rollout.actor.EngineFleet``).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

BUCKET_BYTES = 256 * 2**20


@dataclass(frozen=True)
class Layout:
    """What one sync sends: per bucket, the ``(name, shape)`` of its tensors, all in ``dtype``."""

    buckets: tuple[tuple[tuple[str, tuple[int, ...]], ...], ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, state_dict: dict[str, torch.Tensor], dtype: torch.dtype, bucket_bytes: int = BUCKET_BYTES) -> "Layout":
        buckets, current, size = [], [], 0
        itemsize = torch.empty((), dtype=dtype).element_size()
        for name, tensor in state_dict.items():
            if current and size + tensor.numel() * itemsize > bucket_bytes:
                buckets.append(tuple(current))
                current, size = [], 0
            current.append((name, tuple(tensor.shape)))
            size += tensor.numel() * itemsize
        if current:
            buckets.append(tuple(current))
        return cls(tuple(buckets), dtype)


def process_group(host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float = 600.0):
    """Joins the sync group (rank 0 hosts its store and must be at ``host``)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    raise ValueError(f"weight sync backend must be 'nccl' or 'gloo', got {backend!r}")


def _broadcast(group, tensor: torch.Tensor) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


def send(group, state_dict: dict[str, torch.Tensor], layout: Layout, device: torch.device) -> None:
    """Rank 0: broadcasts ``state_dict`` bucket by bucket, cast to the layout's dtype, from ``device``."""
    for bucket in layout.buckets:
        _broadcast(group, _packed(state_dict, bucket, layout.dtype, device))


def receive(group, layout: Layout, device: torch.device):
    """Ranks >= 1: yields ``(name, tensor)`` of every weight as its bucket arrives (views of the bucket)."""
    for bucket in layout.buckets:
        flat = torch.empty(sum(torch.Size(shape).numel() for _, shape in bucket), dtype=layout.dtype, device=device)
        _broadcast(group, flat)
        yield from _unpacked(bucket, flat)


def _packed(state_dict: dict[str, torch.Tensor], bucket, dtype: torch.dtype, device=None) -> torch.Tensor:
    """One bucket's weights, cast to ``dtype`` (on ``device``: theirs if None), in one flat tensor."""
    with torch.no_grad():
        return torch.cat([state_dict[name].detach().to(device=device, dtype=dtype).reshape(-1) for name, _ in bucket])


def _unpacked(bucket, flat: torch.Tensor):
    """``(name, tensor)`` of a bucket's weights: views of ``flat``."""
    numels = [torch.Size(shape).numel() for _, shape in bucket]
    for (name, shape), part in zip(bucket, flat.split(numels)):
        yield name, part.view(shape)


def share(state_dict: dict[str, torch.Tensor], dtypes: dict[str, torch.dtype]) -> tuple[list[torch.Tensor], list]:
    """CUDA IPC: the weights cast to the dtypes the engines keep them in (``dtypes``; the weight's own otherwise),
    packed into flat buckets on the trainer's GPU (the current one). Returns the buckets, which the trainer keeps
    until every engine has copied them, and what an engine opens them with (:func:`opened`): per bucket its
    ``(name, shape)`` list and IPC handle (``torch.multiprocessing``'s reduction of a CUDA tensor, picklable), and the
    GPU's UUID: a process that sees another set of GPUs numbers the same GPU otherwise."""
    from torch.multiprocessing.reductions import reduce_tensor

    if not torch.cuda.is_available():
        raise RuntimeError("weight_sync cuda_ipc needs the trainer on a GPU (engines open its GPU memory); this "
                           "process has none: use object_store")
    device = torch.device("cuda", torch.cuda.current_device())
    by_dtype: dict[torch.dtype, dict[str, torch.Tensor]] = {}
    for name, tensor in state_dict.items():
        by_dtype.setdefault(dtypes.get(name, tensor.dtype), {})[name] = tensor
    buckets, shared = [], []
    for dtype, part in by_dtype.items():
        for bucket in Layout.of(part, dtype).buckets:
            flat = _packed(part, bucket, dtype, device)
            buckets.append(flat)
            shared.append((bucket, reduce_tensor(flat)))
    torch.cuda.current_stream().synchronize()  # the buckets are written before any engine reads them
    return buckets, {"gpu": str(torch.cuda.get_device_properties(device).uuid), "buckets": shared}


def local_index(uuid: str) -> int:
    """This process's index of the GPU with ``uuid`` (its ``CUDA_VISIBLE_DEVICES`` may list other GPUs, in another
    order, than the process that named it)."""
    found = [i for i in range(torch.cuda.device_count()) if str(torch.cuda.get_device_properties(i).uuid) == uuid]
    if not found:
        raise RuntimeError(f"CUDA IPC: the trainer's GPU {uuid} is not visible to this engine (it sees "
                           f"{torch.cuda.device_count()} GPUs): the engine is not on its trainer's GPU")
    return found[0]


STORAGE_DEVICE = 6  # the device index among the arguments of torch's rebuild_cuda_tensor


def opened(shared: dict):
    """An engine's side of :func:`share`: yields ``(name, tensor)``, views of the trainer's buckets, opened on this
    process's index of the trainer's GPU."""
    index = local_index(shared["gpu"])
    for bucket, (rebuild, args) in shared["buckets"]:
        args = (*args[:STORAGE_DEVICE], index, *args[STORAGE_DEVICE + 1:])
        yield from _unpacked(bucket, rebuild(*args))
