"""Encoder: pooling against a direct transformers computation, explicit prefixes, order with sorting, packed rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from emapg.models import resolve_model
from retriever.encoder import Encoder, EncoderSpec, make_spec, resolve_precision
from retriever.packing import pack_rows

TEXTS = [
    "who got the first nobel prize in physics",
    '"Wilhelm Röntgen"\nWilhelm Conrad Röntgen was a German mechanical engineer and physicist who produced X-rays in 1895.',
    "a",
    "the capital of France is Paris, which is also its largest city",
]


@pytest.fixture(scope="module")
def minilm():
    from transformers import AutoModel, AutoTokenizer

    path = resolve_model("minilm")
    return AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path, dtype=torch.float32).eval()


def _reference(minilm, texts: list[str], pooling: str) -> np.ndarray:
    """One text at a time, no padding at all: what the batched, length-sorted encoder must equal."""
    tok, model = minilm
    out = []
    with torch.no_grad():
        for t in texts:
            b = tok([t], return_tensors="pt", truncation=True, max_length=256)
            h = model(**b).last_hidden_state[0]
            v = h[0] if pooling == "cls" else h.mean(0)
            out.append(torch.nn.functional.normalize(v, dim=-1).numpy())
    return np.stack(out)


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_pooling_matches_unpadded_reference_and_keeps_input_order(minilm, pooling):
    enc = Encoder(EncoderSpec(name="minilm", pooling=pooling), device="cpu")
    got = enc.encode(TEXTS, batch_size=3)  # sorted by length inside, padded per batch
    np.testing.assert_allclose(got, _reference(minilm, TEXTS, pooling), atol=2e-5)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    assert enc.encode([]).shape == (0, 384)


def test_prefixes_are_applied_explicitly(minilm):
    enc = Encoder(EncoderSpec(name="minilm", query_prefix="query: ", passage_prefix="passage: "), device="cpu")
    np.testing.assert_allclose(enc.encode_queries(TEXTS[:1]), enc.encode(["query: " + TEXTS[0]]), atol=1e-6)
    np.testing.assert_allclose(enc.encode_passages(TEXTS[1:2]), enc.encode(["passage: " + TEXTS[1]]), atol=1e-6)
    assert not np.allclose(enc.encode_queries(TEXTS[:1]), enc.encode(TEXTS[:1]), atol=1e-3)


def test_prefixes_come_from_exact_names_only():
    e5 = make_spec("intfloat/e5-base-v2")
    assert (e5.pooling, e5.query_prefix, e5.passage_prefix) == ("mean", "query: ", "passage: ")
    bge = make_spec("BAAI/bge-base-en-v1.5")
    assert bge.pooling == "cls" and bge.query_prefix.startswith("Represent this sentence") and bge.passage_prefix == ""
    # Search-R1 infers e5 prefixes from the substring "e5"; an unknown name gets none unless given.
    other = make_spec("someone/my-e5-small-finetune", pooling="mean")
    assert (other.query_prefix, other.passage_prefix) == ("", "")
    explicit = make_spec("someone/my-e5-small-finetune", pooling="mean", query_prefix="query: ", passage_prefix="passage: ")
    assert (explicit.query_prefix, explicit.passage_prefix) == ("query: ", "passage: ")
    assert make_spec(resolve_model("minilm")).pooling == "mean"  # a folder: its sentence-transformers config
    with pytest.raises(ValueError, match="pooling"):
        make_spec("minilm", pooling="max")


def test_fp16_on_cpu_is_refused():
    with pytest.raises(ValueError, match="only supported on GPU"):
        Encoder(EncoderSpec(name="minilm"), device="cpu", fp16=True)


def test_precision_is_bf16_by_default_only_on_a_cpu_with_native_bf16_and_explicit_choices_are_honoured():
    # the detector's answer injected: the suite pins kernels to AVX2, where emapg.cpu.cpu_has_bf16() is False
    for native in (True, False):
        assert resolve_precision(False, native_cpu_bf16=native) == ("bfloat16" if native else "float32")
        assert resolve_precision(False, bf16=False, native_cpu_bf16=native) == "float32"  # --no-bf16: fp32
        assert resolve_precision(False, bf16=True, native_cpu_bf16=native) == "bfloat16"  # asked for: honoured
        assert resolve_precision(False, fp16=False, native_cpu_bf16=native) == ("bfloat16" if native else "float32")
        assert resolve_precision(True, native_cpu_bf16=native) == "float16"  # GPU: fp16, whatever the CPU
        assert resolve_precision(True, bf16=False, native_cpu_bf16=native) == "float16"
        assert resolve_precision(True, fp16=False, native_cpu_bf16=native) == "float32"  # --no-fp16 on GPU: fp32
        assert resolve_precision(True, bf16=True, native_cpu_bf16=native) == "bfloat16"
        with pytest.raises(ValueError, match="only supported on GPU"):
            resolve_precision(False, fp16=True, native_cpu_bf16=native)
        with pytest.raises(ValueError, match="fp16 or bf16"):
            resolve_precision(True, fp16=True, bf16=True, native_cpu_bf16=native)


def test_bf16_on_cpu_is_close_to_fp32_and_keeps_the_ranking(retriever_index):
    from emapg.cpu import cpu_has_bf16
    from retriever.searcher import Searcher

    assert Encoder(EncoderSpec(name="minilm"), device="cpu").dtype == ("bfloat16" if cpu_has_bf16() else "float32")  # the default
    fp32 = Encoder(EncoderSpec(name="minilm"), device="cpu", bf16=False)
    bf16 = Encoder(EncoderSpec(name="minilm"), device="cpu", bf16=True)
    assert (fp32.dtype, bf16.dtype) == ("float32", "bfloat16")
    cos = np.sum(fp32.encode(TEXTS) * bf16.encode(TEXTS), axis=1)
    assert cos.min() > 0.999
    questions = [q["question"] for q in retriever_index.questions[:50]]
    a = Searcher(retriever_index.index_dir, device="cpu", bf16=False).retrieve(questions, 1)
    b = Searcher(retriever_index.index_dir, device="cpu", bf16=True).retrieve(questions, 1)
    assert np.mean([x[0]["id"] == y[0]["id"] for x, y in zip(a, b)]) >= 0.95
    with pytest.raises(ValueError, match="fp16 or bf16"):
        Encoder(EncoderSpec(name="minilm"), device="cpu", fp16=True, bf16=True)


@pytest.mark.parametrize("bf16", [False, True])
def test_batch_invariant_vectors_depend_on_the_text_alone(retriever_index, bf16):
    """batch_invariant: a text's vector is bit-identical alone and in any batch, order, batch size or split. Without
    it, packed batches round differently with their company (the reason for the option, checked here too)."""
    texts = [q["question"] for q in retriever_index.questions[:24]] + TEXTS
    spec = EncoderSpec(name="minilm")
    invariant = Encoder(spec, device="cpu", bf16=bf16, threads=2, batch_invariant=True)
    alone = np.concatenate([invariant.encode([t]) for t in texts])
    rng = np.random.default_rng(0)
    for batch_size, parts in ((64, None), (5, 2), (3, 1)):
        perm = rng.permutation(len(texts))
        got = invariant.encode([texts[i] for i in perm], batch_size=batch_size, parts=parts)[np.argsort(perm)]
        assert np.array_equal(got, alone), (bf16, batch_size, parts)
    default = Encoder(spec, device="cpu", bf16=bf16, threads=2)
    assert np.array_equal(np.concatenate([default.encode([t]) for t in texts]), alone)  # the default, one text at a time
    batched = default.encode(texts, batch_size=64)
    assert not np.array_equal(batched, alone)  # company moves some vectors in their last bits
    cos = np.sum(batched * alone, axis=1)
    assert cos.min() > 0.999


def test_pack_rows_places_every_text_once_in_as_few_and_as_narrow_rows_as_it_can():
    lengths = [12, 3, 40, 7, 7, 25, 1, 64, 9, 100]
    for row_tokens in (1, 16, 64, 128, 1000):
        rows = pack_rows(lengths, row_tokens)
        assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
        assert max(sum(lengths[i] for i in row) for row in rows) <= max(row_tokens, max(lengths))
        assert sum(lengths) <= len(rows) * max(row_tokens, max(lengths)) < sum(lengths) + max(row_tokens, max(lengths))
    assert pack_rows(lengths, 1)[0][0] == 9  # the longest text sets the width and goes first
    # 16 texts of 12 tokens: rows of 64 would hold 5, 5, 5 and 1 (4 x 60 slots); balanced: 4 rows of 4 (4 x 48).
    assert sorted(len(row) for row in pack_rows([12] * 16, 64)) == [4, 4, 4, 4]
    assert len(pack_rows([10] * 32, 64)) == 6  # six fit in a 64-token row: 32 texts need 6 rows


@pytest.mark.parametrize("pooling", ["mean", "cls"])
@pytest.mark.parametrize("row_tokens", [1, 24, 64, 512])
def test_packed_forward_equals_padded_forward(pooling, row_tokens):
    """Texts packed into shared rows get the embeddings of a padded forward (which equals unpadded, above)."""
    texts = [t for _ in range(3) for t in TEXTS] + [f"question number {i} about " + "history " * (i % 9) for i in range(40)]
    padded = Encoder(EncoderSpec(name="minilm", pooling=pooling), device="cpu", pack=False)
    packed = Encoder(EncoderSpec(name="minilm", pooling=pooling), device="cpu", row_tokens=row_tokens)
    assert packed.packed and packed.traced and not padded.packed  # on CPU the packed forward runs traced
    for batch_size in (1, 7, 64):
        np.testing.assert_allclose(packed.encode(texts, batch_size=batch_size), padded.encode(texts, batch_size=batch_size), atol=1e-5)


def test_a_trace_that_fails_on_a_later_batch_falls_back_to_the_eager_forward(caplog):
    """The trace is checked on probe texts at load; a kernel it picks on a later batch can still fail (seen: bf16
    under ATEN_CPU_CAPABILITY=avx2 on an AVX-512 CPU). That batch and every later one run eagerly, nothing lost."""
    texts = [f"question number {i} about " + "history " * (i % 9) for i in range(20)]
    enc = Encoder(EncoderSpec(name="minilm"), device="cpu")
    assert enc.traced
    want = enc.encode(texts, batch_size=8)

    def broken(inputs):
        raise RuntimeError("pack_vnni2 is only supported when avx512 is supported")

    enc._packed_forwards = [broken for _ in enc.models]
    with caplog.at_level("WARNING", logger="retriever.encoder"):
        got = enc.encode(texts, batch_size=8)
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert not enc.traced and "the traced forward failed (RuntimeError: pack_vnni2" in caplog.text
    enc._packed_forwards = [broken for _ in enc.models]  # untraced now: a failing eager forward is raised, not retried
    with pytest.raises(RuntimeError, match="pack_vnni2"):
        enc.encode(texts[:2])


def test_packing_falls_back_to_padding_for_a_model_that_offsets_positions(tmp_path, minilm):
    """RoBERTa numbers positions from padding_idx + 1, so packed position ids 0.. would be wrong: detected at load."""
    from transformers import RobertaConfig, RobertaModel

    tok, _ = minilm
    torch.manual_seed(0)
    config = RobertaConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=64, max_position_embeddings=300, pad_token_id=tok.pad_token_id)  # fmt: skip
    RobertaModel(config).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    enc = Encoder(EncoderSpec(name=str(tmp_path)), device="cpu")
    assert not enc.packed
    forced = Encoder(EncoderSpec(name=str(tmp_path)), device="cpu", pack=False)
    np.testing.assert_allclose(enc.encode(TEXTS, batch_size=3), forced.encode(TEXTS, batch_size=3), atol=1e-6)
    with torch.inference_mode():  # the check is not vacuous: forcing the packed forward really differs
        feats = {k: list(v) for k, v in enc.tokenizer(TEXTS, truncation=True, max_length=256).items()}
        wrong = enc._forward_packed(0, feats)
    assert not np.allclose(wrong, forced.encode(TEXTS, batch_size=64), atol=1e-3)
