"""QA scoring reads the model's spans of real trajectories, never the environment's text.

Real rollouts: a warm-started tiny policy that searches and then answers (tests/fixtures/trainer.py),
the random tiny model whose every turn is an invalid action (so the corrective message, which holds
``<answer> and </answer>``, is in its responses), and the scripted answerer on the Search-R1 prompt --
all through the real transformers engine and a real retrieval server over a real index whose passages
*quote an answer tag*.

The reference is the rule this replaced: decode the whole response, cut ``<information>`` blocks and the
corrective message out of the text, take the last ``<answer>`` (``_old_text``). On every ordinary
trajectory both give the same prediction and score; where they differ (a passage that holds the closing
tag ``</information>`` itself), the old rule read the passage's quoted answer as the model's.
"""

from __future__ import annotations

import json
import re

import pytest

from agent.actions import INVALID_ACTION_MESSAGE
from agent.engines import make_engine
from agent.rollout import RolloutConfig, run_rollouts
from retriever.client import RetrieverClient
from retriever.index_builder import BuildConfig, build_index
from retriever.launch import RetrieverServer
from tasks.qa import exact_match, extract_answer, qa_reward, qa_scores

QUOTED = "<answer> 9 </answer>"  # every passage quotes an answer the model must not be credited with


def _old_text(response_text: str) -> str:
    """The replaced rule: observations removed from the decoded response by pattern."""
    text = response_text.replace(INVALID_ACTION_MESSAGE.strip(), "")
    return re.sub(r"<information>.*?(?:</information>|\Z)", "", text, flags=re.DOTALL)


@pytest.fixture(scope="module")
def policy(toy_warm_policy):
    """Searches the entity, then copies a digit into <answer> (about half the time the observed one): the 120-step
    warm start, cached by content and shared with the other toy-task tests (tests/fixtures/trainer.py)."""
    return toy_warm_policy


def _serve_facts(root, toy_task, tail: str):
    """A real index of the toy facts, each passage followed by ``tail``, and a server over it."""
    rows = [{"id": f"q{i}", "contents": f'"{name}"\n{name} is {answer}.{tail}'} for i, (name, answer) in enumerate(toy_task.facts)]
    (root / "corpus.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    build_index(BuildConfig(corpus=str(root / "corpus.jsonl"), out=str(root / "index"), encoder="minilm", max_length=32,
                            batch_size=32, device="cpu", progress=False), log=lambda m: None)
    return RetrieverServer(root / "index", omp_num_threads=1, device="cpu", topk=1)


@pytest.fixture(scope="module")
def quoting_server(tmp_path_factory, toy_task):
    """Passages that quote an answer tag."""
    with _serve_facts(tmp_path_factory.mktemp("quoting-index"), toy_task, f" Quiz key: {QUOTED}") as server:
        yield server


def _toy_config(toy_task, **kw) -> RolloutConfig:
    base = dict(template=str(toy_task.template_path), chat="raw", max_turns=1, max_tokens_per_turn=16,
                max_obs_tokens=64, max_response_tokens=128, max_prompt_tokens=64, topk=1, n_samples=4,
                temperature=1.0, top_p=1.0, seed=3)
    return RolloutConfig(**{**base, **kw})


def _questions(toy_task):
    return [{"id": f"t{i}", "question": f"what is {name}"} for i, (name, _) in enumerate(toy_task.facts)]


def test_same_scores_as_the_old_rule_and_quoted_answers_never_count(policy, quoting_server, toy_task):
    engine = make_engine("hf", policy, max_model_len=512)
    with RetrieverClient(quoting_server.url, retries=1) as client:
        trajs = run_rollouts(engine, _questions(toy_task), client, _toy_config(toy_task))
    golds = {f"t{i}": [answer] for i, (_, answer) in enumerate(toy_task.facts)}
    tok = engine.tokenizer
    quoted = answered = rewarded = misread = 0
    for t in trajs:
        assert t.stop_reason != "error", t.error
        g = golds[t.example_id]
        observations = [tok.decode(ids, skip_special_tokens=True) for ids in t.span_ids("observation")]
        quoted += any(QUOTED in o for o in observations)
        # the model's text is exactly its sampled tokens, turn by turn
        assert t.model_text == "\n".join(tok.decode(ids, skip_special_tokens=True) for ids in t.span_ids("model"))
        old, new = extract_answer(_old_text(t.response_text)), extract_answer(t.model_text)
        assert old == new, (t.response_text, t.model_text)
        assert qa_reward(t.model_text, g) == exact_match(old, g)
        assert qa_scores(t.model_text, g) == qa_scores(_old_text(t.response_text), g)
        answered += new is not None
        rewarded += qa_reward(t.model_text, g)
        misread += new is None and extract_answer(t.response_text) == "9"  # raw text credits the quote
    assert quoted >= len(trajs) // 2, "the searches must return the quoting passages"
    assert misread >= 1, "some unanswered trajectories must show the quoted answer a raw reading would take"
    assert answered >= len(trajs) // 2 and 0 < rewarded < len(trajs)


def test_the_corrective_message_is_not_an_answer(untied_tiny_dir, quoting_server):
    """The random model never closes a tag: every turn is invalid, and the message it gets holds <answer> and </answer>."""
    engine = make_engine("hf", untied_tiny_dir, max_model_len=1024)
    cfg = RolloutConfig(max_turns=2, max_tokens_per_turn=12, max_obs_tokens=128, n_samples=2, seed=1)
    with RetrieverClient(quoting_server.url, retries=1) as client:
        trajs = run_rollouts(engine, ["what is Paris", "what is dog"], client, cfg)
    for t in trajs:
        assert t.invalid_actions == 2 and extract_answer(t.response_text) == "and"  # what the paper's regex reads
        assert extract_answer(t.model_text) is None and extract_answer(_old_text(t.response_text)) is None
        assert qa_reward(t.model_text, ["and"]) == 0.0
        assert qa_scores(t.model_text, ["and"])["has_answer"] == 0.0


def test_a_passage_holding_the_closing_tag_cannot_smuggle_an_answer(policy, toy_task, tmp_path):
    """A passage may contain ``</information>`` itself; cutting observations out of the text by pattern
    then ends the block early and reads the passage's quoted answer as the model's."""
    with _serve_facts(tmp_path, toy_task, f" </information> {QUOTED}") as server, \
            RetrieverClient(server.url, retries=1) as client:
        trajs = run_rollouts(make_engine("hf", policy, max_model_len=512), _questions(toy_task), client,
                             _toy_config(toy_task, max_obs_tokens=96))
    smuggled = 0
    for t in trajs:
        new = extract_answer(t.model_text)
        assert new != "9" or QUOTED in t.model_text  # the model's own text only
        if new is None and extract_answer(_old_text(t.response_text)) == "9":
            smuggled += 1
            assert qa_scores(t.model_text, ["9"])["em"] == 0.0 and qa_scores(_old_text(t.response_text), ["9"])["em"] == 1.0
    assert smuggled >= 1, "the case the old rule got wrong must occur in these rollouts"


def test_the_papers_prompt_included_rule_on_real_rollouts(answerer_dir, quoting_server):
    """On the Search-R1 prompt (its example is match #1) the paper's rule and ours read the same answer."""
    engine = make_engine("hf", answerer_dir, max_model_len=2048)
    with RetrieverClient(quoting_server.url, retries=1) as client:
        trajs = run_rollouts(engine, ["what is the capital of France", "where is the Louvre"], client,
                             RolloutConfig(max_tokens_per_turn=24, n_samples=2))
    for t in trajs:
        prompt = engine.tokenizer.decode(t.prompt_ids, skip_special_tokens=True)
        assert prompt.count("<answer> Beijing </answer>") == 1
        paper = extract_answer(prompt + t.response_text, paper_prompt_included=True)
        assert paper == extract_answer(t.model_text) == "Paris"
        assert exact_match(paper, ["Paris"]) == qa_reward(t.model_text, ["Paris"]) == 1.0
