"""The CPU decode kernels (gpu_node/kernels/cpu): each against its torch arithmetic, and a
whole decode step in one call against the same model's per-operation path."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gpu_node.kernels import cpu as ck
from gpu_node.kernels.kv_write.reference import kv_write_ref
from gpu_node.kernels.paged_attention.reference import paged_decode_attention_ref
from gpu_node.models.llama import RMSNorm, RotaryEmbedding
from gpu_node.quant.int4 import quantize_int4, unpack_int4

pytestmark = pytest.mark.skipif(not ck.available(), reason="no C compiler to build the kernels")


def dequantized_rows(x: torch.Tensor) -> torch.Tensor:
    q, d, qd = ck.quantize_rows(x)
    assert torch.allclose(qd, d * q.float().view(*d.shape, 32).sum(-1))
    return (q.float().view(*d.shape, 32) * d[..., None]).view(x.shape)


def test_activations_are_int16_codes_of_each_blocks_absolute_max():
    x = torch.tensor([[*range(-16, 16), *[0.0] * 31, 254.0]])
    q, d, _ = ck.quantize_rows(x)
    assert torch.equal(d, torch.tensor([[16.0, 254.0]]) / 32767)
    expected = torch.round(x[0, :32] * (32767 / torch.tensor(16.0))).to(torch.int16)
    assert torch.equal(q[0, :32], expected)
    assert q[0, 32:].tolist() == [0] * 31 + [32767]


@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("group_size", [32, 128])
def test_int4_gemv_is_the_dot_of_dequantized_weights_and_activations(rows, group_size):
    torch.manual_seed(rows)
    n, k = 200, 256
    w = quantize_int4(torch.randn(n, k), group_size)
    codes = unpack_int4(w.packed).float().view(n, k // group_size, group_size)
    weight = (codes * w.scales.float()[..., None] + w.mins.float()[..., None]).view(n, k)
    x = torch.randn(rows, k)
    y = ck.int4_matmul(x, w.packed, w.scales, w.mins, group_size)
    torch.testing.assert_close(y, dequantized_rows(x) @ weight.t(), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 5])
def test_q8_gemv_is_the_dot_of_dequantized_weights_and_activations(rows):
    torch.manual_seed(rows)
    n, k = 300, 192
    codes = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    scales = (torch.rand(n, k // 32) / 50).half()
    weight = (codes.float().view(n, -1, 32) * scales.float()[..., None]).view(n, k)
    x = torch.randn(rows, k)
    y = ck.q8_matmul(x, codes, scales)
    torch.testing.assert_close(y, dequantized_rows(x) @ weight.t(), rtol=1e-5, atol=1e-4)


def test_a_rows_product_is_the_same_alone_or_in_a_batch():
    torch.manual_seed(5)
    w = quantize_int4(torch.randn(96, 128), 32)
    codes = torch.randint(-127, 128, (96, 128), dtype=torch.int8)
    scales = (torch.rand(96, 4) / 50).half()
    x = torch.randn(7, 128)
    batched = ck.int4_matmul(x, w.packed, w.scales, w.mins, 32)
    head = ck.q8_matmul(x, codes, scales)
    for i in range(7):
        assert torch.equal(
            ck.int4_matmul(x[i : i + 1], w.packed, w.scales, w.mins, 32), batched[i : i + 1]
        )
        assert torch.equal(ck.q8_matmul(x[i : i + 1], codes, scales), head[i : i + 1])


def test_gemvs_refuse_more_rows_than_they_take():
    w = quantize_int4(torch.randn(8, 32), 32)
    with pytest.raises(ValueError, match="at most 64"):
        ck.int4_matmul(torch.randn(65, 32), w.packed, w.scales, w.mins, 32)


def paged_case():
    torch.manual_seed(0)
    pages, page_size, kv_heads, dim = 12, 16, 2, 16
    k_cache, v_cache = torch.randn(2, pages, page_size, kv_heads, dim).unbind(0)
    tables = torch.tensor([[3, 5, 7, 0], [1, 2, 4, 6], [8, 9, 10, 11]], dtype=torch.int32)
    lens = torch.tensor([40, 17, 64], dtype=torch.int32)
    owner = torch.tensor([0, 1, 1, 0, 1, 0, 1, 0, 2, 2, 2, 2])
    tags = torch.tensor([0, 1, 2])
    return k_cache, v_cache, tables, lens, owner, tags


def test_paged_decode_reads_pages_in_place_as_the_reference_does():
    k_cache, v_cache, tables, lens, owner, tags = paged_case()
    q = torch.randn(3, 6, 16)
    out, foreign = ck.paged_decode_attention(q, k_cache, v_cache, tables, lens, owner, tags, 0.25)
    ref, ref_foreign = paged_decode_attention_ref(
        q, k_cache, v_cache, tables, lens, owner, tags, 0.25
    )
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    assert foreign.tolist() == ref_foreign.int().tolist() == [0, 0, 0]


def test_paged_decode_flags_a_foreign_page_and_attends_nothing_of_that_sequence():
    k_cache, v_cache, tables, lens, owner, tags = paged_case()
    owner[2] = 0  # sequence 1's second page now belongs to tag 0
    q = torch.randn(3, 6, 16)
    out, foreign = ck.paged_decode_attention(q, k_cache, v_cache, tables, lens, owner, tags, 0.25)
    assert foreign.tolist() == [0, 1, 0]
    assert out[1].abs().max().item() == 0.0
    unchecked, none = ck.paged_decode_attention(
        q, k_cache, v_cache, tables, lens, owner, tags, 0.25, check_owner=False
    )
    assert none.tolist() == [0, 0, 0] and unchecked[1].abs().max().item() > 0


def test_kv_write_stores_rows_and_refuses_foreign_slots_as_the_reference_does():
    k_cache, v_cache, *_ = paged_case()
    owner = torch.tensor([0, 1, 1, 0, 1, 0, 1, 0, 2, 2, 2, 2])
    slots = torch.tensor([19, 32, -1, 82, 143, 192])  # 82: page 5 is tag 0's; 192: past the pool
    tags = torch.tensor([1, 1, 1, 1, 2, 2])
    k, v = torch.randn(2, 6, 2, 16).unbind(0)
    mine = (k_cache.clone(), v_cache.clone())
    theirs = (k_cache.clone(), v_cache.clone())
    refused = ck.kv_write(k, v, *mine, slots, owner, tags)
    ref = kv_write_ref(k, v, *theirs, slots, owner, tags)
    assert refused.tolist() == ref.tolist() == [False, False, False, True, False, True]
    assert torch.equal(mine[0], theirs[0]) and torch.equal(mine[1], theirs[1])


def test_norms_rope_and_activation_match_the_models_torch_code():
    torch.manual_seed(1)
    norm = RMSNorm(64, 1e-5)
    norm.weight.data = torch.randn(64)
    x, residual = torch.randn(2, 5, 64).unbind(0)
    # torch's mean sums in an order of its own (its vector width, the data's alignment)
    torch.testing.assert_close(ck.rms_norm(x, norm.weight, 1e-5), norm(x), rtol=0, atol=1e-6)
    normed, summed = ck.add_rms_norm(x, residual, norm.weight, 1e-5)
    torch.testing.assert_close(normed, norm(x + residual), rtol=0, atol=1e-6)
    assert torch.equal(summed, x + residual)
    gate, up = torch.randn(2, 3, 40).unbind(0)
    torch.testing.assert_close(ck.silu_mul(gate, up), torch.nn.functional.silu(gate) * up)
    for interleaved in (False, True):
        rope = RotaryEmbedding(16, 10000.0, interleaved)
        positions = torch.tensor([0, 3, 9])
        heads = torch.randn(3, 4, 16)
        cos, sin = rope.angles(positions)
        assert torch.equal(ck.rope_(heads.clone(), cos, sin, interleaved), rope(heads, positions))


def test_kernels_take_fp32_on_the_cpu_only():
    with pytest.raises(ValueError, match="fp32"):
        ck.rms_norm(torch.randn(2, 8, dtype=torch.bfloat16), torch.ones(8), 1e-5)


def test_use_kernels_only_inside_active():
    x = torch.randn(2, 8)
    assert not ck.use_kernels(x)
    with ck.active():
        assert ck.use_kernels(x) and not ck.use_kernels(x.bfloat16())
        with ck.active(False):
            assert not ck.use_kernels(x)
    assert not ck.use_kernels(x)


def test_the_library_is_built_once_per_source_and_machine_in_the_home(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGESERVE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user-cache"))  # nothing installed
    path = ck.build()
    assert path.parent == tmp_path / "home" / "cpu-kernels" and path.exists()
    stamp = path.stat().st_mtime_ns
    assert ck.build() == path and path.stat().st_mtime_ns == stamp


def test_a_home_elsewhere_uses_the_build_install_left_in_the_user_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user-cache"))
    monkeypatch.delenv("EDGESERVE_HOME", raising=False)
    installed = ck.build()
    assert installed.is_relative_to(tmp_path / "user-cache")
    monkeypatch.setenv("EDGESERVE_HOME", str(tmp_path / "home"))
    assert ck.build() == installed and not (tmp_path / "home").exists()


def test_without_a_compiler_there_is_no_library_and_a_clear_reason(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGESERVE_HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user-cache"))
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    with pytest.raises(RuntimeError, match="no C compiler"):
        ck.build()


def seeded_cpu_engine(whole_step: bool, **overrides):
    """A 3-layer seeded llama, INT4 g32, readied for the kernels; fp32 pages on the CPU.
    `whole_step` False: the per-operation kernels alone (no LlamaDecodePlan)."""
    from gpu_node.config import EngineConfig
    from gpu_node.engine.llm_engine import LLMEngine
    from gpu_node.models.config import ModelConfig
    from gpu_node.models.weights import seeded_llama, use_cpu_kernels
    from gpu_node.quant.linear import quantize_model
    from tests.gpu_node.helpers import StubTokenizer

    shape = ModelConfig(
        architecture="llama", num_layers=3, hidden_size=128, intermediate_size=256,
        num_heads=4, num_kv_heads=2, head_dim=32, vocab_size=512,
        max_position_embeddings=1024, rope_theta=10000.0, rms_norm_eps=1e-5,
    )  # fmt: skip
    model = quantize_model(seeded_llama(shape, seed=2), 32, skip=("lm_head", "embed_tokens"))
    use_cpu_kernels(model)
    if not whole_step:
        model._c_plan = False
    config = EngineConfig(
        **{"model": "seeded", "device": "cpu", "kv_dtype": "fp32", "num_pages": 48, **overrides}
    )
    return LLMEngine(config, model, StubTokenizer())


def decode_logits(engine, prompts):
    """Greedy runs of `prompts` together; each step's logits rows (the sampler's input)."""
    from scheduler.sequence import SamplingParams

    seen: list[torch.Tensor] = []
    sample = engine._mask

    def capture(chunks, logits):
        sample(chunks, logits)
        seen.append(logits.clone())

    engine._mask = capture
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, SamplingParams(max_tokens=8 + 4 * i, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    return seen


def test_a_decode_step_in_one_call_equals_the_per_operation_kernels_bit_for_bit():
    prompts = [[(11 * i + 5 * j) % 500 + 1 for j in range(7 + 13 * i)] for i in range(4)]
    engine = seeded_cpu_engine(True)
    whole = decode_logits(engine, prompts)
    assert isinstance(engine.model._c_plan, ck.LlamaDecodePlan)
    per_op = decode_logits(seeded_cpu_engine(False), prompts)
    assert len(whole) == len(per_op) == 20  # one prefill step, then 19 decode steps
    for a, b in zip(whole, per_op, strict=True):
        assert torch.equal(a, b)


def test_the_decode_plan_covers_llama_layers_and_declines_the_rest():
    from gpu_node.models.llama import c_decode_plan
    from gpu_node.models.weights import seeded_llama

    engine = seeded_cpu_engine(True)
    plan = c_decode_plan(engine.model)
    assert plan is not None and plan.dims["F"] == 256
    shape = dataclasses.replace(engine.model.config, qk_norm=True)
    assert c_decode_plan(seeded_llama(shape)) is None  # fp32 linears, q/k norms


def logits_by_request(engine):
    """Every logits row the sampler sees, by request, as the engine runs."""
    rows: dict[str, list[torch.Tensor]] = {}
    sample = engine._mask

    def capture(chunks, logits):
        sample(chunks, logits)
        sampled = [c for c in chunks if c.completes_sequence]
        for chunk, row in zip(sampled, logits, strict=True):
            rows.setdefault(chunk.seq.request_id, []).append(row.clone())

    engine._mask = capture
    return rows


def test_a_requests_logits_do_not_depend_on_what_runs_beside_it():
    """Decode steps, mixed steps (decode rows beside a prompt) and steps of one request
    run every decode row and every projection through the same C code: a request's logits
    are the same bits alone and among others joining mid-run. (A prompt split into other
    chunks attends in other shapes: not compared here.)"""
    from scheduler.sequence import SamplingParams

    prompts = [[(11 * i + 5 * j) % 500 + 1 for j in range(9 + 17 * i)] for i in range(4)]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    engine = seeded_cpu_engine(True)
    alone = logits_by_request(engine)
    for i, ids in enumerate(prompts):
        engine.generate({str(i): ids}, params)
    engine = seeded_cpu_engine(True)
    together = logits_by_request(engine)
    for step in range(200):
        if step % 2 == 0 and step // 2 < len(prompts):
            engine.add_request(str(step // 2), prompts[step // 2], params)
        engine.step()
        if step > 2 * len(prompts) and not engine.has_unfinished():
            break
    assert sorted(together) == sorted(alone) == ["0", "1", "2", "3"]
    for request, rows in alone.items():
        assert len(together[request]) == len(rows) == 10
        for a, b in zip(rows, together[request], strict=True):
            assert torch.equal(a, b)
