"""The tool-call parsers of other model families (agent/toolcall_parsers.py: llama3_json, mistral, qwen3_coder), each
proven with a chat template of its family (agent/formats.py TOOL_CHAT_TEMPLATES) on a tiny model.

Two proofs per family: the parser reads back the calls the family's template writes for an assistant tool-call message;
and a rollout (``rollout.format=tool_calls``) on the tiny Qwen2 given the family's special tokens and template, weight-
scripted to call the search tool in that family's syntax every turn (agent/scripted.py), is token-exact, every call is
read as a search, and the results come back in the family's framing (Llama's ``ipython`` turn, Mistral's
``[TOOL_RESULTS]``, Qwen's ``<tool_response>``).
"""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from agent.engines import make_engine
from agent.formats import SEARCH_TOOL, TOOL_CHAT_TEMPLATES
from agent.rollout import RolloutConfig, run_rollouts
from agent.scripted import build_untied_tiny, save_scripted
from agent.toolcall_parsers import ToolCall, get_tool_parser, tool_parser_names
from emapg.config import ConfigError
from tests.fixtures.agent import Recorder, check_token_exact

LLAMA_HEAD, LLAMA_TAIL = '{"name": "search", "parameters": {"query": "', '"}}'
MISTRAL_HEAD, MISTRAL_TAIL = '[{"name": "search", "arguments": {"query": "', '"}}]'
QWEN_OPEN, QWEN_CLOSE = "<tool_call>\n<function=search>\n<parameter=query>\n", "\n</parameter>\n</function>\n</tool_call>"
# parser -> (template, special tokens, eos, plain added tokens, script, what a turn follows, the results' framing)
FAMILIES = {
    "llama3_json": ("llama3_json", ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], "<|eot_id|>",
                    [LLAMA_HEAD, LLAMA_TAIL], f"{LLAMA_HEAD}capital of France{LLAMA_TAIL}<|eot_id|>", ("\n",), "ipython<|end_header_id|>\n\nDoc 1("),
    "mistral": ("mistral_tools", ["[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "</s>"],
                "</s>", ["[TOOL_CALLS]", MISTRAL_HEAD, MISTRAL_TAIL], f"[TOOL_CALLS]{MISTRAL_HEAD}capital of France{MISTRAL_TAIL}</s>",
                ("[/INST]", "[/TOOL_RESULTS]"), '{"content": "Doc 1('),
    "qwen3_coder": ("qwen3_coder", [], None, [QWEN_OPEN, QWEN_CLOSE], f"{QWEN_OPEN}capital of France{QWEN_CLOSE}<|im_end|>", ("\n",),
                    "<tool_response>\nDoc 1("),
}  # fmt: skip


def test_every_family_is_registered_and_an_unknown_name_lists_them():
    assert {"hermes", "llama3_json", "mistral", "qwen3_coder"} <= set(tool_parser_names())
    with pytest.raises(ConfigError, match="llama3_json, mistral, qwen3_coder"):
        get_tool_parser("nope")


@pytest.mark.parametrize("parser", sorted(FAMILIES))
def test_the_parser_reads_what_its_template_writes(parser, tiny_model_dir):
    template = TOOL_CHAT_TEMPLATES[FAMILIES[parser][0]]
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    calls = [{"id": "c1", "type": "function", "function": {"name": "search", "arguments": {"query": "capital of France"}}},
             {"id": "c2", "type": "function", "function": {"name": "lookup", "arguments": {"key": "x", "n": 2}}}]
    user = [{"role": "user", "content": "Q?"}]
    before = tok.apply_chat_template(user, tools=[SEARCH_TOOL], chat_template=template, tokenize=False, add_generation_prompt=True)
    after = tok.apply_chat_template([*user, {"role": "assistant", "content": "", "tool_calls": calls}], tools=[SEARCH_TOOL],
                                    chat_template=template, tokenize=False)  # fmt: skip
    assert after.startswith(before)
    turn = after[len(before):]
    for end in ("<|eot_id|>", "<|im_end|>", "</s>"):  # the end-of-turn token, which a rollout decodes away
        turn = turn.replace(end, "")
    parsed = get_tool_parser(parser).parse(turn)
    expected = (ToolCall("search", {"query": "capital of France"}), ToolCall("lookup", {"key": "x", "n": 2}))
    if parser == "qwen3_coder":  # XML parameters are text unless they hold JSON objects or lists
        expected = (expected[0], ToolCall("lookup", {"key": "x", "n": "2"}))
    assert parsed.calls == expected and parsed.errors == ()
    one = get_tool_parser(parser).parse(get_tool_parser(parser).render(expected[0]))
    assert one.calls == expected[:1] and one.errors == ()
    assert get_tool_parser(parser).parse("Paris").calls == () and get_tool_parser(parser).parse("Paris").content == "Paris"


@pytest.fixture(scope="module")
def questions(retriever_index):
    return [q["question"] for q in retriever_index.questions[:2]]


@pytest.mark.parametrize("parser", sorted(FAMILIES))
def test_a_rollout_in_the_familys_syntax_is_token_exact(parser, tmp_path, tiny_model_dir, retriever_client, questions):
    template, special, eos, plain, script, starts, framing = FAMILIES[parser]

    def edit(tok) -> None:
        if special:
            tok.add_tokens(special, special_tokens=True)
        tok.add_tokens(plain)
        if eos:
            tok.eos_token = eos
        tok.chat_template = TOOL_CHAT_TEMPLATES[template]

    base = build_untied_tiny(tmp_path / "family", tiny_model_dir, seed=4, edit_tokenizer=edit)
    model = save_scripted(base, tmp_path / "scripted", script, starts=starts)
    engine = Recorder(make_engine("hf", model, max_model_len=2048))
    cfg = RolloutConfig(format="tool_calls", tool_parser=parser, max_turns=2, max_tokens_per_turn=24, max_obs_tokens=200, topk=1,
                        temperature=1.0, top_p=1.0, max_prompt_tokens=1024)  # fmt: skip
    trajs = run_rollouts(engine, questions, retriever_client, cfg)
    check_token_exact(trajs, engine.calls)
    for t in trajs:
        assert t.error is None and t.stop_reason == "max_turns", (t.error, t.response_text[:300])
        assert t.num_searches == 2 and t.invalid_actions == 0 and t.search_failures == 0
        assert t.queries == ["capital of France"] * 2
        text = engine.tokenizer.decode(t.response_ids, skip_special_tokens=False)
        assert framing in text, text[:400]
