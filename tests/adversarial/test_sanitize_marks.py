"""Attack: read a site's private text through the combining marks the sanitizer lets through.

Python's ``\\w`` matches no combining mark (Unicode Mn/Mc/Me), so a tokenizer built on it cuts
``मधुमेह`` into ``म``, ``ध``, ``म``, ``ह`` with the vowel signs ``ु``, ``े`` BETWEEN words, and
everything between words was copied to the output unchanged: a reader of the sanitized text
saw the vowel signs (Devanagari, Thai) and the decomposed accents (``e`` + U+0301) of every
word, in order. Now a mark is part of the word it follows (the whole word goes through the
mechanism) and a word is looked up in NFC. These tests sanitize such texts as a site would and
check that no input mark reaches the output unchanged.
"""

from __future__ import annotations

import re
import unicodedata

import numpy as np
import pytest

from fedcompress.data.embeddings import EmbeddingTable
from fedcompress.privacy.sanitize import TOKEN_PATTERN, WORD_PATTERN, Sanitizer, SanitizerConfig

WORDS = ["the", "of", "cat", "dog", "lion", "car", "bus", "train", "paris", "london", "café",
         "naïve"]
MARK_CATEGORIES = ("Mn", "Mc", "Me")


def _table() -> EmbeddingTable:
    rng = np.random.default_rng(0)
    return EmbeddingTable(tuple(WORDS), rng.normal(size=(len(WORDS), 4)).astype(np.float32),
                          source="marks")


@pytest.fixture(scope="module")
def sanitizer() -> Sanitizer:
    return Sanitizer(_table(), SanitizerConfig())


def _marks(text: str) -> list[str]:
    return [c for c in text if unicodedata.category(c) in MARK_CATEGORIES]


DEVANAGARI = "रोगी को मधुमेह है और उसकी दवा इंसुलिन है"
THAI = "ผู้ป่วยเป็นโรคเบาหวาน และได้รับยาอินซูลิน"
DECOMPOSED = "The patient in Pa\u0301ris drinks cafe\u0301 with a nai\u0308ve friend"


@pytest.mark.parametrize("text", [DEVANAGARI, THAI, DECOMPOSED],
                         ids=["devanagari", "thai", "decomposed-latin"])
def test_no_combining_mark_passes_through(sanitizer, text):
    assert _marks(text), "the attack text must hold combining marks"
    for seed in range(5):
        out = sanitizer.sanitize(text, eps=1.0, seed=seed).text
        leaked = _marks(out)
        assert not leaked, f"marks copied to the output: {leaked!r} in {out!r}"


def test_devanagari_words_are_drawn_whole(sanitizer):
    """The 9 words of the Devanagari text are 9 words for the mechanism (not 30+ letters with
    vowel signs between them), and every one is replaced (out of vocabulary: a uniform
    candidate), so the output is 9 table words and the spaces."""
    result = sanitizer.sanitize(DEVANAGARI, eps=1.0, seed=0)
    assert result.report.n_words == len(DEVANAGARI.split()) == 9
    assert all(w in WORDS for w in result.text.split(" ")), result.text
    assert result.text.count(" ") == DEVANAGARI.count(" ")


def test_decomposed_accent_is_the_tables_composed_word():
    """``cafe`` + U+0301 is looked up as the table's ``café`` (NFC): with a huge epsilon the
    mechanism keeps it, written as the table word (composed), never with the input's mark."""
    sanitizer = Sanitizer(_table(), SanitizerConfig(common_words=0))
    out = sanitizer.sanitize("cafe\u0301", eps=200.0, seed=1).text
    assert out == "café" and "\u0301" not in out


def test_a_lone_mark_is_a_word_not_a_separator(sanitizer):
    """A mark with no letter before it (start of text, after a space or punctuation) is a
    word of its own, out of vocabulary, replaced: never copied."""
    for text in ("\u0301 cat", "cat \u093f\u0947 dog", "(\u0e49)", "\u20dd"):
        out = sanitizer.sanitize(text, eps=1.0, seed=0).text
        assert not _marks(out), (text, out)


def test_every_combining_mark_is_inside_a_token():
    """Exhaustive over Unicode: each combining mark after a letter, alone, and the zero-width
    joiners sit inside one token; candidates may hold marks (a table word ``naïve``
    decomposed)."""
    token = re.compile(TOKEN_PATTERN)
    marks = [chr(c) for c in range(0x110000)
             if unicodedata.category(chr(c)) in MARK_CATEGORIES] + ["\u200c", "\u200d"]
    assert len(marks) > 2000
    for mark in marks:
        assert token.fullmatch("a" + mark + "b"), hex(ord(mark))
        assert token.fullmatch(mark), hex(ord(mark))
    assert re.fullmatch(WORD_PATTERN, unicodedata.normalize("NFD", "naïve"))
