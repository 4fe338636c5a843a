"""Text around the mechanism: tokenisation into words (identifiers whole), stop words,
streaming in pieces, UTF-8 decoding, and files.
"""

from __future__ import annotations

import codecs
import re
import sys
import unicodedata
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from fedcompress.privacy.sanitize.config import OOVPolicy
from fedcompress.privacy.sanitize.errors import InputEncodingError, OOVError

if TYPE_CHECKING:
    from fedcompress.privacy.sanitize.sanitizer import Sanitizer



def _mark_class() -> str:
    """Every combining mark (Unicode categories Mn, Mc, Me: Devanagari and Thai vowel signs,
    viramas, decomposed accents such as U+0301) plus the zero-width (non-)joiners U+200C/D, as
    the ranges of a regex character class. Python's ``\\w`` matches none of them, so without
    this a word's marks would fall between words and be copied to the output unchanged."""
    ranges: list[tuple[int, int]] = []
    for code in (*range(0x20000), *range(0xE0000, 0xE1000)):  # no marks elsewhere
        if unicodedata.category(chr(code)) in ("Mn", "Mc", "Me"):
            if ranges and ranges[-1][1] == code - 1:
                ranges[-1] = (ranges[-1][0], code)
            else:
                ranges.append((code, code))
    ranges += [(0x200C, 0x200D)]
    return "".join(f"\\U{a:08x}-\\U{b:08x}" for a, b in ranges)


assert sys.maxunicode == 0x10FFFF
MARKS = _mark_class()
_W = rf"[\w{MARKS}]"  # a word character: \w or a combining mark (a mark is never a separator)

WORD_PATTERN = rf"{_W}+(?:[-'’]{_W}+)*"
"""What a candidate looks like: letters, digits, ``_`` and combining marks joined by inner
``-``, ``'``, ``’`` (table words of another shape, such as ``3.5`` or ``google.com``, are
inputs, never outputs)."""

_URL_PATTERN = (r"(?:[A-Za-z][A-Za-z0-9+.-]*://|www\.)"
                r"[^\s<>\"'`()\[\]{}]*[^\s<>\"'`()\[\]{}.,;:!?]")
TOKEN_PATTERN = _URL_PATTERN + rf"|{_W}+(?:[-'’.:/@+]{_W}+)*"
"""What counts as a word of the input: a URL, or letters, digits, ``_`` and combining marks
joined by inner ``-``, ``'``, ``’``, ``.``, ``:``, ``/``, ``@`` or ``+`` (everything else is
copied unchanged). A combining mark is always part of a word, with the letters it modifies (a
mark with no letter before it is a word of its own, out of vocabulary), so it is drawn by the
mechanism with its word and never copied through; a word is looked up in its NFC form
(:func:`word_key`), so a decomposed ``e`` + U+0301 is the table's ``é``. No word contains
whitespace."""


def word_key(word: str, lowercase: bool) -> str:
    """A word's table key: NFC (composed accents), lower-cased if asked, ``’`` as ``'``."""
    key = unicodedata.normalize("NFC", word)
    if lowercase:
        key = key.lower()
    return key.replace("’", "'") if "’" in key else key

CHUNK_WORDS = 8192
"""Words sanitised per vectorised step (bounds the memory of a long text)."""


_WORD = re.compile(WORD_PATTERN)
_TOKEN = re.compile(TOKEN_PATTERN)
_SEPARATOR = re.compile(r"([-'’])")
_IDENTIFIER = re.compile(r"[\d.:/@+]")  # a word with one of these inside is never split
_UP_TO_LAST_SPACE = re.compile(r".*\s", re.DOTALL)
_NOT_CLITIC = re.compile(r"n['’]t$", re.IGNORECASE)
_CLITIC = re.compile(r"['’](?:s|re|ve|ll|d|m)$", re.IGNORECASE)

# Kinds of word occurrences.
_SENSITIVE, _COMMON, _STOP, _OOV = 0, 1, 2, 3


class _Run:
    """State of one sanitised document: buffered words of the current chunk and counts."""

    def __init__(self, sanitizer: Sanitizer, write: Callable[[str], Any], eps: float,
                 rng: np.random.Generator) -> None:
        self.s = sanitizer
        self.cfg = sanitizer.config
        self.write = write
        self.eps = eps
        self.rng = rng
        self.index = sanitizer.table.index
        self.stop = self.cfg.stopwords if self.cfg.keep_stopwords else frozenset()
        self.carry = ""      # the tail of the stream not yet tokenised (may continue a word)
        self.offset = 0      # characters of the stream before ``carry``
        self.parts: list[str] = []
        self.slots: list[int] = []   # index in parts of each word
        self.rows: list[int] = []    # table row (-1: out of vocabulary)
        self.kinds: list[int] = []
        self.clitic: list[bool] = []
        self.n_words = self.n_perturbed = self.n_kept = self.n_oov = self.n_changed = 0

    def feed(self, text: str, final: bool) -> None:
        buf = self.carry + text if self.carry else text
        if final:
            cut = len(buf)
        else:
            # no word spans whitespace, so everything up to the last whitespace tokenises the
            # same whatever follows; the rest waits for the next piece
            space = _UP_TO_LAST_SPACE.match(buf)
            cut = space.end() if space is not None else 0
        pos = 0
        for match in _TOKEN.finditer(buf, 0, cut):
            self._word(buf, pos, match)
            pos = match.end()
        self.parts.append(buf[pos:cut])
        self.carry = buf[cut:]
        self.offset += cut
        if final:
            self._flush()
        elif len(self.rows) >= CHUNK_WORDS:
            self._flush()

    def _word(self, buf: str, pos: int, match: re.Match[str]) -> None:
        parts = self.parts
        parts.append(buf[pos:match.start()])
        word = match.group()
        key = word_key(word, self.cfg.lowercase)
        if key in self.stop:
            self._add(word, -1, _STOP, False)
        elif (row := self.index.get(key)) is not None:
            self._add(word, row, _COMMON if row < self.cfg.common_words else _SENSITIVE, False)
        else:
            at = self.offset + match.start()  # stream offset of the piece
            for piece, is_word, is_clitic in self.s._split(word):
                at += len(piece)
                if not is_word:
                    parts.append(piece)
                    continue
                key = self.s._key(piece)
                row = self.index.get(key)
                if key in self.stop:
                    self._add(piece, -1, _STOP, is_clitic)
                elif row is None:
                    if self.cfg.oov is OOVPolicy.ERROR:
                        raise OOVError(piece, at - len(piece))
                    self._add(piece, -1, _OOV, is_clitic)
                else:
                    kind = _COMMON if row < self.cfg.common_words else _SENSITIVE
                    self._add(piece, row, kind, is_clitic)
        if len(self.rows) >= CHUNK_WORDS:
            self._flush()

    def _add(self, word: str, row: int, kind: int, clitic: bool) -> None:
        self.slots.append(len(self.parts))
        self.parts.append(word)
        self.rows.append(row)
        self.kinds.append(kind)
        self.clitic.append(clitic)

    def _flush(self) -> None:
        """Draw the outputs of the buffered words (vectorised) and write the text so far."""
        n = len(self.rows)
        if n:
            rows = np.asarray(self.rows, dtype=np.int64)
            kinds = np.asarray(self.kinds, dtype=np.int8)
            uniforms = self.rng.random((n, 2))  # (SanText+ coin, sample) per word, text order
            perturb = (kinds == _SENSITIVE) | ((kinds == _COMMON)
                                               & (uniforms[:, 0] < self.cfg.common_p))
            where = np.flatnonzero(perturb)
            chosen = self.s._sample(rows[where], uniforms[where, 1], self.eps)
            self.n_changed += int(np.count_nonzero(self.s.candidate_rows[chosen] != rows[where]))
            oov = np.flatnonzero(kinds == _OOV)
            if self.cfg.oov is OOVPolicy.RANDOM and len(oov):
                n_cand = len(self.s.candidate_rows)
                where = np.r_[where, oov]
                chosen = np.r_[chosen, np.minimum((uniforms[oov, 1] * n_cand).astype(np.int64),
                                                  n_cand - 1)]
            words = self.s.candidate_words
            same = self.s.candidate_rows[chosen] == rows[where]
            for i, c, unchanged in zip(where.tolist(), chosen.tolist(), same.tolist()):
                # a clitic replaced by another word becomes a word of its own
                spaced = self.clitic[i] and not unchanged
                self.parts[self.slots[i]] = (" " + words[c]) if spaced else words[c]
            n_perturbed = int(np.count_nonzero(perturb))
            self.n_words += n
            self.n_perturbed += n_perturbed
            self.n_oov += len(oov)
            self.n_kept += n - n_perturbed - len(oov)
        self.write("".join(self.parts))
        self.parts.clear()
        self.slots.clear()
        self.rows.clear()
        self.kinds.clear()
        self.clitic.clear()


def _decode(text: object) -> str:
    if isinstance(text, str):
        return text
    if isinstance(text, (bytes, bytearray, memoryview)):
        data = bytes(text)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as err:
            raise InputEncodingError(_encoding_message(data, err, 0)) from err
    raise TypeError(f"text must be str or UTF-8 bytes, got {type(text).__name__}")


def _decode_stream(pieces: Iterable[str | bytes]) -> Iterator[str]:
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    consumed = 0  # bytes given to the decoder before the current piece
    for piece in pieces:
        if isinstance(piece, str):
            yield piece
            continue
        data = bytes(_check_bytes(piece))
        pending = len(decoder.getstate()[0])
        try:
            yield decoder.decode(data)
        except UnicodeDecodeError as err:
            raise InputEncodingError(_encoding_message(err.object, err,
                                                       consumed - pending)) from err
        consumed += len(data)
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError as err:
        raise InputEncodingError(_encoding_message(err.object, err,
                                                   consumed - len(err.object))) from err


def _check_bytes(piece: object) -> bytes | bytearray | memoryview:
    if not isinstance(piece, (bytes, bytearray, memoryview)):
        raise TypeError(f"pieces must be str or UTF-8 bytes, got {type(piece).__name__}")
    return piece


def _encoding_message(data: bytes, err: UnicodeDecodeError, base: int) -> str:
    bad = data[err.start:err.end]
    return (f"text is not valid UTF-8: byte(s) {bad.hex(' ')} at byte offset {base + err.start} "
            f"({err.reason}); decode it with its real encoding and pass a str")
