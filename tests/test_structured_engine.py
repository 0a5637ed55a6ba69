"""Structured outputs in the engine (LLM.generate with SamplingParams.structured_outputs) on the demo:
each constraint holds, a batch mixing constrained and plain requests gives each one's result alone, and
MTP speculation (drafts checked against the grammar, rejected ones rolled back) changes nothing."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from deltaserve.assets import DEMO_DIR
from deltaserve.engine.structured import GrammarError
from deltaserve.sampling import SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.skipif(not (DEMO_DIR / "model.safetensors").exists(), reason="no demo checkpoint")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "enum": ["Paris", "Beijing", "Lima"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
PROMPTS = ["Tell me about Alice.", "天气怎么样？", "Once upon a time", "List three colors:"]


def _params(so: StructuredOutputsParams | None, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=80, temperature=0, structured_outputs=so, **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def llm():
    from deltaserve import LLM

    return LLM(max_num_seqs=8)


@pytest.fixture(scope="module")
def llm_mtp():
    from deltaserve import LLM

    return LLM(max_num_seqs=8, speculative_config={"method": "mtp", "num_speculative_tokens": 2, "adaptive": False})


def _kinds() -> list[StructuredOutputsParams | None]:
    return [
        StructuredOutputsParams(json=SCHEMA),
        StructuredOutputsParams(choice=["yes", "no", "maybe so"]),
        StructuredOutputsParams(regex=r"\d{2}:\d{2} (am|pm)"),
        StructuredOutputsParams(grammar='start: "The " ("cat" | "dog") " is " /[a-z]{2,6}/ "."'),
        StructuredOutputsParams(json_object=True),
        None,
    ]


def _check(so: StructuredOutputsParams | None, text: str) -> None:
    if so is None:
        return
    if so.json is not None:
        jsonschema.validate(json.loads(text), SCHEMA)
    elif so.choice is not None:
        assert text in so.choice
    elif so.regex is not None:
        assert re.fullmatch(so.regex, text), text
    elif so.grammar is not None:
        assert re.fullmatch(r"The (cat|dog) is [a-z]{2,6}\.", text), text
    else:
        assert isinstance(json.loads(text), dict)


def test_constraints_hold_and_batches_do_not_mix(llm) -> None:
    kinds = _kinds()
    alone = [llm.generate([PROMPTS[i % 4]], _params(so), use_tqdm=False)[0].outputs[0] for i, so in enumerate(kinds)]
    for so, out in zip(kinds, alone, strict=True):
        if so is not None and not so.json_object:  # a free JSON object may outrun max_tokens
            assert out.finish_reason == "stop", (so, out.text)
        if out.finish_reason == "stop":
            _check(so, out.text)
    together = llm.generate([PROMPTS[i % 4] for i in range(len(kinds))], [_params(so) for so in kinds],
                            use_tqdm=False)
    assert [o.outputs[0].token_ids for o in together] == [o.token_ids for o in alone]


def test_greedy_rows_agree_across_sampling_paths(llm) -> None:
    """A greedy constrained row gets the same tokens alone (only the rows whose grammar refuses their argmax
    get the masked argmax, from the few lm_head panels with an allowed token) as beside a sampled request
    (then every row's logits come out and the sampler masks them)."""
    kinds = [so for so in _kinds() if so is not None]
    greedy = [_params(so) for so in kinds]
    refused = []
    sampler = llm.engine.runner.sampler
    fix = sampler.fix_grammar_argmax

    def counted(tokens, states, masked_argmax_of):
        fixed = fix(list(tokens), states, masked_argmax_of)
        refused.append(sum(a != b for a, b in zip(tokens, fixed, strict=True)))
        return fixed

    sampler.fix_grammar_argmax = counted
    try:
        alone = [llm.generate([PROMPTS[i % 4]], p, use_tqdm=False)[0].outputs[0].token_ids
                 for i, p in enumerate(greedy)]
    finally:
        del sampler.fix_grammar_argmax
    assert sum(refused) > 10  # the masked argmax decided many tokens
    sampled = SamplingParams(max_tokens=80, temperature=1.0, seed=7, ignore_eos=True)  # alive to the end
    mixed = llm.generate([PROMPTS[i % 4] for i in range(len(kinds))] + ["Hello"], greedy + [sampled], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:-1]] == alone


@pytest.mark.parametrize("seed", range(3))
def test_sampled_outputs_validate(llm, seed: int) -> None:
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=80, temperature=1.0, seed=seed, n=2,
                                                structured_outputs=StructuredOutputsParams(json=SCHEMA)),
                        use_tqdm=False)
    for o in outs:
        for c in o.outputs:
            jsonschema.validate(json.loads(c.text), SCHEMA)


def test_mtp_speculation_keeps_the_constraint(llm, llm_mtp) -> None:
    kinds = [so for so in _kinds() if so is not None]
    params = [_params(so) for so in kinds]
    prompts = [PROMPTS[i % 4] for i in range(len(kinds))]
    plain = llm.generate(prompts, params, use_tqdm=False)
    spec = llm_mtp.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert llm_mtp.engine.spec_metrics.num_accepted_tokens > 0  # drafts were accepted (and others rolled back)
    # sampled, with drafts drawn from the constrained draft distribution and verified by rejection
    sampled = llm_mtp.generate(prompts, [SamplingParams(max_tokens=80, temperature=0.8, seed=3, structured_outputs=so)
                                         for so in kinds], use_tqdm=False)
    for so, o in zip(kinds, sampled, strict=True):
        if o.outputs[0].finish_reason == "stop":
            _check(so, o.outputs[0].text)
        else:
            assert so.json_object, (so, o.outputs[0].text)


def test_argmax_checks_agree_with_the_mask(llm) -> None:
    """Along real constrained outputs: a greedy row keeps its argmax exactly when the mask allows it (every
    token checked, so the shortcut equals the masked argmax; llguidance's validate_tokens admits tokens its
    mask leaves out, which once made MTP verify rows and plain rows disagree), and the masks computed ahead
    for a batch in one llguidance call equal the ones each matcher computes alone."""
    from deltaserve.engine.structured import compute_masks_ahead, refused_rows

    kinds = [so for so in _kinds() if so is not None]
    outs = llm.generate([PROMPTS[i % 4] for i in range(len(kinds))], [_params(so) for so in kinds], use_tqdm=False)
    eos = llm.engine.eos_token_ids
    vocab = llm.engine.model_config.vocab_size
    for so, o in zip(kinds, outs, strict=True):
        grammar = llm.engine.grammars.compile(so)
        toks = list(o.outputs[0].token_ids)
        end = len(toks) - (bool(toks) and toks[-1] in eos)  # where the grammar may end (a stop id's bit is set)
        positions = [*range(0, end, max(end // 6, 1)), end]
        ahead = [grammar.matcher() for _ in positions]
        compute_masks_ahead(ahead, [toks[:i] for i in positions])
        for m_ahead, i in zip(ahead, positions, strict=True):
            alone = grammar.matcher()
            assert alone.sync(toks[:i])
            mask = alone.mask()
            assert (m_ahead.mask() == mask).all(), (so, i)
            # refused_rows (the sampler's check of each greedy row's argmax) refuses a token exactly when the
            # mask does; an id that ends the sequence is allowed exactly when the grammar may end
            ids = [alone.eos_token_id if t in eos else t for t in range(vocab)]
            raw = alone.matcher.compute_bitmask()  # llguidance's own mask, without the stop ids' rule
            refused = refused_rows([mask] * vocab, list(range(vocab)))
            assert refused == [t for t in range(vocab) if not (raw[ids[t] >> 3] >> (ids[t] & 7)) & 1], (so, i)
            assert (eos[0] not in refused) == alone.matcher.is_accepting()


def test_masks_ahead_only_with_a_spare_core(llm) -> None:
    """The worker computes the masks ahead when the forward's threads leave a core free (the suite runs one
    thread), and stays out of the way when they use every core."""
    import torch

    from deltaserve.engine.sampler import make_sampling_state
    from deltaserve.engine.threads import physical_cores

    sampler = llm.engine.runner.sampler
    grammar = llm.engine.grammars.compile(StructuredOutputsParams(json=SCHEMA))
    states = [make_sampling_state(_params(None), [1, 2], grammar=grammar) for _ in range(4)]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(physical_cores())
        assert sampler.grammar_masks_ahead(states) is None
        torch.set_num_threads(1)
        if physical_cores() > 1:
            sampler.wait_grammar_masks(sampler.grammar_masks_ahead(states))
            assert all(s.grammar._mask is not None for s in states)
    finally:
        torch.set_num_threads(before)


def test_bad_constraints_are_errors(llm) -> None:
    for so, needle in [
        (StructuredOutputsParams(json={"type": "objectx"}), "JSON schema is invalid"),
        (StructuredOutputsParams(json="{not json"), "not valid JSON"),
        (StructuredOutputsParams(regex="(ab"), "regex is invalid"),
        (StructuredOutputsParams(grammar="start: foo"), "grammar is invalid"),
    ]:
        with pytest.raises(GrammarError, match=needle):
            llm.generate(["x"], _params(so), use_tqdm=False)
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(json=SCHEMA, regex="a")
    with pytest.raises(ValueError, match="structured_outputs must be"):
        SamplingParams(structured_outputs={"json": SCHEMA})  # type: ignore[arg-type]


def test_chat_renders_tools(llm) -> None:
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
    out = llm.chat([{"role": "user", "content": "What time is it?"}], SamplingParams(max_tokens=2), use_tqdm=False,
                   tools=[tool])[0]
    assert '<tools>\n{"type": "function", "function": {"name": "get_time"' in out.prompt


WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"type": "string", "enum": ["c", "f"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit"]}}}


@pytest.mark.parametrize("parser_name", ["qwen3_coder", "hermes"])
@pytest.mark.parametrize("thinking", [False, True])
def test_forced_calls_parse_in_both_formats(llm, parser_name: str, thinking: bool) -> None:
    """The grammar tool_choice "required" uses, in each parser's format, on the demo (which thinks first
    when the template opens a think block): the parser reads a call whose arguments validate."""
    from deltaserve.serve.reasoning import split_reasoning
    from deltaserve.serve.tool_grammar import tool_call_grammar
    from deltaserve.serve.tool_parsers import TOOL_PARSERS, extract_tool_calls, tool_schemas

    tok = llm.get_tokenizer()
    schemas = tool_schemas([WEATHER_TOOL])
    grammar = tool_call_grammar(tok, parser_name, schemas, parallel=False)
    so = StructuredOutputsParams(grammar=grammar, reasoning_end="</think>" if thinking else None)
    questions = ["Weather in Lima?", "Is it cold in Paris today?", "北京天气怎么样？"]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tools=[WEATHER_TOOL],
                                       enable_thinking=thinking) for q in questions]
    # Thinking: the demo's reasoning can outrun max_tokens, so a bias makes it close its think block
    # early (how early is the model's: the grammar leaves the reasoning free).
    bias = {tok.token_to_id("</think>"): 8.0} if thinking else None
    outs = llm.generate(prompts, [SamplingParams(max_tokens=300, temperature=0 if thinking else 0.7, seed=s,
                                                 structured_outputs=so, logit_bias=bias) for s in range(3)],
                        use_tqdm=False)
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "stop", c.text
        reasoning, content = split_reasoning(c.text, thinking)
        rest, calls = extract_tool_calls(TOOL_PARSERS[parser_name](), schemas, content)
        assert rest == "" and len(calls) == 1 and calls[0].name == "get_weather", c.text
        jsonschema.validate(calls[0].arguments, schemas["get_weather"])
        assert "<tool_call>" not in (reasoning or "")
