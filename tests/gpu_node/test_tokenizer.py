import pytest

SAMPLES = [
    "What is the capital of France?",
    "In 2024, héllo  world\n\n  x=12345",
    "émoji 😀 tab\tend",
    "def f(x):\n    return x**2  # comment",
]


def test_chat_template_renders_chatml(smollm2_parts):
    _, tok = smollm2_parts
    text = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    )
    assert (
        text
        == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    default = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert default.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


def test_special_tokens_are_single_tokens(smollm2_parts):
    _, tok = smollm2_parts
    assert tok.encode("<|im_start|>user\nHi<|im_end|>") == [1, 4093, 198, 26843, 2]
    assert tok.eos_token_id == 2 and 2 in tok.stop_token_ids


def test_round_trip(smollm2_parts):
    _, tok = smollm2_parts
    for s in SAMPLES:
        assert tok.decode(tok.encode(s)) == s


def test_matches_transformers_gguf_tokenizer(smollm2_parts, smollm2_path):
    import transformers

    _, tok = smollm2_parts
    theirs = transformers.AutoTokenizer.from_pretrained(
        smollm2_path.parent, gguf_file=smollm2_path.name
    )
    for s in SAMPLES:
        assert tok.encode(s) == theirs.encode(s)


def test_bad_messages_are_rejected(smollm2_parts):
    from gpu_node.errors import InvalidRequestError

    _, tok = smollm2_parts
    with pytest.raises(InvalidRequestError, match=r"messages\[1\] needs 'role' and 'content'"):
        tok.apply_chat_template([{"role": "user", "content": "a"}, {"content": "b"}])
