"""The search (QA) task's metrics: the paper's exact-match reward, token F1, cover-EM, retrieval recall.

The normalisation is the SQuAD rule used by Search-R1's ``qa_em.py`` (and therefore by the
EMA-PG search reward, ALGORITHM.md §4.5): lowercase, drop ASCII punctuation
(``string.punctuation``), remove the articles a/an/the as whole words, collapse whitespace.
It is reproduced exactly, including its limits: non-ASCII punctuation (curly quotes, en
dashes) is *kept* and accents are not folded, so ``"Beyoncé"`` does not match ``"Beyonce"``.

Answer extraction departs from the paper in where it looks, not in what it finds:

* The paper decodes **prompt + response** and takes the last ``<answer>…</answer>`` only if
  there are at least two matches, because the prompt's own example ``<answer> Beijing
  </answer>`` always supplies one. That rule silently breaks with any prompt whose example
  differs (no example: a correct single answer scores 0; two examples: the prompt's example
  is graded when the model answers nothing).
* We score **the model's own text only** -- ``Trajectory.model_text``, the decoded spans the
  model generated (the loss mask's 1s) -- and take its last match. On the paper's prompt the two
  rules agree whenever the model wrote at least one answer tag.
  ``extract_answer(text, paper_prompt_included=True)`` reproduces the paper's rule on
  prompt + response text, for comparisons with published numbers.
* What counts as the answer is Search-R1's pattern by default (``rule="search_r1"``): the non-greedy
  ``<answer>(.*?)</answer>`` over the model's turns joined by newlines. An answer cut off inside
  ``<answer>`` (a turn that ran out of tokens) is then joined to the next complete one: ``<answer> New Yo``
  … ``<answer> New York City</answer>`` reads ``"New Yo … <answer> New York City"`` and scores 0. Evaluation
  keeps this rule, for comparability with the paper; ``rule="last_complete"`` (the training option
  ``reward.qa_answer``) reads the last complete answer, the text after the last ``<answer>`` that its
  ``</answer>`` closes. :func:`joined_answer` says whether a prediction was so joined.
* Text the environment inserted is never read as an answer: the ``<information>`` blocks and
  Search-R1's corrective message (which itself contains ``<answer> and </answer>``) are not model
  spans. The paper scans them too; as a model answer always ends the trajectory, that changes the
  exact match only for the gold answer "and", but it would make every invalid-action trajectory look
  "answered", and a retrieved passage quoting ``<answer>`` could be scored. Reading spans (not
  stripping tags out of decoded text) also holds when an observation was cut before its
  ``</information>`` or a passage contains that tag.
"""

from __future__ import annotations

import functools
import re
import string
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from typing import Literal

__all__ = [
    "normalize_answer",
    "find_tags",
    "extract_answer",
    "joined_answer",
    "last_complete_answer",
    "AnswerRule",
    "ANSWER_RULES",
    "exact_match",
    "cover_exact_match",
    "token_f1",
    "retrieval_recall",
    "golds_outside_question",
    "gold_shown",
    "qa_reward",
    "qa_scores",
]

_ARTICLES_RE = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD normalisation, in SQuAD's order: lowercase, punctuation, articles, whitespace."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCT)
    text = _ARTICLES_RE.sub(" ", text)
    return " ".join(text.split())


@functools.lru_cache(maxsize=None)
def _tags_re(names: tuple[str, ...]) -> re.Pattern[str]:
    return re.compile(rf"<({'|'.join(map(re.escape, names))})>(.*?)</\1>", re.DOTALL)


def find_tags(text: str, names: tuple[str, ...] = ("answer",)) -> Iterator[tuple[str, str]]:
    """Every complete ``<name>…</name>`` in ``text`` whose name is one of ``names``, in order, as (name, content
    unstripped): the one reader of the model's tags, for its answer here and its action in the agent loop
    (:func:`agent.actions.parse_action`). Search-R1's rule: a non-greedy DOTALL match, tag names matching,
    so ``<search> x </answer>`` is no tag and ``<answer><answer>x</answer>`` holds ``"<answer>x"``."""
    return ((m.group(1), m.group(2)) for m in _tags_re(tuple(names)).finditer(text))


AnswerRule = Literal["search_r1", "last_complete"]
ANSWER_RULES: tuple[str, ...] = ("search_r1", "last_complete")
_OPEN = "<answer>"


def extract_answer(text: str, *, paper_prompt_included: bool = False, rule: AnswerRule = "search_r1") -> str | None:
    """Content (stripped) of the last ``<answer>…</answer>`` in ``text``; ``None`` if absent.

    ``paper_prompt_included=True`` applies the paper's rule to prompt + response text: fewer
    than two matches gives ``None`` (the first is assumed to be the prompt's example).
    Matching is the paper's non-greedy DOTALL regex, so ``<answer><answer>x</answer>`` yields
    ``"<answer>x"`` and an unclosed ``<answer>`` yields nothing. ``rule="last_complete"`` keeps only what
    follows the match's last ``<answer>`` (``"x"``): an earlier answer left open (cut off) is not joined to it.
    """
    if rule not in ANSWER_RULES:
        raise ValueError(f"unknown answer rule {rule!r}; choose {' or '.join(ANSWER_RULES)}")
    matches = [content for _, content in find_tags(text)]
    if len(matches) < (2 if paper_prompt_included else 1):
        return None
    return (last_complete_answer(matches[-1]) if rule == "last_complete" else matches[-1]).strip()


def last_complete_answer(content: str) -> str:
    """What follows the last ``<answer>`` in a match's ``content`` (all of it when there is none): the answer that
    the closing tag closes, without an earlier one that was left open."""
    return content.rsplit(_OPEN, 1)[-1]


def joined_answer(prediction: str | None) -> bool:
    """Whether a Search-R1-rule prediction joined an earlier, unclosed ``<answer>`` to the answer that closed
    (its content holds an opening tag)."""
    return prediction is not None and _OPEN in prediction


def _as_list(golds: str | Iterable[str]) -> list[str]:
    if isinstance(golds, str):
        return [golds]
    out = [str(g) for g in golds]
    if not out:
        raise ValueError("at least one gold answer is needed")
    return out


def exact_match(prediction: str | None, golds: str | Iterable[str]) -> float:
    """1.0 if the normalised prediction equals any normalised gold, else 0.0 (``None`` → 0)."""
    golds = _as_list(golds)
    if prediction is None:
        return 0.0
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(g) for g in golds))


def cover_exact_match(prediction: str | None, golds: str | Iterable[str]) -> float:
    """1.0 if some normalised gold is a substring of the normalised prediction (Search-R1's
    ``subem``). An empty normalised gold never covers: it would match every prediction."""
    golds = _as_list(golds)
    if prediction is None:
        return 0.0
    pred = normalize_answer(prediction)
    return float(any((g := normalize_answer(gold)) and g in pred for gold in golds))


def _f1(pred_tokens: list[str], gold_tokens: list[str]) -> float:
    if not pred_tokens or not gold_tokens:  # SQuAD v2 convention: both empty is a match
        return float(pred_tokens == gold_tokens)
    common = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if common == 0:
        return 0.0
    precision = common / len(pred_tokens)
    recall = common / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def token_f1(prediction: str | None, golds: str | Iterable[str]) -> float:
    """SQuAD token F1 on normalised text, maximised over the gold answers."""
    golds = _as_list(golds)
    if prediction is None:
        return 0.0
    pred = normalize_answer(prediction).split()
    return max(_f1(pred, normalize_answer(g).split()) for g in golds)


def _padded(text: str) -> str:
    """SQuAD-normalised ``text`` between spaces, for token-bounded containment (``" g " in _padded(t)``)."""
    return f" {normalize_answer(text)} "


def retrieval_recall(passages: Iterable[str], golds: str | Iterable[str]) -> float:
    """1.0 if any retrieved passage contains a gold answer, else 0.0.

    Both sides are normalised and the match is token-bounded (``" 1 "`` in ``" 1 2 "``), which
    is stricter than FlashRAG's raw substring test: a one-digit gold would otherwise be found
    inside almost any passage.
    """
    golds = [g for g in (normalize_answer(x) for x in _as_list(golds)) if g]
    for passage in passages:
        padded = _padded(passage)
        if any(f" {g} " in padded for g in golds):
            return 1.0
    return 0.0


def golds_outside_question(question: str, golds: str | Iterable[str]) -> list[str]:
    """The gold answers that the question does not itself contain (SQuAD-normalised, token-bounded), in order.

    A comparison question names its answer ("Who was born first, Gene Mayer or Serena Williams?" → "Gene Mayer"):
    a passage that repeats it shows the model nothing it had not been told. Empty when every gold is in the question.
    """
    padded = _padded(question)
    return [g for g in _as_list(golds) if (n := normalize_answer(g)) and f" {n} " not in padded]


# A markup tag (``<information>``, ``</tool_response>``) in shown text: a token boundary, not text. SQuAD normalisation
# drops its brackets and slash, so a gold at the very end of a tagged observation would otherwise fuse with the tag's
# name ("austen</information>" -> "austeninformation").
_MARKUP_RE = re.compile(r"</?[A-Za-z_][\w-]*>")


def gold_shown(passages: Iterable[str], golds: str | Iterable[str], question: str | None = None) -> str | None:
    """The first gold answer that occurs in the passages as evidence, or None.

    The match is :func:`retrieval_recall`'s (SQuAD-normalised, token-bounded). With the ``question``, a gold that
    it contains itself (:func:`golds_outside_question`: the options of "A or B?", a name the question repeats) is
    left out: finding it in a passage shows nothing. Markup tags in the text (the observation's own
    ``<information>…</information>``) are token boundaries. The one matcher of "was the gold shown" for the reader slice's
    rule, the coverage audit, the search slice, the training pool and the multi-search demonstrations.
    """
    golds = golds_outside_question(question, golds) if question is not None else \
        [g for g in _as_list(golds) if normalize_answer(g)]
    padded = [_padded(_MARKUP_RE.sub(" ", p)) for p in passages]
    return next((g for g in golds if any(f" {normalize_answer(g)} " in text for text in padded)), None)


def qa_reward(model_text: str, golds: str | Sequence[str]) -> float:
    """The search-task reward: exact match of the model's last ``<answer>`` (0.0 if none).

    Format reward is 0, as in the paper. ``model_text`` is what the model generated
    (``Trajectory.model_text``), not the prompt and not the observations (see the module docstring).
    """
    return exact_match(extract_answer(model_text), golds)


def qa_scores(
    model_text: str,
    golds: str | Sequence[str],
    passages: Iterable[str] | None = None,
    *,
    rule: AnswerRule = "search_r1",
) -> dict[str, float]:
    """All per-item QA metrics for one trajectory's ``model_text``: ``em``, ``f1``, ``cover_em``,
    ``has_answer`` and, when the retrieved passages are given, ``retrieval_recall``; the answer read by ``rule``
    (:func:`extract_answer`)."""
    pred = extract_answer(model_text, rule=rule)
    scores = {
        "em": exact_match(pred, golds),
        "f1": token_f1(pred, golds),
        "cover_em": cover_exact_match(pred, golds),
        "has_answer": float(pred is not None),
    }
    if passages is not None:
        scores["retrieval_recall"] = retrieval_recall(passages, golds)
    return scores
