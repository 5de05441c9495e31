"""``rollout.format=tool_calls``: the model's own chat-template tool calls, token-exact like the tag loop.

Real parts: the tiny Qwen2 with hermes tool-call tokens and the bundled tool chat template
(tests/fixtures/toolcalls.py), weight-scripted to call the search tool on every turn, answer in plain text,
or write a malformed call; the transformers engine; the real FAISS retriever server.
"""

import pytest
from transformers import AutoTokenizer

from agent.engines import make_engine
from agent.formats import MAX_CALLS_PER_TURN, ToolCallFormat, strip_reasoning, tool_chat_template
from agent.teacher_forcing import ReplayRetriever, ScriptedTrajectory, replay_trajectories
from agent.rollout import RolloutConfig, run_rollouts, run_rollouts_with_stats
from agent.toolcall_parsers import HermesParser, ToolCall, get_tool_parser
from emapg.config import ConfigError, from_dict
from tasks.qa import qa_reward
from tests.fixtures.agent import Recorder, check_token_exact

FAST = dict(format="tool_calls", max_tokens_per_turn=24, max_obs_tokens=160, temperature=1.0, top_p=0.95)


@pytest.fixture(scope="module")
def searcher(tool_searcher_dir):
    return make_engine("hf", tool_searcher_dir, max_model_len=2048)


@pytest.fixture(scope="module")
def questions(retriever_index):
    return [q["question"] for q in retriever_index.questions[:4]]


# ----------------------------------------------------------------------------- the hermes parser


def test_hermes_parser_reads_calls_and_rejects_malformed_ones():
    p = get_tool_parser("hermes")
    one = p.parse('think first <tool_call>\n{"name": "search", "arguments": {"query": "x"}}\n</tool_call>')
    assert one.calls == (ToolCall("search", {"query": "x"}),) and one.errors == () and one.content == "think first"
    two = p.parse('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": "{\\"k\\": 1}"}</tool_call>')
    assert [c.name for c in two.calls] == ["a", "b"] and two.calls[1].arguments == {"k": 1}
    assert p.parse("Paris").calls == () and p.parse("Paris").content == "Paris"
    for text, why in [("<tool_call>{not json}</tool_call>", "not valid JSON"), ("<tool_call>[1]</tool_call>", "JSON object"),
                      ('<tool_call>{"arguments": {}}</tool_call>', "no \"name\""),
                      ('<tool_call>{"name": "s", "arguments": 3}</tool_call>', "must be a JSON object"),
                      ('<tool_call>{"name": "s", "arguments": "[1"}</tool_call>', "neither a JSON object"),
                      ('<tool_call>{"name": "s"', "not closed"), ("x </tool_call>", "without its")]:
        (err,) = p.parse(text).errors
        assert why in err, (text, err)
    call = ToolCall("search", {"query": "q é"})
    assert p.parse(p.render(call)).calls == (call,)
    with pytest.raises(ConfigError, match="rollout.tool_parser: unknown parser 'nope'.*hermes"):
        get_tool_parser("nope")


def test_turn_reading(tool_tiny_dir):
    fmt = ToolCallFormat(AutoTokenizer.from_pretrained(tool_tiny_dir), RolloutConfig(format="tool_calls", max_query_chars=5))
    call = HermesParser().render
    a = fmt.read_turn(call(ToolCall("search", {"query": " capital\x00 of France "})), "stop")
    assert (a.kind, a.queries) == ("search", ("capit",))  # control characters dropped, cut to max_query_chars
    two = fmt.read_turn(call(ToolCall("search", {"query": "a"})) + call(ToolCall("search", {"query": "b"})), "stop")
    assert two.queries == ("a", "b")
    for text, reason in [(call(ToolCall("calc", {"x": 1})), "unknown tool 'calc'"), (call(ToolCall("search", {})), "string \"query\""),
                         (call(ToolCall("search", {"query": "  "})), "empty search query"),
                         (call(ToolCall("search", {"query": "q"})) * (MAX_CALLS_PER_TURN + 1), "at most"),
                         ("an answer that ran out of tokens", "cut off")]:
        got = fmt.read_turn(text, "length" if reason == "cut off" else "stop")
        assert got.kind == "invalid" and reason in got.reason
    assert fmt.read_turn("<think>hmm</think> Paris ", "stop") == fmt.read_turn("Paris", "stop")
    assert fmt.read_turn("Paris", "stop").content == "Paris" and strip_reasoning("<think>never closed") == ""


# ----------------------------------------------------------------------------- config and templates


def test_config_names_the_option():
    with pytest.raises(ConfigError, match="format"):
        from_dict(RolloutConfig, {"format": "json"})
    with pytest.raises(ConfigError, match="rollout.tool_parser"):
        RolloutConfig(format="tool_calls", tool_parser="no_such_parser").validate()
    with pytest.raises(ConfigError, match="rollout.task=search"):
        RolloutConfig(format="tool_calls", task="math").validate()
    with pytest.raises(ConfigError, match="rollout.chat"):
        RolloutConfig(format="tool_calls", chat="raw").validate()
    assert RolloutConfig(format="tool_calls").template_name == "search_tools"
    assert RolloutConfig().template_name == "search_r1"


def test_a_template_without_tools_is_refused_naming_the_model_and_the_option(tiny_model_dir, smollm2_dir, tmp_path):
    for folder in (tiny_model_dir, smollm2_dir):  # ChatML templates that never read `tools`
        tok = AutoTokenizer.from_pretrained(folder)
        with pytest.raises(ConfigError, match=rf"{folder}.*no tool support.*rollout.tool_chat_template"):
            tool_chat_template(tok, None)
        assert "tools" in tool_chat_template(tok, "chatml_tools")
    (tmp_path / "plain.jinja").write_text("{{ messages }}")
    with pytest.raises(ConfigError, match="never reads `tools`"):
        tool_chat_template(tok, str(tmp_path / "plain.jinja"))
    with pytest.raises(ConfigError, match="neither a bundled template"):
        tool_chat_template(tok, "qwen9")
    # SmolLM2 with the bundled template: the tool is declared in its system turn, the question in the user turn.
    fmt = ToolCallFormat(tok, RolloutConfig(format="tool_calls", tool_chat_template="chatml_tools"))
    text = tok.decode(fmt.build_prompt("who wrote hamlet").token_ids)
    assert '"name": "search"' in text and text.endswith("Question: who wrote hamlet?\n<|im_end|>\n<|im_start|>assistant\n")


# ----------------------------------------------------------------------------- the loop, token-exact


def test_searcher_is_token_exact_and_its_tool_messages_are_the_templates(searcher, retriever_client, questions):
    rec = Recorder(searcher)
    cfg = RolloutConfig(**{**FAST, "max_obs_tokens": 800}, max_turns=2, topk=1)
    trajs = run_rollouts(rec, questions, retriever_client, cfg)
    check_token_exact(trajs, rec.calls)  # model spans = sampled ids (mask 1), observations masked (0)
    tok = searcher.tokenizer
    fmt = ToolCallFormat(tok, cfg)
    for t in trajs:
        assert t.format == "tool_calls" and t.stop_reason == "max_turns" and t.num_searches == 2 and t.invalid_actions == 0
        assert t.obs_truncations == 0
        assert t.queries == ["capital of France"] * 2 and all(len(ids) == 1 for ids in t.retrieved_ids)
        assert [s.role for s in t.spans] == ["model", "observation"] * 2 + ["model"]
        assert t.final_answer is None and t.scored_text == ""
        # The whole context is, as text, exactly what the chat template renders for this conversation.
        messages = [{"role": "user", "content": fmt.build_prompt(t.question).text}]
        hits = retriever_client.retrieve(t.queries, topk=1)
        for i, s in enumerate(s for s in t.spans if s.role == "model"):
            messages.append({"role": "assistant", "content": tok.decode(t.response_ids[s.start : s.end]).removesuffix("<|im_end|>")})
            if i < 2:
                messages += fmt.results_messages([hits[i]], 1, "")
        rendered = fmt.render(messages, add_generation_prompt=False)
        assert tok.decode(t.prompt_ids + t.response_ids) + "\n" == rendered
        # Each observation is the template's text after the turn, tokenised once.
        for s in (s for s in t.spans if s.role == "observation"):
            text = tok.decode(t.response_ids[s.start : s.end])
            assert text.startswith("\n<|im_start|>user\n<tool_response>\nDoc 1(Title: ")
            assert text.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")
            assert t.response_ids[s.start : s.end] == tok(text, add_special_tokens=False)["input_ids"]


def test_answerer_is_scored_on_its_plain_answer(tool_answerer_dir, retriever_client, questions):
    engine = make_engine("hf", tool_answerer_dir, max_model_len=2048)
    for t in run_rollouts(engine, questions[:2], retriever_client, RolloutConfig(**FAST)):
        assert (t.stop_reason, t.final_answer, t.num_searches, t.num_turns) == ("answer", "Paris", 0, 1)
        assert t.loss_mask == [1] * len(t.response_ids) and t.scored_text == "<answer>Paris</answer>"
        assert qa_reward(t.scored_text, ["Paris"]) == 1.0 and qa_reward(t.scored_text, ["London"]) == 0.0


def test_malformed_calls_are_counted_invalid_and_answered_by_a_tool_message(tool_broken_dir, retriever_client, questions):
    engine = make_engine("hf", tool_broken_dir, max_model_len=2048)
    rec = Recorder(engine)
    trajs = run_rollouts(rec, questions[:2], retriever_client, RolloutConfig(**FAST, max_turns=2))
    check_token_exact(trajs, rec.calls)
    for t in trajs:
        assert t.stop_reason == "max_turns" and t.invalid_actions == 2 and t.num_searches == 0
        obs = [s for s in t.spans if s.role == "observation"]
        assert [s.action for s in obs] == ["invalid", "invalid"]
        text = engine.tokenizer.decode(t.response_ids[obs[0].start : obs[0].end])
        assert "<tool_response>\nError: the tool call is not valid JSON" in text and text.endswith("<|im_start|>assistant\n")


def test_budgets_truncate_tool_results_inside_the_template(searcher, retriever_client, questions):
    trajs = run_rollouts(searcher, questions[:2], retriever_client, RolloutConfig(**{**FAST, "max_obs_tokens": 60}, max_turns=1))
    for t in trajs:
        (obs,) = [s for s in t.spans if s.role == "observation"]
        text = searcher.tokenizer.decode(t.response_ids[obs.start : obs.end])
        assert obs.end - obs.start <= 60 and t.obs_truncations == 1
        assert text.endswith("\n</tool_response><|im_end|>\n<|im_start|>assistant\n")  # the structure survives
    for t in run_rollouts(searcher, questions[:2], retriever_client, RolloutConfig(**{**FAST, "max_response_tokens": 100})):
        assert t.stop_reason == "length" and len(t.response_ids) <= 100


def test_async_driver_gives_the_same_trajectories(searcher, retriever_client, questions):
    a = run_rollouts(searcher, questions[:3], retriever_client, RolloutConfig(**FAST, max_turns=2), batch_tag="x")
    b, _ = run_rollouts_with_stats(searcher, questions[:3], retriever_client, RolloutConfig(**FAST, max_turns=2, mode="async"), batch_tag="x")
    assert [t.response_ids for t in a] == [t.response_ids for t in b]
    assert [t.loss_mask for t in a] == [t.loss_mask for t in b]


def test_parallel_calls_get_one_tool_message_each(tool_tiny_dir):
    """A replayed turn with two calls: two searches, two tool messages in one observation (the template's grouping)."""
    tok = AutoTokenizer.from_pretrained(tool_tiny_dir)
    cfg = RolloutConfig(format="tool_calls", max_turns=2, max_tokens_per_turn=200, max_obs_tokens=300)
    call = HermesParser().render
    turns = [call(ToolCall("search", {"query": "a"})) + call(ToolCall("search", {"query": "b"})) + "<|im_end|>", "Paris<|im_end|>"]
    hits = [[{"id": "1", "contents": "\"A\"\nfirst"}], [{"id": "2", "contents": "\"B\"\nsecond"}]]
    (t,) = replay_trajectories(tok, [ScriptedTrajectory("q?", turns)], ReplayRetriever(hits), cfg, max_model_len=2048)
    assert (t.stop_reason, t.num_searches, t.queries, t.retrieved_ids, t.final_answer) == ("answer", 2, ["a", "b"], [["1"], ["2"]], "Paris")
    obs = tok.decode(t.span_ids("observation")[0])
    assert obs == ("\n<|im_start|>user\n<tool_response>\nDoc 1(Title: \"A\") first\n</tool_response>\n<tool_response>\n"
                   "Doc 1(Title: \"B\") second\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
