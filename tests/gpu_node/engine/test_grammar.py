"""Constrained decoding on the real SmolLM2 weights (CPU): every answer under a grammar
matches it, whatever the sampling, batch, preemption or handoff."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from common.node_api import GrammarSpec
from gpu_node.engine.grammar import GrammarMasks
from gpu_node.engine.handoff import KVHandoff
from gpu_node.errors import InvalidRequestError
from scheduler.sequence import SamplingParams
from tests.json_schemas import PERSON

PERSON_SPEC = GrammarSpec(kind="json_schema", value=json.dumps(PERSON))


@pytest.fixture(scope="module")
def served_model(smollm2_path):
    """The model as `edgeserve up` serves it on a CPU (INT4, the C decode kernels where they
    are built): what a grammar holds is the sampler's business, and these long sampled
    answers run several times faster than on the fp32 reference path."""
    from gpu_node.models.weights import build_model

    model, _ = build_model(str(smollm2_path), "int4", "cpu")
    return model


@pytest.fixture
def make_engine(served_model, smollm2_parts):
    from gpu_node.config import EngineConfig
    from gpu_node.engine.llm_engine import LLMEngine

    _, tokenizer = smollm2_parts

    def make(**overrides) -> LLMEngine:
        config = EngineConfig(**{"model": "smollm2", "num_pages": 128, **overrides})
        return LLMEngine(config, served_model, tokenizer)

    return make


ASK = "Describe a made-up person as JSON with name, age, role, address and pets."


def run(engine, requests: dict, *, grammar=None, per_request=None) -> dict:
    """Runs {id: (ids, params)} to the end; {id: final text and tokens}."""
    for rid, (ids, params) in requests.items():
        g = per_request.get(rid) if per_request is not None else grammar
        engine.add_request(rid, ids, params, grammar=g)
    got: dict = {rid: {"text": "", "tokens": [], "finish": None} for rid in requests}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id]["text"] += out.text
            got[out.request_id]["tokens"] += out.token_ids
            if out.finished:
                got[out.request_id]["finish"] = out.finish_reason
    return got


def assert_valid_person(answer: dict) -> None:
    assert answer["finish"] == "stop", answer
    jsonschema.validate(json.loads(answer["text"]), PERSON)


def test_sampled_answers_at_temperature_one_validate(make_engine, chat_ids) -> None:
    """Eight in one batch here; twenty through both APIs in
    tests/integration/test_structured_outputs.py."""
    engine = make_engine(max_num_seqs=8)
    grammar = engine.grammars.compile(PERSON_SPEC)
    ids = chat_ids(ASK)
    requests = {
        str(i): (ids, SamplingParams(max_tokens=200, temperature=1.0, seed=i)) for i in range(8)
    }
    got = run(engine, requests, grammar=grammar)
    for answer in got.values():
        assert_valid_person(answer)
    assert len({a["text"] for a in got.values()}) > 4  # sampled, not one answer eight times
    assert engine.stats().num_free_pages == engine.block_manager.num_pages


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=120),
        SamplingParams(max_tokens=120, temperature=0.8, top_k=40, top_p=0.9, seed=3),
        SamplingParams(max_tokens=120, temperature=1.2, repetition_penalty=1.3, seed=4),
    ],
    ids=["greedy", "top-k-top-p", "penalized"],
)
def test_every_sampling_mode_is_held_to_the_grammar(make_engine, chat_ids, params) -> None:
    engine = make_engine()
    got = run(
        engine,
        {"a": (chat_ids(ASK), params)},
        grammar=engine.grammars.compile(PERSON_SPEC),
    )
    assert_valid_person(got["a"])


def test_a_grammar_request_changes_none_of_its_batch_mates_tokens(make_engine, chat_ids) -> None:
    plain = {
        "greedy": (chat_ids("Name three colours."), SamplingParams(max_tokens=24)),
        "seeded": (
            chat_ids("Write a haiku about rain."),
            SamplingParams(max_tokens=24, temperature=0.9, seed=11),
        ),
    }
    alone = run(make_engine(), plain)
    engine = make_engine()
    grammar = engine.grammars.compile(PERSON_SPEC)
    both = run(
        engine,
        {**plain, "json": (chat_ids(ASK), SamplingParams(max_tokens=120))},
        per_request={"json": grammar},
    )
    for rid in plain:
        assert both[rid]["tokens"] == alone[rid]["tokens"]
    assert_valid_person(both["json"])


def test_regex_choice_ebnf_and_json_object(make_engine, chat_ids) -> None:
    engine = make_engine()
    specs = {
        "regex": GrammarSpec(kind="regex", value=r"[0-9]{3}-[A-Z]{2}"),
        "choice": GrammarSpec(kind="choice", choices=["yes", "no", "maybe not"]),
        "ebnf": GrammarSpec(kind="ebnf", value='root ::= "(" [a-z]+ ")"'),
        "object": GrammarSpec(kind="json_object"),
    }
    params = SamplingParams(max_tokens=60, temperature=1.0, seed=5)
    ids = chat_ids("Answer in the format asked.")
    got = run(
        engine,
        dict.fromkeys(specs, (ids, params)),
        per_request={k: engine.grammars.compile(s) for k, s in specs.items()},
    )
    assert all(a["finish"] == "stop" for a in got.values()), got
    import re

    assert re.fullmatch(r"[0-9]{3}-[A-Z]{2}", got["regex"]["text"])
    assert got["choice"]["text"] in {"yes", "no", "maybe not"}
    assert re.fullmatch(r"\([a-z]+\)", got["ebnf"]["text"])
    assert isinstance(json.loads(got["object"]["text"]), dict)


def test_preempted_mid_grammar_still_ends_valid(make_engine, chat_ids) -> None:
    engine = make_engine(num_pages=20)
    grammar = engine.grammars.compile(PERSON_SPEC)
    ids = chat_ids(ASK)
    requests = {
        str(i): (ids, SamplingParams(max_tokens=200, temperature=1.0, seed=100 + i))
        for i in range(5)
    }
    got = run(engine, requests, grammar=grammar)
    assert engine.stats().num_preemptions > 0
    for answer in got.values():
        assert_valid_person(answer)


def test_a_handed_off_request_resumes_its_grammar(make_engine, chat_ids) -> None:
    params = SamplingParams(max_tokens=200, temperature=1.0, seed=21)
    ids = chat_ids(ASK)
    one = make_engine()
    alone = run(one, {"r": (ids, params)}, grammar=one.grammars.compile(PERSON_SPEC))
    prefill_node, decode_node = make_engine(), make_engine()
    prefill_node.add_request(
        "r", ids, params, prefill_only=True, grammar=prefill_node.grammars.compile(PERSON_SPEC)
    )
    (out,) = [o for _ in range(8) for o in prefill_node.step()]
    assert out.finish_reason == "handoff" and out.handoff is not None
    handoff = KVHandoff.from_bytes(out.handoff.to_bytes())
    decode_node.add_request(
        "r", ids, params, handoff=handoff, grammar=decode_node.grammars.compile(PERSON_SPEC)
    )
    text = ""
    tokens: list[int] = []
    while decode_node.has_unfinished():
        for o in decode_node.step():
            text, tokens = text + o.text, tokens + list(o.token_ids)
    assert tokens == alone["r"]["tokens"]
    jsonschema.validate(json.loads(text), PERSON)


def test_a_handoff_whose_first_token_breaks_the_grammar_is_refused(make_engine, chat_ids):
    ids = chat_ids(ASK)
    params = SamplingParams(max_tokens=8)
    prefill_node = make_engine()
    prefill_node.add_request("r", ids, params, prefill_only=True)  # no grammar there
    (out,) = [o for _ in range(8) for o in prefill_node.step()]
    decode_node = make_engine()
    digits = decode_node.grammars.compile(GrammarSpec(kind="regex", value="[0-9]+"))
    assert not decode_node.tokenizer.decode([out.handoff.first_token]).isdigit()
    with pytest.raises(InvalidRequestError, match="breaks the grammar"):
        decode_node.add_request("r", ids, params, handoff=out.handoff, grammar=digits)


@pytest.mark.parametrize(
    "spec, words",
    [
        (GrammarSpec(kind="json_schema", value='{"type": "objec"}'), "objec"),
        (GrammarSpec(kind="json_schema", value='{"type": '), "not JSON"),
        (GrammarSpec(kind="regex", value="[a-"), "Unclosed"),
        (GrammarSpec(kind="ebnf", value="root ::= missing"), "missing"),
        (GrammarSpec(kind="choice"), "at least one choice"),
    ],
)
def test_an_invalid_grammar_is_refused_naming_the_problem(make_engine, spec, words) -> None:
    engine = make_engine()
    with pytest.raises(InvalidRequestError, match=words):
        engine.grammars.compile(spec)


def test_compilation_is_cached_per_spec(make_engine) -> None:
    engine = make_engine()
    first = engine.grammars.compile(PERSON_SPEC)
    again = engine.grammars.compile(GrammarSpec.model_validate_json(PERSON_SPEC.model_dump_json()))
    assert again is first
    assert (engine.grammars.num_compiled, engine.grammars.num_hits) == (1, 1)


def test_masks_touch_only_the_rows_named() -> None:
    class AllowOdd:
        def fill(self, bitmask: torch.Tensor, row: int) -> None:
            bitmask[row] = int.from_bytes(b"\xaa\xaa\xaa\xaa", "little", signed=True)

    logits = torch.zeros(3, 40)
    GrammarMasks(40).apply(logits, [1], [AllowOdd()])  # type: ignore[list-item]
    assert torch.equal(logits[0], torch.zeros(40)) and torch.equal(logits[2], torch.zeros(40))
    assert torch.isinf(logits[1, 0::2]).all() and (logits[1, 1::2] == 0).all()
    logits = torch.zeros(3, 40)
    GrammarMasks(40).apply(logits, [0, 2], [AllowOdd(), AllowOdd()])  # type: ignore[list-item]
    assert torch.equal(logits[1], torch.zeros(40)) and torch.isinf(logits[2, 0::2]).all()
    logits = torch.zeros(3, 40)
    GrammarMasks(40).apply(logits, [1], [AllowOdd()])  # type: ignore[list-item]
    assert torch.equal(logits[0], torch.zeros(40)) and torch.equal(logits[2], torch.zeros(40))
    assert torch.isinf(logits[1, 0::2]).all() and (logits[1, 1::2] == 0).all()


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 20},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                    "b": {"type": "integer", "minimum": -1000, "maximum": 1000},
                },
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
]


def test_twenty_sampled_required_calls_name_a_tool_and_carry_valid_arguments(
    make_engine, chat_ids
) -> None:
    from common.tool_grammar import parse_tool_calls, tool_call_grammar

    engine = make_engine(max_num_seqs=20)
    spec = tool_call_grammar(TOOLS, "required", parallel_tool_calls=False)
    assert spec is not None
    grammar = engine.grammars.compile(spec)
    ids = chat_ids("What is the weather in Paris, and what is 2 + 3?")
    requests = {
        str(i): (ids, SamplingParams(max_tokens=80, temperature=1.0, seed=i)) for i in range(20)
    }
    got = run(engine, requests, grammar=grammar)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for answer in got.values():
        assert answer["finish"] == "stop", answer
        text, calls = parse_tool_calls(answer["text"])
        assert text == "" and len(calls) == 1, answer
        jsonschema.validate(calls[0].arguments, schemas[calls[0].name])


def test_auto_lets_the_model_answer_in_text(make_engine, chat_ids) -> None:
    from common.tool_grammar import parse_tool_calls, tool_call_grammar

    engine = make_engine()
    spec = tool_call_grammar(TOOLS, "auto")
    assert spec is not None
    got = run(
        engine,
        {"a": (chat_ids("Say hello."), SamplingParams(max_tokens=30))},
        grammar=engine.grammars.compile(spec),
    )
    text, calls = parse_tool_calls(got["a"]["text"])
    assert text and not calls


def test_a_prompt_from_the_prefix_cache_starts_its_grammar_afresh(make_engine, chat_ids):
    engine = make_engine(prefix_cache_blocks=32)
    grammar = engine.grammars.compile(PERSON_SPEC)
    ids = chat_ids(ASK)
    params = SamplingParams(max_tokens=150)
    first = run(engine, {"a": (ids, params)}, grammar=grammar)
    engine.add_request("b", ids, params, grammar=grammar)
    tokens: list[int] = []
    cached = 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.token_ids
            cached = out.num_cached_tokens
    assert cached > 0
    assert tokens == first["a"]["tokens"]
    assert_valid_person(first["a"])
