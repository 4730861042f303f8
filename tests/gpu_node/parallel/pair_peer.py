"""The decode node's side of test_kv_transfer, in a module of few imports: what a spawned
process imports before it runs."""

from __future__ import annotations

import traceback
from typing import Any

from gpu_node.parallel.kv_transfer import PairGroup


def receive(port: int, num_handoffs: int, results: Any) -> None:
    """Each handoff received, as the HTTP path's bytes; then what a garbled header raises."""
    try:
        pair = PairGroup.join("127.0.0.1", port, rank=1, timeout_s=60)
        for _ in range(num_handoffs):
            results.put(pair.receive().to_bytes())
        try:
            pair.receive()
        except ValueError as exc:
            results.put(str(exc))
        pair.close()
    except BaseException:
        results.put(traceback.format_exc())
        raise
