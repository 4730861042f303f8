"""A prompt's KV handoff moved over a collective: from the prefill node's process to the
decode node's through a process group of the two (gloo between CPUs, NCCL between GPUs),
instead of as HTTP bytes through both hosts' memory.

    pair = PairGroup.join(host, port, rank, device)   # rank 0 hosts the rendezvous
    pair.send(handoff)                                # the prefill node's side
    handoff = pair.receive()                          # the decode node's, on its device

A pair has its own store and group (not the process's default group), so a node can hold
one for each peer beside its tensor-parallel group. What crosses: the handoff's header as
the HTTP path's JSON (its length first), then each tensor in the header's order as its raw
bytes; the receiver rebuilds the handoff with `KVHandoff.from_parts`, so it is bit for bit
what `from_bytes(to_bytes())` gives.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from gpu_node.engine.handoff import KVHandoff

MAX_HEADER_BYTES = 1 << 24  # a header announcing more is refused before anything is sized


@dataclass
class PairGroup:
    """Two processes' group for handoffs: rank 0 and rank 1, one device each."""

    rank: int
    device: torch.device
    group: dist.ProcessGroup
    store: dist.Store

    @classmethod
    def join(
        cls,
        host: str,
        port: int,
        rank: int,
        device: torch.device | str = "cpu",
        timeout_s: float = 60.0,
    ) -> PairGroup:
        """Joins the pair whose rank 0 listens on host:port (rank 0 starts the store there);
        blocks until both have joined."""
        if rank not in (0, 1):
            raise ValueError(f"a pair has ranks 0 and 1, got {rank}")
        device = torch.device(device)
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, port, 2, is_master=rank == 0, timeout=timeout)
        if device.type == "cuda":
            group: dist.ProcessGroup = dist.ProcessGroupNCCL(store, rank, 2)
        else:
            group = dist.ProcessGroupGloo(store, rank, 2, timeout)
        return cls(rank, device, group, store)

    @property
    def peer(self) -> int:
        return 1 - self.rank

    def _send(self, t: torch.Tensor) -> None:
        self.group.send([t], self.peer, 0).wait()

    def _recv(self, t: torch.Tensor) -> torch.Tensor:
        self.group.recv([t], self.peer, 0).wait()
        return t

    def send(self, handoff: KVHandoff) -> None:
        head = json.dumps(handoff.header(), separators=(",", ":")).encode()
        self._send(torch.tensor([len(head)], dtype=torch.int64, device=self.device))
        self._send(torch.frombuffer(bytearray(head), dtype=torch.uint8).to(self.device))
        for t in handoff.tensors():
            if t.numel():
                self._send(t.detach().contiguous().reshape(-1).view(torch.uint8).to(self.device))

    def receive(self) -> KVHandoff:
        """The handoff the peer sends, its tensors on this rank's device; ValueError on a
        header that is not one."""
        size = int(self._recv(torch.empty(1, dtype=torch.int64, device=self.device)).item())
        if not 0 < size <= MAX_HEADER_BYTES:
            raise ValueError(f"not a KV handoff: a header of {size} bytes")
        raw = self._recv(torch.empty(size, dtype=torch.uint8, device=self.device))
        try:
            header = json.loads(bytes(raw.cpu().numpy()))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"not a KV handoff: {type(exc).__name__}: {exc}") from None
        tensors = {}
        for name, dtype, shape in KVHandoff.tensor_layout(header):
            count = torch.Size(shape).numel() * dtype.itemsize
            data = torch.empty(count, dtype=torch.uint8, device=self.device)
            if count:
                self._recv(data)
            tensors[name] = data.view(dtype).reshape(shape)
        return KVHandoff.from_parts(header, tensors)

    def close(self) -> None:
        """Drops the group and the store (a pair is not reused once either side closed)."""
        del self.group, self.store
