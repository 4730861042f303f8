"""A real checkpoint in Hugging Face's format: SmolLM2 converted from its GGUF by
transformers (weights to safetensors, tokenizer to tokenizer.json with its chat template),
served from that directory, answers exactly as from the GGUF."""

from __future__ import annotations

import pytest
import torch

from gpu_node.config import EngineConfig
from gpu_node.engine.llm_engine import LLMEngine
from gpu_node.models.weights import build_model
from scheduler.sequence import SamplingParams

pytestmark = pytest.mark.slow

QUESTIONS = ("What is the capital of France?", "Tell me about the history of Rome.")


@pytest.fixture(scope="module")
def smollm2_directory(smollm2_path, tmp_path_factory):
    import transformers

    directory = tmp_path_factory.mktemp("smollm2-hf")
    kwargs = {"gguf_file": smollm2_path.name}
    model = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_path.parent, dtype=torch.float32, **kwargs
    )
    # transformers will not save a model it read from a GGUF: write what save_pretrained would.
    from safetensors.torch import save_file

    state = model.state_dict()
    if model.config.tie_word_embeddings:  # stored once, as the embedding
        del state["lm_head.weight"]
    save_file({k: v.contiguous() for k, v in state.items()}, str(directory / "model.safetensors"))
    model.config.__dict__.pop("quantization_config", None)
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(directory)
    model.generation_config.save_pretrained(directory)
    transformers.AutoTokenizer.from_pretrained(smollm2_path.parent, **kwargs).save_pretrained(
        directory
    )
    return directory


def answers(model_name: str) -> dict[str, list[int]]:
    model, tokenizer = build_model(model_name, "fp32")
    engine = LLMEngine(EngineConfig(model=model_name, weights="fp32", num_pages=128), model,
                       tokenizer)  # fmt: skip
    prompts = {q: tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS}
    return engine.generate(prompts, SamplingParams(max_tokens=24)) | {
        f"prompt: {q}": ids for q, ids in prompts.items()
    }


def test_the_converted_checkpoint_answers_as_the_gguf(smollm2_path, smollm2_directory):
    from_gguf = answers(str(smollm2_path))
    from_directory = answers(str(smollm2_directory))
    assert from_directory == from_gguf
    first = from_gguf[QUESTIONS[0]]
    assert len(first) > 3  # a real answer, compared token for token above
