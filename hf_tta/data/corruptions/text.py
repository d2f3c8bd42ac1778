"""The 15 text corruptions of COCO-C / Flickr-C (TCR §4.1, after Qiu et al. 2023, "MM_Robustness").

========  ======================  =============================================================  ===========
level     name                    generator                                                      severities
========  ======================  =============================================================  ===========
char      ``ocr``                 ``nlpaug.augmenter.char.OcrAug(aug_word_p=0.05*s)``            1..7
char      ``char_insert``         ``RandomCharAug("insert", aug_word_p=0.05*s)``                 1..7
char      ``char_replace``        ``RandomCharAug("substitute", aug_word_p=0.05*s)``             1..7
char      ``char_swap``           ``RandomCharAug("swap", aug_word_p=0.05*s)``                   1..7
char      ``char_delete``         ``RandomCharAug("delete", aug_word_p=0.05*s)``                 1..7
word      ``synonym_replacement`` EDA SR, ``alpha_sr=0.05*s`` (WordNet synonyms)                 1..7
word      ``random_insertion``    EDA RI, ``alpha_ri=0.05*s`` (inserts WordNet synonyms)         1..7
word      ``random_swap``         EDA RS, ``alpha_rs=0.05*s``                                    1..7
word      ``random_deletion``     EDA RD, ``p_rd=0.05*s``                                        1..7
word      ``insert_punctuation``  AEDA: 1..int(0.05*s*len+1) marks from ``. , ! ? ; :``          1..7
sentence  ``formal``              Styleformer casual→formal (T5, "transfer Casual to Formal: ")  1
sentence  ``casual``              Styleformer formal→casual                                      1
sentence  ``passive``             Styleformer active→passive                                     1
sentence  ``active``              Styleformer passive→active                                     1
sentence  ``back_translation``    en→de→en with two seq2seq translation models                   1
========  ======================  =============================================================  ===========

The benchmark reports char/word severity 7 and sentence severity 1 ("maximum severity").

What each level needs:

- char: the ``nlpaug`` package (``pip install 'hf_tta[data]'``).
- word: the synonym ops (``synonym_replacement``, ``random_insertion``) need the WordNet 3.0 database:
  ``apt-get install wordnet-base`` (Debian/Ubuntu; ``/usr/share/wordnet``), or nltk's ``wordnet`` data
  (``python -m nltk.downloader wordnet``), or a folder given with ``wordnet=`` / ``HF_TTA_WORDNET``.
- sentence: a seq2seq checkpoint per corruption, given with ``models={"formal": path_or_hub_id, ...}`` or
  :func:`register_text_model`; by default the benchmark's checkpoints (:data:`DEFAULT_TEXT_MODELS`) are tried,
  which works offline only when they are in the Hugging Face cache.

Optional "re-draw until similar enough" filter of the benchmark: pass ``similarity_fn(original, candidate) ->
float`` (e.g. cosine similarity of sentence-transformers ``paraphrase-mpnet-base-v2`` embeddings) and
``min_similarity`` (0.9 in the benchmark): the corruption is re-drawn up to ``max_tries`` times and the first
candidate that reaches the threshold is kept (the most similar one when none does).

Example:
    >>> corrupt_text("A train traveling down tracks next to a brick building.", "insert_punctuation", 7, seed=0)
    '? A train traveling down ? tracks next ! to ? a brick building.'
"""

from __future__ import annotations

import os
import random
import re
from typing import Any, Callable, Mapping, Sequence

from .base import MissingResourceError, bare_word, check_severity, derive_seed, seeded
from .seq2seq import DEFAULT_TEXT_MODELS, SENTENCE_CORRUPTIONS, sentence_corrupt, sentence_generators
from .wordnet import load_wordnet, synonyms

CHAR_CORRUPTIONS: tuple[str, ...] = ("ocr", "char_insert", "char_replace", "char_swap", "char_delete")
WORD_CORRUPTIONS: tuple[str, ...] = (
    "synonym_replacement",
    "random_insertion",
    "random_swap",
    "random_deletion",
    "insert_punctuation",
)
TEXT_CORRUPTIONS: tuple[str, ...] = CHAR_CORRUPTIONS + WORD_CORRUPTIONS + SENTENCE_CORRUPTIONS

#: Paper abbreviations (Table 6 of TCR).
TEXT_CORRUPTION_ABBREVIATIONS: dict[str, str] = {
    "ocr": "OCR",
    "char_insert": "CI",
    "char_replace": "CR",
    "char_swap": "CS",
    "char_delete": "CD",
    "synonym_replacement": "SR",
    "random_insertion": "RI",
    "random_swap": "RS",
    "random_deletion": "RD",
    "insert_punctuation": "IP",
    "formal": "Formal",
    "casual": "Casual",
    "passive": "Passive",
    "active": "Active",
    "back_translation": "Backtrans",
}

TEXT_CORRUPTION_LEVELS: dict[str, str] = {
    **{n: "char" for n in CHAR_CORRUPTIONS},
    **{n: "word" for n in WORD_CORRUPTIONS},
    **{n: "sentence" for n in SENTENCE_CORRUPTIONS},
}

#: The corruptions the similarity filter re-draws (TCR's benchmark: "the word-level and style corruptions"). Not the
#: character-level ones, and not back-translation, whose greedy decoding gives the same text on every draw.
REDRAWN_TEXT_CORRUPTIONS: frozenset[str] = frozenset(
    n for n in TEXT_CORRUPTIONS if TEXT_CORRUPTION_LEVELS[n] == "word" or (TEXT_CORRUPTION_LEVELS[n] == "sentence" and n != "back_translation")
)
TEXT_SEVERITIES: dict[str, tuple[int, ...]] = {
    n: ((1,) if TEXT_CORRUPTION_LEVELS[n] == "sentence" else tuple(range(1, 8))) for n in TEXT_CORRUPTIONS
}
#: "Maximum severity" of the benchmark tables: char/word 7, sentence 1.
MAX_TEXT_SEVERITY: dict[str, int] = {n: max(s) for n, s in TEXT_SEVERITIES.items()}
#: The severities of the released TCR text benchmark: char 1..7, word 6..7, sentence 1.
PAPER_TEXT_SEVERITIES: dict[str, tuple[int, ...]] = {
    n: {"char": tuple(range(1, 8)), "word": (6, 7), "sentence": (1,)}[TEXT_CORRUPTION_LEVELS[n]] for n in TEXT_CORRUPTIONS
}

PUNCTUATION_MARKS: tuple[str, ...] = (".", ",", "!", "?", ";", ":")

# EDA's stop-word list (Wei & Zou 2019): never replaced by a synonym.
STOP_WORDS = frozenset(
    """i me my myself we our ours ourselves you your yours yourself yourselves he him his himself she her hers herself
    it its itself they them their theirs themselves what which who whom this that these those am is are was were be
    been being have has had having do does did doing a an the and but if or because as until while of at by for with
    about against between into through during before after above below to from up down in out on off over under again
    further then once here there when where why how all any both each few more most other some such no nor not only
    own same so than too very s t can will just don should now""".split()
)


# ------------------------------------------------------------------------------------------------ char level
_CHAR_AUGMENTERS: dict[tuple[str, int], Any] = {}


def _char_augmenter(name: str, severity: int):
    key = (name, severity)
    if key not in _CHAR_AUGMENTERS:
        try:
            import nlpaug.augmenter.char as nac
        except ImportError as err:
            raise MissingResourceError(
                f"The character-level text corruption {name!r} needs `nlpaug`: `pip install 'hf_tta[data]'` or "
                f"`pip install nlpaug`. ({err})"
            ) from err
        p = 0.05 * severity
        if name == "ocr":
            aug = nac.OcrAug(aug_word_p=p)
        else:
            action = {"char_insert": "insert", "char_replace": "substitute", "char_swap": "swap", "char_delete": "delete"}[name]
            aug = nac.RandomCharAug(action=action, aug_word_p=p)
        _CHAR_AUGMENTERS[key] = aug
    return _CHAR_AUGMENTERS[key]


def _char_corrupt(text: str, name: str, severity: int) -> str:
    out = _char_augmenter(name, severity).augment(text)
    return out[0] if isinstance(out, list) else out


# ------------------------------------------------------------------------------------------------ word level (EDA)
_TRAILING = re.compile(r"^(.*?)([.!?]+)$")


def _split_words(text: str) -> tuple[list[str], str]:
    """Whitespace words, with the sentence-final punctuation detached (and re-attached after the operation)."""
    words = text.split()
    tail = ""
    if words:
        m = _TRAILING.match(words[-1])
        if m:
            tail = m.group(2)
            if m.group(1):
                words[-1] = m.group(1)
            else:
                words.pop()
    return words, tail


def _join_words(words: list[str], tail: str) -> str:
    return " ".join(words) + tail



def _synonym_replacement(words: list[str], n: int, wordnet) -> list[str]:
    new_words = words.copy()
    candidates = sorted({w for w in words if bare_word(w) not in STOP_WORDS and bare_word(w)})
    random.shuffle(candidates)
    replaced = 0
    for cand in candidates:
        syns = synonyms(wordnet, cand)
        if syns:
            choice = random.choice(syns)
            new_words = [choice if w == cand else w for w in new_words]
            replaced += 1
        if replaced >= n:
            break
    return " ".join(new_words).split()


def _random_insertion(words: list[str], n: int, wordnet) -> list[str]:
    new_words = words.copy()
    for _ in range(n):
        syns: list[str] = []
        for _try in range(10):
            syns = synonyms(wordnet, new_words[random.randint(0, len(new_words) - 1)])
            if syns:
                break
        if not syns:
            continue
        new_words.insert(random.randint(0, len(new_words) - 1), syns[0])
    return new_words


def _random_swap(words: list[str], n: int) -> list[str]:
    new_words = words.copy()
    for _ in range(n):
        if len(new_words) < 2:
            break
        i = random.randint(0, len(new_words) - 1)
        j = i
        for _try in range(4):
            j = random.randint(0, len(new_words) - 1)
            if j != i:
                break
        new_words[i], new_words[j] = new_words[j], new_words[i]
    return new_words


def _random_deletion(words: list[str], p: float) -> list[str]:
    if len(words) <= 1:
        return words
    kept = [w for w in words if random.uniform(0, 1) > p]
    return kept or [words[random.randint(0, len(words) - 1)]]


def _insert_punctuation(words: list[str], ratio: float) -> list[str]:
    """AEDA (Karimi et al. 2021): insert 1..int(ratio*len+1) marks at random positions."""
    if not words:
        return words
    q = random.randint(1, int(ratio * len(words) + 1))
    positions = set(random.sample(range(len(words)), min(q, len(words))))
    out = []
    for j, w in enumerate(words):
        if j in positions:
            out.append(PUNCTUATION_MARKS[random.randint(0, len(PUNCTUATION_MARKS) - 1)])
        out.append(w)
    return out


def _word_corrupt(text: str, name: str, severity: int, wordnet=None) -> str:
    alpha = 0.05 * severity
    if name == "insert_punctuation":
        # AEDA works on the whole token sequence, the final full stop included.
        return " ".join(_insert_punctuation(text.split(), alpha))
    words, tail = _split_words(text)
    if not words:
        return text
    n = max(1, int(alpha * len(words)))
    if name == "random_swap":
        return _join_words(_random_swap(words, n), tail)
    if name == "random_deletion":
        return _join_words(_random_deletion(words, alpha), tail)
    wn = wordnet if wordnet is not None and not isinstance(wordnet, (str, os.PathLike)) else load_wordnet(wordnet)
    if name == "synonym_replacement":
        return _join_words(_synonym_replacement(words, n, wn), tail)
    return _join_words(_random_insertion(words, n, wn), tail)


# ------------------------------------------------------------------------------------------------ public API
def _check(name: str, severity: int) -> int:
    if name not in TEXT_CORRUPTIONS:
        raise ValueError(f"Unknown text corruption {name!r}; choose from {list(TEXT_CORRUPTIONS)}.")
    return check_severity(name, severity, TEXT_SEVERITIES[name])


def _draw(text: str, name: str, severity: int, seed: int | None, wordnet, models, device, generate_kwargs) -> str:
    if not text.strip():
        return text  # no word to corrupt (nlpaug's augmenters fail on an empty string)
    level = TEXT_CORRUPTION_LEVELS[name]
    # Load what the corruption reads before seeding: importing nltk and loading models draw from the global RNGs, so
    # a first call that loaded them inside the seeded block would differ from every later call with the same seed.
    if level == "sentence":
        sentence_generators(name, models, device)  # cached
    elif name in ("synonym_replacement", "random_insertion") and (wordnet is None or isinstance(wordnet, (str, os.PathLike))):
        wordnet = load_wordnet(wordnet)
    with seeded(seed, torch_too=level == "sentence"):
        if level == "char":
            return _char_corrupt(text, name, severity)
        if level == "word":
            return _word_corrupt(text, name, severity, wordnet)
        return sentence_corrupt([text], name, models, device, generate_kwargs)[0]


def _filtered(
    original: str,
    draw: Callable[[int | None], str],
    seed: int | None,
    similarity_fn: Callable[[str, str], float] | None,
    min_similarity: float,
    max_tries: int,
) -> str:
    first = draw(seed)
    if similarity_fn is None:
        return first
    best, best_sim = first, float(similarity_fn(original, first))
    for attempt in range(1, max(1, max_tries)):
        if best_sim >= min_similarity:
            break
        cand = draw(None if seed is None else derive_seed(seed, "redraw", attempt))
        sim = float(similarity_fn(original, cand))
        if sim > best_sim:
            best, best_sim = cand, sim
    return best


def corrupt_text(
    text: str,
    name: str,
    severity: int,
    seed: int | None = None,
    *,
    wordnet: Any = None,
    models: Mapping[str, Any] | None = None,
    device: Any = None,
    generate_kwargs: Mapping[str, Any] | None = None,
    similarity_fn: Callable[[str, str], float] | None = None,
    min_similarity: float = 0.9,
    max_tries: int = 100,
) -> str:
    """Corrupt one caption.

    Args:
        text: the caption.
        name: one of :data:`TEXT_CORRUPTIONS`.
        severity: 1..7 for char- and word-level corruptions, 1 for sentence-level ones.
        seed: makes the result deterministic (``None``: the global ``random``/NumPy/torch RNGs).
        wordnet: a WordNet folder or nltk reader for the synonym ops (default: :func:`load_wordnet`).
        models: seq2seq checkpoints of the sentence-level corruptions, by name (see :func:`register_text_model`).
        device: where to run the seq2seq models.
        generate_kwargs: overrides of the ``generate`` settings of the sentence-level corruptions.
        similarity_fn, min_similarity, max_tries: the optional "re-draw until similar enough" filter; it applies to
            :data:`REDRAWN_TEXT_CORRUPTIONS` (word-level and style) and is ignored for the others.

    Returns:
        The corrupted caption; a caption with no word (empty or whitespace only) is returned unchanged.

    Raises:
        ValueError: for an unknown name or a severity outside the corruption's range.
        MissingResourceError: when WordNet, ``nlpaug`` or a seq2seq checkpoint is missing (says what to install).
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str; got {type(text).__name__}.")
    severity = _check(name, severity)

    def draw(s):
        return _draw(text, name, severity, s, wordnet, models, device, generate_kwargs)

    if name not in REDRAWN_TEXT_CORRUPTIONS:
        similarity_fn = None
    return _filtered(text, draw, seed, similarity_fn, min_similarity, max_tries)


def corrupt_texts(
    texts: Sequence[str],
    name: str,
    severity: int,
    seed: int | None = None,
    *,
    batch_size: int = 32,
    similarity_fn: Callable[[str, str], float] | None = None,
    min_similarity: float = 0.9,
    max_tries: int = 100,
    **kwargs,
) -> list[str]:
    """:func:`corrupt_text` on a batch; caption ``i`` uses the seed ``derive_seed(seed, i)``.

    Sentence-level corruptions without a similarity filter run batched (``batch_size`` captions per
    ``generate``, seeded with ``derive_seed(seed, "batch", start)``): deterministic for a given seed and batch size.
    """
    severity = _check(name, severity)
    texts = list(texts)
    bad = next((t for t in texts if not isinstance(t, str)), None)
    if bad is not None:
        raise TypeError(f"texts must be strs; got a {type(bad).__name__}.")
    if TEXT_CORRUPTION_LEVELS[name] == "sentence" and (similarity_fn is None or name not in REDRAWN_TEXT_CORRUPTIONS):
        sentence_generators(name, kwargs.get("models"), kwargs.get("device"))  # loaded before the seeded blocks
        out: list[str] = []
        for start in range(0, len(texts), batch_size):
            chunk = texts[start : start + batch_size]
            with seeded(None if seed is None else derive_seed(seed, "batch", start), torch_too=True):
                new = sentence_corrupt(chunk, name, kwargs.get("models"), kwargs.get("device"), kwargs.get("generate_kwargs"))
            out.extend(t if not t.strip() else n for t, n in zip(chunk, new))  # wordless captions stay unchanged
        return out
    return [
        corrupt_text(
            t,
            name,
            severity,
            None if seed is None else derive_seed(seed, i),
            similarity_fn=similarity_fn,
            min_similarity=min_similarity,
            max_tries=max_tries,
            **kwargs,
        )
        for i, t in enumerate(texts)
    ]


def text_corruption_requirements(name: str) -> str:
    """What a corruption needs, in words (for error messages and dataset cards)."""
    level = TEXT_CORRUPTION_LEVELS[name]
    if level == "char":
        return "nlpaug"
    if name in ("synonym_replacement", "random_insertion"):
        return "WordNet 3.0 (apt-get install wordnet-base, or nltk's wordnet data)"
    if level == "word":
        return "nothing"
    return f"a seq2seq checkpoint (default {DEFAULT_TEXT_MODELS[name]!r})"


def check_text_resources(
    names, wordnet: Any = None, models: Mapping[str, Any] | None = None, device: Any = None
) -> None:
    """Load what the text corruptions ``names`` need (nlpaug, WordNet, seq2seq checkpoints), so that a long build
    fails at once, not hours in.

    Raises:
        MissingResourceError: naming what to install or pass.
    """
    names = set(names)
    unknown = sorted(names - set(TEXT_CORRUPTIONS))
    if unknown:
        raise ValueError(f"Unknown text corruptions {unknown}; choose from {list(TEXT_CORRUPTIONS)}.")
    if any(TEXT_CORRUPTION_LEVELS[n] == "char" for n in names):
        _char_augmenter("ocr", 1)
    if names & {"synonym_replacement", "random_insertion"}:
        load_wordnet(wordnet)
    for n in sorted(names & set(SENTENCE_CORRUPTIONS)):
        sentence_generators(n, models, device)


def missing_text_resources(
    names, wordnet: Any = None, models: Mapping[str, Any] | None = None, device: Any = None
) -> dict[str, str]:
    """``{corruption: why}`` for every one of ``names`` whose resources do not load (:func:`check_text_resources`
    corruption by corruption, so that all of them are named, not only the first)."""
    missing = {}
    for name in sorted(set(names)):
        try:
            check_text_resources({name}, wordnet, models, device)
        except MissingResourceError as err:
            missing[name] = str(err)
    return missing


__all__ = [
    "CHAR_CORRUPTIONS",
    "MAX_TEXT_SEVERITY",
    "PAPER_TEXT_SEVERITIES",
    "REDRAWN_TEXT_CORRUPTIONS",
    "PUNCTUATION_MARKS",
    "SENTENCE_CORRUPTIONS",
    "TEXT_CORRUPTIONS",
    "TEXT_CORRUPTION_ABBREVIATIONS",
    "TEXT_CORRUPTION_LEVELS",
    "TEXT_SEVERITIES",
    "WORD_CORRUPTIONS",
    "check_text_resources",
    "corrupt_text",
    "corrupt_texts",
    "missing_text_resources",
    "text_corruption_requirements",
]
