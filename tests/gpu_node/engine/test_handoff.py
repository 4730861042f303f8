"""Prefill/decode disaggregation in the engine: a prompt prefilled on one engine and
decoded on another gives exactly one engine's tokens (real SmolLM2 weights; on a GPU,
seeded weights, since the GGUF does not reach the GPU machine)."""

from __future__ import annotations

import copy
import dataclasses
import struct

import pytest
import torch

from gpu_node.engine.handoff import KVHandoff
from gpu_node.errors import InvalidRequestError
from scheduler.sequence import SamplingParams
from tests.gpu_node.helpers import (
    default_seeded_engine,
    needs_cuda,
    run_capturing_logits,
    run_to_end,
    seeded_model,
)

QUESTION = "Name three colours and say which one you like best."


def prefill(engine, ids, params, request_id="r"):
    """Runs `ids` prefill-only; the handoff, through its wire format."""
    engine.add_request(request_id, ids, params, prefill_only=True)
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    (out,) = outs
    assert out.finished and out.finish_reason == "handoff" and out.num_completion_tokens == 1
    assert out.handoff is not None and out.token_ids == (out.handoff.first_token,)
    return KVHandoff.from_bytes(out.handoff.to_bytes())


def decode(engine, ids, params, handoff, request_id="r"):
    return run_to_end(engine, request_id, ids, params, handoff=handoff)


@pytest.mark.parametrize(
    "kv_dtype, params",
    [
        ("fp32", SamplingParams(max_tokens=16, ignore_eos=True)),
        ("fp8", SamplingParams(max_tokens=16, ignore_eos=True)),
        ("fp8", SamplingParams(max_tokens=16, temperature=0.9, top_k=40, seed=7, ignore_eos=True)),
        ("fp32", SamplingParams(max_tokens=1)),  # ends at the first token, on the decode node too
    ],
)
def test_prefilled_on_one_engine_decoded_on_another_equals_one_engine(
    make_engine, chat_ids, kv_dtype, params
) -> None:
    ids = chat_ids(QUESTION)
    alone = make_engine(kv_dtype=kv_dtype).generate({"r": ids}, params)["r"]
    prefiller, decoder = make_engine(kv_dtype=kv_dtype), make_engine(kv_dtype=kv_dtype)
    handoff = prefill(prefiller, ids, params)
    stats = prefiller.stats()
    assert stats.num_free_pages == stats.num_pages  # its pages went back at the handoff
    assert handoff.first_token == alone[0]
    assert handoff.k.shape == (30, len(ids), 3, 64)
    assert (handoff.k.dtype, handoff.k_scale is None) == (
        (torch.uint8, False) if kv_dtype == "fp8" else (torch.float32, True)
    )
    tokens, final = decode(decoder, ids, params, handoff)
    assert tokens == alone
    assert (final.num_prompt_tokens, final.num_completion_tokens) == (len(ids), len(alone))
    assert final.finish_reason == "length"
    assert decoder.stats().num_free_pages == decoder.stats().num_pages


def test_a_handed_off_request_keeps_its_first_tokens_logprob(make_engine, chat_ids):
    ids = chat_ids("Name a colour.")
    params = SamplingParams(max_tokens=6, logprobs=True, top_logprobs=2)
    engine = make_engine()
    alone, _, _ = run_capturing_logits(engine, ids, params)
    engine.add_request("p", ids, params, prefill_only=True)
    (out,) = [o for _ in range(4) for o in engine.step()]
    assert out.logprobs == (alone[0],)
    handoff = KVHandoff.from_bytes(out.handoff.to_bytes())
    assert handoff.first_logprob == alone[0]
    engine.add_request("d", ids, params, handoff=handoff)
    got = []
    while engine.has_unfinished():
        for o in engine.step():
            got += list(o.logprobs or ())
    assert got == alone


def test_a_decode_engine_refuses_a_handoff_it_cannot_continue(make_engine, chat_ids) -> None:
    ids = chat_ids(QUESTION)
    greedy = SamplingParams(max_tokens=4)
    handoff = prefill(make_engine(kv_dtype="fp32"), ids, greedy)
    fp8 = make_engine(kv_dtype="fp8")
    with pytest.raises(InvalidRequestError) as refused:
        fp8.add_request("a", ids, greedy, handoff=handoff)
    assert str(refused.value) == (
        "KV handoff refused: the handoff's KV is KVSpec(kv_dtype='fp32', num_layers=30, "
        "num_kv_heads=3, head_dim=64, activations='fp32'), this node's KVSpec(kv_dtype='fp8', "
        "num_layers=30, num_kv_heads=3, head_dim=64, activations='fp32')"
    )
    same = make_engine(kv_dtype="fp32")
    with pytest.raises(InvalidRequestError, match="prefilled for another prompt"):
        same.add_request("b", ids[:-1], greedy, handoff=handoff)
    with pytest.raises(InvalidRequestError, match="carries its generator's state"):
        same.add_request("c", ids, SamplingParams(max_tokens=4, temperature=0.5), handoff=handoff)
    with pytest.raises(InvalidRequestError, match="cannot both be prefilled here and arrive"):
        same.add_request("d", ids, greedy, prefill_only=True, handoff=handoff)
    garbled = dataclasses.replace(handoff, generator_state=b"not a generator")
    with pytest.raises(InvalidRequestError, match="not one this node can load"):
        same.add_request("e", ids, SamplingParams(max_tokens=4, temperature=0.5), handoff=garbled)
    assert not same.has_unfinished() and not fp8.has_unfinished()


def test_the_wire_format_refuses_what_it_did_not_write(make_engine, chat_ids) -> None:
    data = prefill(make_engine(kv_dtype="fp8"), chat_ids("Hi"), SamplingParams(max_tokens=2))
    raw = data.to_bytes()
    again = KVHandoff.from_bytes(raw)
    assert torch.equal(again.k, data.k) and torch.equal(again.v_scale, data.v_scale)
    with pytest.raises(ValueError, match="tensor 'v_scale' is cut short"):
        KVHandoff.from_bytes(raw[:-1])
    with pytest.raises(ValueError, match="1 bytes past the last tensor"):
        KVHandoff.from_bytes(raw + b"\0")
    with pytest.raises(ValueError, match="not a KV handoff"):
        KVHandoff.from_bytes(b"\x05\x00\x00\x00hello")
    (size,) = struct.unpack_from("<I", raw)
    assert (4 + size) % 8 == 0  # the rows start aligned for any dtype


def test_a_handoff_computed_in_another_dtype_is_refused(make_engine, smollm2_parts, chat_ids):
    """Rows prefilled in fp32 would decode in bf16 to other tokens than one node's: the
    same pool layout is not enough."""
    from gpu_node.config import EngineConfig
    from gpu_node.engine.llm_engine import LLMEngine

    model, tokenizer = smollm2_parts
    ids = chat_ids(QUESTION)
    greedy = SamplingParams(max_tokens=4)
    handoff = prefill(make_engine(kv_dtype="fp32"), ids, greedy)
    bf16 = LLMEngine(
        EngineConfig(model="smollm2", weights="bf16", kv_dtype="fp32", num_pages=128),
        copy.deepcopy(model).to(torch.bfloat16), tokenizer,
    )  # fmt: skip
    with pytest.raises(InvalidRequestError) as refused:
        bf16.add_request("a", ids, greedy, handoff=handoff)
    assert str(refused.value) == (
        "KV handoff refused: the handoff's KV is KVSpec(kv_dtype='fp32', num_layers=30, "
        "num_kv_heads=3, head_dim=64, activations='fp32'), this node's KVSpec(kv_dtype='fp32', "
        "num_layers=30, num_kv_heads=3, head_dim=64, activations='bf16')"
    )
    assert bf16.stats().num_free_pages == bf16.stats().num_pages  # nothing was taken


def test_a_handoff_of_another_version_is_refused_by_name() -> None:
    import json

    head = json.dumps({"version": 1}).encode()
    with pytest.raises(ValueError, match="handoff version 1, this node reads 3"):
        KVHandoff.from_bytes(struct.pack("<I", len(head)) + head)


@needs_cuda
@pytest.mark.parametrize("kv_dtype", ["fp8", "bf16"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_prefilled_on_one_gpu_engine_decoded_on_another_equals_one_engine(kv_dtype, temperature):
    """On a GPU: pools read and written by the Triton kernels."""
    model = seeded_model("bf16", fuse=False)
    ids = [(7 * j) % 4000 + 1 for j in range(45)]  # three pages of 16 and a part
    params = SamplingParams(max_tokens=20, temperature=temperature, seed=3, ignore_eos=True)
    alone, _ = run_to_end(default_seeded_engine(model, kv_dtype), "r", ids, params)
    handoff = prefill(default_seeded_engine(model, kv_dtype), ids, params)
    assert handoff.k.device.type == "cpu" and handoff.k.shape == (4, 45, 2, 64)
    decoder = default_seeded_engine(model, kv_dtype)
    tokens, _ = decode(decoder, ids, params, handoff)
    assert tokens == alone and len(tokens) == 20
    assert decoder.stats().num_free_pages == decoder.stats().num_pages
