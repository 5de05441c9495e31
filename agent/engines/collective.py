"""Collective weight sync: a private process group from trainer rank 0 to generation-server workers.

The group is built from a ``TCPStore`` hosted by the trainer (rank 0) with the c10d
constructors (``ProcessGroupGloo`` / ``ProcessGroupNCCL``), *not* ``init_process_group``:
it is invisible to ``torch.distributed``'s default group, so it cannot collide with the
trainer's own FSDP group nor with vLLM's internal one. Each server worker (one per vLLM
tensor-parallel rank, or the transformers server itself) is one more rank.

One sync: the trainer sends the bucket plan (``wire.plan_buckets``) to every server over
HTTP; each receiving rank validates it, allocates the buffers, writes ``<sync_id>/ready/<rank>``
into the store and enters the broadcasts. The trainer broadcasts only after every rank is
ready (an HTTP 4xx arrives before that and aborts the sync with nothing sent). Receivers load
nothing until the last bucket is in, so a broken sync leaves the old weights. After a failure
both sides drop the group; the next sync builds a new one under a new store prefix.
"""

from __future__ import annotations

import datetime
import socket
import time
from typing import Any

import torch
import torch.distributed as dist

from agent.engines.wire import DTYPES, check_weights


def _local_address(master_host: str, master_port: int) -> str:
    """This host's address on the route to the master (what other ranks can reach us at)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((socket.gethostbyname(master_host), master_port))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def make_group(store: dist.Store, rank: int, world_size: int, backend: str, master_host: str, master_port: int, timeout_s: float):
    """A stand-alone process group (gloo over TCP, or NCCL) on ``store``; blocks until every rank joined."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=_local_address(master_host, master_port))]
        opts._timeout = timeout
        return dist.ProcessGroupGloo(store, rank, world_size, opts)
    if backend == "nccl":
        if not hasattr(dist, "ProcessGroupNCCL") or not torch.cuda.is_available():
            raise RuntimeError("the nccl weight-sync backend needs a CUDA build of torch and a GPU")
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, opts)
    raise ValueError(f"unknown weight-sync backend {backend!r}; choose gloo or nccl")


def _broadcast(pg, buf: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    pg.broadcast([buf], opts).wait()


def ready_key(sync_id: str, rank: int) -> str:
    return f"{sync_id}/ready/{rank}"


def joining_key(rank: int) -> str:
    return f"joining/{rank}"


def send_buckets(pg, state_dict: dict[str, torch.Tensor], meta: list[dict[str, Any]], device: torch.device) -> None:
    """Rank 0: one broadcast of a flat buffer per bucket."""
    for bucket in meta:
        parts = [state_dict[name].detach().reshape(-1) for name, _ in bucket["tensors"]]
        buf = torch.cat(parts).to(device=device, dtype=DTYPES[bucket["dtype"]]).contiguous()
        _broadcast(pg, buf)


def receive_buckets(pg, store: dist.Store, meta: list[dict[str, Any]], sync_id: str, rank: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Ranks > 0: signal readiness, receive every bucket, return the named tensors (views of the buffers)."""
    bufs = []
    for bucket in meta:
        numel = sum(_numel(shape) for _, shape in bucket["tensors"])
        bufs.append(torch.empty(numel, dtype=DTYPES[bucket["dtype"]], device=device))
    store.set(ready_key(sync_id, rank), b"1")
    out: dict[str, torch.Tensor] = {}
    for bucket, buf in zip(meta, bufs):
        _broadcast(pg, buf)
        pos = 0
        for name, shape in bucket["tensors"]:
            n = _numel(shape)
            out[name] = buf[pos : pos + n].view(shape)
            pos += n
    return out


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class CollectiveSender:
    """Trainer side (rank 0): hosts the store, joins groups, broadcasts buckets.

    ``host`` must be reachable from the servers; ``port=0`` picks a free one.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, backend: str = "gloo", timeout_s: float = 600.0) -> None:
        self.host = host
        self.backend = backend
        self.timeout_s = timeout_s
        # The master listens on every interface; ``host`` is what the servers are told to dial.
        self.store = dist.TCPStore(host, port, None, True, datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
        self.port = self.store.port
        self.pg = None
        self.group: str | None = None
        self.world_size = 0
        self._generation = 0

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

    def new_group_name(self) -> str:
        self._generation += 1
        return f"emapg-sync-{self._generation}-{time.time_ns()}"

    def join(self, group: str, world_size: int, alive) -> None:
        """Create rank 0 of ``group`` once every server rank is joining (``alive()`` raises if one refused)."""
        store = dist.PrefixStore(group, self.store)
        self._wait(store, [joining_key(r) for r in range(1, world_size)], alive, f"group {group}: servers did not join")
        self.pg = make_group(store, 0, world_size, self.backend, self.host, self.port, self.timeout_s)
        self.group, self.world_size = group, world_size

    def wait_ready(self, sync_id: str, alive) -> None:
        """Wait until every receiving rank allocated its buffers; ``alive()`` raises if a server gave up."""
        keys = [ready_key(sync_id, r) for r in range(1, self.world_size)]
        self._wait(dist.PrefixStore(self.group, self.store), keys, alive, f"weight sync {sync_id}: servers not ready")

    def _wait(self, store, keys: list[str], alive, what: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not store.check(keys):
            alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} after {self.timeout_s:.0f} s")
            time.sleep(0.01)

    def send(self, state_dict: dict[str, torch.Tensor], meta: list[dict[str, Any]]) -> None:
        send_buckets(self.pg, state_dict, meta, self.device)

    def drop_group(self) -> None:
        self.pg, self.group, self.world_size = None, None, 0

    def close(self) -> None:
        self.drop_group()
        self.store = None


class CollectiveReceiver:
    """Server side, for one rank: joins the trainer's group and receives whole syncs.

    Used by the transformers server directly and by the vLLM worker extension (one per worker).
    """

    def __init__(self) -> None:
        self.pg = None
        self.store = None
        self.rank = -1

    def join(self, host: str, port: int, world_size: int, rank: int, backend: str, group: str, timeout_s: float) -> None:
        self.close()
        base = dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=timeout_s))
        self.store = dist.PrefixStore(group, base)
        self.store.set(joining_key(rank), b"1")  # the trainer builds its rank only when all are coming
        self.pg = make_group(self.store, rank, world_size, backend, host, port, timeout_s)
        self.rank = rank

    def receive(self, meta: list[dict[str, Any]], sync_id: str, device: torch.device) -> dict[str, torch.Tensor]:
        if self.pg is None:
            raise RuntimeError("no weight-sync group: the trainer must call /weights/collective/init first")
        try:
            weights = receive_buckets(self.pg, self.store, meta, sync_id, self.rank, device)
        except Exception:
            self.close()  # a broken group cannot be reused; the trainer builds a new one
            raise
        check_weights(weights)  # NaN/inf refused before anything is loaded (the group stays usable)
        return weights

    def close(self) -> None:
        self.pg, self.store, self.rank = None, None, -1
