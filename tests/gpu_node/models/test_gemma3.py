"""Gemma 3 270M served from its GGUF (Q4_K_M: Q4_K, Q5_0, Q6_K, Q8_0 and F32 tensors) against
transformers reading the same file: its config, prompt logits, greedy tokens and tokenizer."""

from __future__ import annotations

import pytest
import torch

from gpu_node.config import EngineConfig
from gpu_node.engine.attention import PagedAttention
from gpu_node.engine.llm_engine import LLMEngine
from gpu_node.models.families import gemma3
from gpu_node.models.gemma3 import Gemma3Model
from gpu_node.models.gguf_loader import GGUFModel
from gpu_node.models.tokenizer import ChatTokenizer
from gpu_node.models.weights import load_llama
from gpu_node.quant.linear import Int4Linear
from scheduler.scheduler import ScheduledChunk
from scheduler.sequence import SamplingParams, Sequence

pytestmark = pytest.mark.slow

# Past the sliding window (512 tokens), so the sliding layers leave the first tokens out.
LONG_TEXT = " ".join(
    f"Box {i} is {('red', 'green', 'blue', 'amber')[i % 4]} and holds {i * 7} marbles."
    for i in range(40)
)
TEXTS = (
    "Hello, world!",
    "  leading spaces, and trailing  ",
    "code:\n\tdef f(x):\n        return x**2  # square\n\n\n\nend",
    "Ünïcödé — “quotes”, 日本語のテキスト, emoji 🤖🚀, Straße naïve café",
    "numbers 1234567890 3.14159 -42 1e-6 http://example.com/a?q=1&b=2",
    "<start_of_turn>user\nspelled markers<end_of_turn> <bos> <table> <unused7>",
    "\u00a0no-break and \u200bzero-width spaces",
)
CHAT = [
    {"role": "system", "content": "You answer in one word."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris"},
    {"role": "user", "content": "And of Italy?  "},
]


@pytest.fixture(scope="module")
def gguf(gemma3_path):
    return GGUFModel(gemma3_path)


@pytest.fixture(scope="module")
def tokenizer(gguf):
    return ChatTokenizer(gguf)


@pytest.fixture(scope="module")
def model(gguf):
    return load_llama(gguf)


@pytest.fixture(scope="module")
def hf_model(gemma3_path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        gemma3_path.parent, gguf_file=gemma3_path.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def hf_tokenizer(gemma3_path):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(
        gemma3_path.parent, gguf_file=gemma3_path.name
    )


def engine_of(model, tokenizer, weights="fp32"):
    config = EngineConfig(model="gemma3-270m", weights=weights, num_pages=128)
    return LLMEngine(config, model, tokenizer)


def last_logits(engine, ids, rows):
    """Our logits [rows, V] of the prompt's last `rows` tokens, the prompt in one step."""
    seq = Sequence(seq_id=1, request_id="p", prompt_token_ids=ids, params=SamplingParams())
    engine.block_manager.allocate(seq, len(ids))
    input_ids, positions, metadata = engine.runner.prepare([ScheduledChunk(seq, len(ids))])
    runner = engine.runner
    attention = PagedAttention(engine.kv_cache, metadata, runner.scale, windows=runner.windows)
    wanted = torch.arange(len(ids) - rows, len(ids))
    with torch.inference_mode():
        logits = engine.model(input_ids, positions, attention, wanted)
    engine.block_manager.free(seq)
    return logits


def hf_greedy(hf_model, ids, count):
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([ids]), max_new_tokens=count, min_new_tokens=count, do_sample=False
        )
    return out[0, len(ids) :].tolist()


def test_config_is_what_transformers_reads_from_the_file(gguf, hf_model):
    config = gguf.config()
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (
        18, 640, 4, 1,
    )  # fmt: skip
    assert (config.head_dim, config.sliding_window, config.sliding_rope_theta) == (256, 512, 1e4)
    assert config.layer_windows == (512, 512, 512, 512, 512, None) * 3
    assert (config.query_scale, config.hidden_act, config.rope_interleaved) == (
        1 / 16, "gelu_tanh", False,
    )  # fmt: skip
    # families.py's reading of transformers' config of the same GGUF: the same model
    assert gemma3(hf_model.config.to_dict()) == config


def test_loads_as_gemma3_with_norms_as_stored(model, gguf):
    assert type(model) is Gemma3Model
    layer = model.layers[0]
    # llama.cpp stored 1 + w: what our RMSNorm multiplies by, unchanged
    assert torch.equal(
        layer.post_feedforward_layernorm.weight, gguf.tensor("blk.0.post_ffw_norm.weight")
    )
    assert torch.equal(layer.self_attn.q_norm.weight, gguf.tensor("blk.0.attn_q_norm.weight"))
    assert model.lm_head.weight is model.embed_tokens.weight


def test_prompt_logits_match_transformers(model, tokenizer, hf_model):
    engine = engine_of(model, tokenizer)
    for ids in (tokenizer.encode_chat(CHAT), tokenizer.encode(LONG_TEXT)):
        rows = len(ids) if len(ids) <= 64 else 8  # every row of the chat, the long one's last
        ours = last_logits(engine, ids, rows)
        with torch.no_grad():
            theirs = hf_model(torch.tensor([ids]), logits_to_keep=rows).logits[0].float()
        assert ours.shape == theirs.shape == (rows, 262144)
        assert (ours - theirs).abs().max().item() < 1e-3
    assert len(ids) > 512  # the long prompt crossed the sliding window


def test_greedy_tokens_match_transformers(model, tokenizer, hf_model):
    ids = tokenizer.encode(LONG_TEXT)
    ours = engine_of(model, tokenizer).generate(
        {"r": ids}, SamplingParams(max_tokens=24, ignore_eos=True)
    )["r"]
    assert ours == hf_greedy(hf_model, ids, 24)


# Over the last 64 prompt rows: the least share that picks fp32's next token, and the least
# cosine similarity of a row's logits to fp32's. INT4 re-quantizes weights the file holds in
# 4 to 8 bits (group 32), so it strays further than bf16's rounding.
LOW_PRECISION_BOUNDS = {"bf16": (0.9, 0.999), "int4": (0.75, 0.85)}


@pytest.mark.parametrize("weights", ["bf16", "int4"])
def test_bf16_and_int4_weights_stay_near_fp32(gguf, tokenizer, model, weights):
    built = load_llama(gguf, torch.bfloat16 if weights == "bf16" else torch.float32,
                       int4=weights == "int4")  # fmt: skip
    if weights == "int4":
        assert isinstance(built.layers[0].mlp.down_proj, Int4Linear)
    ids = tokenizer.encode(LONG_TEXT)[:200]
    ours = last_logits(engine_of(built, tokenizer, weights), ids, 64)
    reference = last_logits(engine_of(model, tokenizer), ids, 64)
    min_agreement, min_cosine = LOW_PRECISION_BOUNDS[weights]
    agreement = (ours.argmax(-1) == reference.argmax(-1)).float().mean().item()
    assert agreement >= min_agreement
    assert torch.cosine_similarity(ours, reference, dim=-1).min().item() > min_cosine


def test_tokenizer_matches_transformers(tokenizer, hf_tokenizer):
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids == hf_tokenizer.encode(text), text
        for skip in (True, False):
            assert tokenizer.decode(ids, skip_special_tokens=skip) == hf_tokenizer.decode(
                ids, skip_special_tokens=skip
            )


def test_a_chat_renders_in_gemma_turns_and_encodes_as_transformers_does(tokenizer, hf_tokenizer):
    rendered = tokenizer.apply_chat_template(CHAT)
    assert rendered == (
        "<bos><start_of_turn>user\nYou answer in one word.\n\nWhat is the capital of France?"
        "<end_of_turn>\n<start_of_turn>model\nParis<end_of_turn>\n"
        "<start_of_turn>user\nAnd of Italy?<end_of_turn>\n<start_of_turn>model\n"
    )
    # The file carries no chat template, and transformers renders none: compare the ids
    ids = tokenizer.encode_chat(CHAT)
    assert ids == hf_tokenizer.encode(rendered, add_special_tokens=False)
    assert ids.count(tokenizer.bos_token_id) == 1
    end_of_turn = hf_tokenizer.convert_tokens_to_ids("<end_of_turn>")
    assert tokenizer.stop_token_ids == {hf_tokenizer.eos_token_id, end_of_turn}
