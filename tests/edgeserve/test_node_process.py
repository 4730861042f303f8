"""`up`'s node in a process of its own (edgeserve/node_process.py): its spec crosses the
pipe whole, a model that cannot load is the parent's load error, and the node ends when
its parent goes."""

from __future__ import annotations

import asyncio
import dataclasses

from edgeserve.connections import ConnectionLimits
from edgeserve.node_process import NodeProcess, NodeSpec
from edgeserve.servers import bound_port, listen
from scheduler.capacity import LocalCapacityRegistry
from tests.conftest import INTERNAL_TOKEN


def _spec(model: str) -> tuple[NodeSpec, list]:
    sockets = listen("127.0.0.1", 0)
    spec = NodeSpec(
        node_id="test-node", internal_token=INTERNAL_TOKEN,
        engine={"model": model, "kv_dtype": "fp32", "weights": None, "max_model_len": None,
                "kv_memory_mb": None, "device": "cpu"},
        limits=dataclasses.asdict(ConnectionLimits()), port=bound_port(sockets),
        fd=sockets[0].fileno(),
    )  # fmt: skip
    return spec, sockets


def test_the_spec_crosses_the_pipe_whole() -> None:
    spec, sockets = _spec("smollm2")
    try:
        assert NodeSpec.from_json(spec.to_json()) == spec
        assert spec.address == f"http://127.0.0.1:{spec.port}"
    finally:
        sockets[0].close()


async def test_a_model_that_cannot_load_is_the_load_error_and_the_node_ends_with_its_parent(
    tmp_path,
) -> None:
    """The end of its stdin is how the node learns its parent is gone, however it went."""
    spec, sockets = _spec(str(tmp_path / "missing.gguf"))
    node = NodeProcess(spec, LocalCapacityRegistry())
    node.start()
    sockets[0].close()
    proc = node._proc
    assert proc is not None and proc.stdin is not None
    try:
        async with asyncio.timeout(60):
            while node.load_error is None:  # the node serves on, saying why on /health
                await asyncio.sleep(0.05)
        assert "no GGUF file at" in node.load_error
        assert not node.is_ready
        proc.stdin.close()
        assert await asyncio.to_thread(proc.wait, 30) == 0
    finally:
        await node.stop()
