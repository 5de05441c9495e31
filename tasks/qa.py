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

__all__ = [
    "normalize_answer",
    "find_tags",
    "extract_answer",
    "exact_match",
    "cover_exact_match",
    "token_f1",
    "retrieval_recall",
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


def extract_answer(text: str, *, paper_prompt_included: bool = False) -> str | None:
    """Content (stripped) of the last ``<answer>…</answer>`` in ``text``; ``None`` if absent.

    ``paper_prompt_included=True`` applies the paper's rule to prompt + response text: fewer
    than two matches gives ``None`` (the first is assumed to be the prompt's example).
    Matching is the paper's non-greedy DOTALL regex, so ``<answer><answer>x</answer>`` yields
    ``"<answer>x"`` and an unclosed ``<answer>`` yields nothing.
    """
    matches = [content for _, content in find_tags(text)]
    if len(matches) < (2 if paper_prompt_included else 1):
        return None
    return matches[-1].strip()


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


def retrieval_recall(passages: Iterable[str], golds: str | Iterable[str]) -> float:
    """1.0 if any retrieved passage contains a gold answer, else 0.0.

    Both sides are normalised and the match is token-bounded (``" 1 "`` in ``" 1 2 "``), which
    is stricter than FlashRAG's raw substring test: a one-digit gold would otherwise be found
    inside almost any passage.
    """
    golds = [g for g in (normalize_answer(x) for x in _as_list(golds)) if g]
    for passage in passages:
        padded = f" {normalize_answer(passage)} "
        if any(f" {g} " in padded for g in golds):
            return 1.0
    return 0.0


def gold_shown(passages: Iterable[str], golds: str | Iterable[str], question: str | None = None) -> str | None:
    """The first gold answer that occurs in the passages as evidence, or None.

    The match is :func:`retrieval_recall`'s (SQuAD-normalised, token-bounded). A gold that occurs in the
    ``question`` itself (token-bounded, normalised: the options of "A or B?", a name the question repeats)
    is left out: finding it in a passage shows nothing. The one matcher of "was the gold shown" for the
    coverage audit, the search slice, the training pool and the multi-search demonstrations.
    """
    asked = f" {normalize_answer(question)} " if question is not None else None
    golds = [g for g in _as_list(golds) if normalize_answer(g) and (asked is None or f" {normalize_answer(g)} " not in asked)]
    if not golds:
        return None
    padded = [f" {normalize_answer(p)} " for p in passages]
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
) -> dict[str, float]:
    """All per-item QA metrics for one trajectory's ``model_text``: ``em``, ``f1``, ``cover_em``,
    ``has_answer`` and, when the retrieved passages are given, ``retrieval_recall``."""
    pred = extract_answer(model_text)
    scores = {
        "em": exact_match(pred, golds),
        "f1": token_f1(pred, golds),
        "cover_em": cover_exact_match(pred, golds),
        "has_answer": float(pred is not None),
    }
    if passages is not None:
        scores["retrieval_recall"] = retrieval_recall(passages, golds)
    return scores
