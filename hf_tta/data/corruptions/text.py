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
import threading
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from ._utils import check_severity, derive_seed, seeded

CHAR_CORRUPTIONS: tuple[str, ...] = ("ocr", "char_insert", "char_replace", "char_swap", "char_delete")
WORD_CORRUPTIONS: tuple[str, ...] = (
    "synonym_replacement",
    "random_insertion",
    "random_swap",
    "random_deletion",
    "insert_punctuation",
)
SENTENCE_CORRUPTIONS: tuple[str, ...] = ("formal", "casual", "passive", "active", "back_translation")
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
TEXT_SEVERITIES: dict[str, tuple[int, ...]] = {
    n: ((1,) if TEXT_CORRUPTION_LEVELS[n] == "sentence" else tuple(range(1, 8))) for n in TEXT_CORRUPTIONS
}
#: "Maximum severity" of the benchmark tables: char/word 7, sentence 1.
MAX_TEXT_SEVERITY: dict[str, int] = {n: max(s) for n, s in TEXT_SEVERITIES.items()}
#: The severities of the released TCR text benchmark: char 1..7, word 6..7, sentence 1.
PAPER_TEXT_SEVERITIES: dict[str, tuple[int, ...]] = {
    n: {"char": tuple(range(1, 8)), "word": (6, 7), "sentence": (1,)}[TEXT_CORRUPTION_LEVELS[n]] for n in TEXT_CORRUPTIONS
}

#: The checkpoints the benchmark used (Styleformer and fairseq WMT19 via nlpaug). Tried when no model is given.
DEFAULT_TEXT_MODELS: dict[str, Any] = {
    "formal": "prithivida/informal_to_formal_styletransfer",
    "casual": "prithivida/formal_to_informal_styletransfer",
    "passive": "prithivida/active_to_passive_styleformer",
    "active": "prithivida/passive_to_active_styleformer",
    "back_translation": ("facebook/wmt19-en-de", "facebook/wmt19-de-en"),
}
#: Styleformer's task prefixes.
STYLE_PREFIXES: dict[str, str] = {
    "formal": "transfer Casual to Formal: ",
    "casual": "transfer Formal to Casual: ",
    "passive": "transfer Active to Passive: ",
    "active": "transfer Passive to Active: ",
}
#: Styleformer's sampling settings for the style models.
STYLE_GENERATE_KWARGS: dict[str, Any] = {"do_sample": True, "top_k": 50, "top_p": 0.95, "max_length": 32}
BACK_TRANSLATION_GENERATE_KWARGS: dict[str, Any] = {"max_new_tokens": 128}

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


class MissingResourceError(RuntimeError):
    """A corruption needs data or a model that is not available here; the message says what to install."""


# ------------------------------------------------------------------------------------------------ char level
_CHAR_AUGMENTERS: dict[tuple[str, int], Any] = {}
_LOCK = threading.Lock()


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


# ------------------------------------------------------------------------------------------------ WordNet
_LEXNAMES = (
    "adj.all adj.pert adv.all noun.Tops noun.act noun.animal noun.artifact noun.attribute noun.body noun.cognition "
    "noun.communication noun.event noun.feeling noun.food noun.group noun.location noun.motive noun.object noun.person "
    "noun.phenomenon noun.plant noun.possession noun.process noun.quantity noun.relation noun.shape noun.state "
    "noun.substance noun.time verb.body verb.change verb.cognition verb.communication verb.competition "
    "verb.consumption verb.contact verb.creation verb.emotion verb.motion verb.perception verb.possession verb.social "
    "verb.stative verb.weather adj.ppl"
).split()
_LEX_POS = {"adj": 3, "adv": 4, "noun": 1, "verb": 2}
_WORDNET_FILES = tuple(f"{k}.{p}" for k in ("index", "data") for p in ("noun", "verb", "adj", "adv"))
#: Folders searched for a WordNet database after ``HF_TTA_WORDNET`` and nltk's data dirs.
WORDNET_SYSTEM_DIRS: tuple[str, ...] = ("/usr/share/wordnet", "/usr/local/share/wordnet", "/usr/share/wordnet/dict")
_WORDNET: Any = None
_WORDNET_BY_PATH: dict[str, Any] = {}
_WORDNET_SOURCE: str | None = None

WORDNET_INSTALL_HINT = (
    "Install the WordNet 3.0 database with `apt-get install wordnet-base` (Debian/Ubuntu, files in /usr/share/wordnet), "
    "or `python -m nltk.downloader wordnet` (nltk data), or point the HF_TTA_WORDNET environment variable (or the "
    "`wordnet=` argument) at a WordNet dict folder (with index.noun, data.noun, ...)."
)


def _wordnet_reader_class():
    from nltk.corpus.reader.wordnet import WordNetCorpusReader

    class LocalWordNetReader(WordNetCorpusReader):
        """nltk's reader without the multilingual (OMW) version mapping, which needs nltk's own data files."""

        def map_wn(self, version="wordnet"):
            return None

    return LocalWordNetReader


def _allow_nltk_root(folder: Path) -> None:
    import nltk.data

    # nltk >= 3.9 refuses to read outside its data roots ("Security Violation"): add the folder as a root.
    if str(folder) not in [str(p) for p in nltk.data.path]:
        nltk.data.path.append(str(folder))


def _stage_folder(folder: Path) -> Path:
    """A copy of a WordNet folder that lacks nltk's ``lexnames`` file (Debian's ``wordnet-base``), with it added."""
    from ._utils import derive_seed as _digest

    cache = Path(os.environ.get("HF_TTA_CACHE", Path.home() / ".cache" / "hf_tta")) / "wordnet"
    target = cache / f"{folder.name}-{_digest(str(folder.resolve())):08x}"
    if (target / "lexnames").is_file():
        return target
    import shutil
    import tempfile

    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cache, prefix=".staging-"))
    for f in folder.iterdir():
        if f.is_file():
            shutil.copyfile(f, tmp / f.name)
    (tmp / "lexnames").write_text(
        "".join(f"{i:02d}\t{n}\t{_LEX_POS[n.split('.')[0]]}\n" for i, n in enumerate(_LEXNAMES)), encoding="utf-8"
    )
    try:
        tmp.rename(target)
    except OSError:  # another process staged it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _read_wordnet_folder(folder: Path):
    missing = [f for f in _WORDNET_FILES if not (folder / f).is_file()]
    if missing:
        raise MissingResourceError(f"{folder} is not a WordNet dict folder: it lacks {missing}. {WORDNET_INSTALL_HINT}")
    if not (folder / "lexnames").is_file():
        folder = _stage_folder(folder)
    _allow_nltk_root(folder)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "The multilingual functions are not available with this Wordnet version"
        return _wordnet_reader_class()(str(folder), None)


def load_wordnet(path: str | os.PathLike | None = None):
    """An nltk WordNet reader from ``path``, ``$HF_TTA_WORDNET``, nltk's data dirs or a system folder (cached).

    Raises:
        MissingResourceError: when no WordNet database is found; the message says what to install.
    """
    global _WORDNET, _WORDNET_SOURCE
    if path is None and _WORDNET is not None:
        return _WORDNET
    if path is not None and str(path) in _WORDNET_BY_PATH:
        return _WORDNET_BY_PATH[str(path)]
    try:
        import nltk  # noqa: F401
        import nltk.data
    except ImportError as err:
        raise MissingResourceError(
            f"The WordNet-based text corruptions need `nltk`: `pip install 'hf_tta[data]'` or `pip install nltk`. ({err})"
        ) from err
    if path is not None:
        reader = _read_wordnet_folder(Path(path))
        _WORDNET_BY_PATH[str(path)] = reader
        return reader
    searched = []
    env = os.environ.get("HF_TTA_WORDNET")
    if env:
        reader, source = _read_wordnet_folder(Path(env)), env
    else:
        reader = source = None
        for res in ("corpora/wordnet", "corpora/wordnet.zip/wordnet/"):
            try:
                root = nltk.data.find(res)
            except LookupError:
                searched.append(f"nltk data '{res}'")
                continue
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                reader, source = _wordnet_reader_class()(root, None), str(root)
            break
        if reader is None:
            for d in WORDNET_SYSTEM_DIRS:
                if all((Path(d) / f).is_file() for f in _WORDNET_FILES):
                    reader, source = _read_wordnet_folder(Path(d)), d
                    break
                searched.append(d)
    if reader is None:
        raise MissingResourceError(
            "The word-level synonym corruptions (synonym_replacement, random_insertion) need WordNet, and none was "
            f"found (searched: HF_TTA_WORDNET, {', '.join(searched)}). {WORDNET_INSTALL_HINT}"
        )
    _WORDNET, _WORDNET_SOURCE = reader, source
    return reader


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


def _bare(word: str) -> str:
    return re.sub(r"[^a-z]", "", word.lower())


def _synonyms(wordnet, word: str, cache: dict) -> list[str]:
    """EDA's ``get_synonyms``, sorted so that a seed gives the same choice in every process."""
    word = _bare(word)
    if not word:
        return []
    if word not in cache:
        syns = set()
        for syn in wordnet.synsets(word):
            for lemma in syn.lemmas():
                s = lemma.name().replace("_", " ").replace("-", " ").lower()
                s = "".join(ch for ch in s if ch in " qwertyuiopasdfghjklzxcvbnm").strip()
                if s:
                    syns.add(s)
        syns.discard(word)
        cache[word] = sorted(syns)
    return cache[word]


_SYN_CACHE: dict[str, list[str]] = {}


def _synonym_replacement(words: list[str], n: int, wordnet) -> list[str]:
    new_words = words.copy()
    candidates = sorted({w for w in words if _bare(w) not in STOP_WORDS and _bare(w)})
    random.shuffle(candidates)
    replaced = 0
    for cand in candidates:
        syns = _synonyms(wordnet, cand, _SYN_CACHE)
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
            syns = _synonyms(wordnet, new_words[random.randint(0, len(new_words) - 1)], _SYN_CACHE)
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


# ------------------------------------------------------------------------------------------------ sentence level
_TEXT_MODELS: dict[str, Any] = {}
_LOADED: dict[tuple, "Seq2SeqGenerator"] = {}


def register_text_model(name: str, model: Any) -> None:
    """Set the seq2seq model of a sentence-level corruption for this process.

    ``model`` is a checkpoint path or Hub id, a ``(model, tokenizer)`` pair or a :class:`Seq2SeqGenerator`; for
    ``back_translation`` a pair ``(en→de, de→en)`` of those. ``None`` removes the registration.
    """
    if name not in SENTENCE_CORRUPTIONS:
        raise ValueError(f"Only sentence-level corruptions take a model: {list(SENTENCE_CORRUPTIONS)}; got {name!r}.")
    if model is None:
        _TEXT_MODELS.pop(name, None)
    else:
        _TEXT_MODELS[name] = model


def clear_text_model_cache() -> None:
    """Forget the loaded seq2seq models."""
    _LOADED.clear()


class Seq2SeqGenerator:
    """A seq2seq model + tokenizer that maps a batch of strings to a batch of strings."""

    def __init__(self, model, tokenizer, device=None):
        self.model = model.eval()
        self.tokenizer = tokenizer
        if device is not None:
            self.model.to(device)

    @classmethod
    def from_pretrained(cls, spec: str | os.PathLike, device=None, purpose: str = "") -> "Seq2SeqGenerator":
        try:
            import torch
            from transformers import AutoModelForSeq2SeqLM, AutoTokenizer
        except ImportError as err:  # pragma: no cover
            raise MissingResourceError(f"{purpose} needs `transformers` and `torch`. ({err})") from err
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(spec))
            model = AutoModelForSeq2SeqLM.from_pretrained(str(spec), dtype=torch.float32)
        except (OSError, ValueError, ImportError) as err:
            raise MissingResourceError(
                f"{purpose} could not load the seq2seq checkpoint {str(spec)!r}: {type(err).__name__}: "
                f"{str(err).splitlines()[0] if str(err) else ''}. Give a local checkpoint directory or a Hub id that "
                "is in your Hugging Face cache (download it first, e.g. `hf download <id>`, when offline)."
            ) from err
        return cls(model, tokenizer, device)

    @property
    def device(self):
        return next(self.model.parameters()).device

    def __call__(self, texts: Sequence[str], prefix: str = "", **generate_kwargs) -> list[str]:
        import torch

        enc = self.tokenizer([prefix + t for t in texts], return_tensors="pt", padding=True, truncation=True)
        enc = {k: v.to(self.device) for k, v in enc.items() if k in ("input_ids", "attention_mask")}
        with torch.no_grad():
            out = self.model.generate(**enc, **generate_kwargs)
        return [s.strip() for s in self.tokenizer.batch_decode(out, skip_special_tokens=True)]


def _resolve_generator(spec: Any, name: str, device, role: str = "") -> Seq2SeqGenerator:
    if isinstance(spec, Seq2SeqGenerator):
        return spec
    if isinstance(spec, (tuple, list)) and len(spec) == 2 and not isinstance(spec[0], (str, os.PathLike)):
        return Seq2SeqGenerator(spec[0], spec[1], device)
    key = (str(spec), str(device))
    if key not in _LOADED:
        purpose = f"The sentence-level text corruption {name!r}{role}"
        with _LOCK:
            if key not in _LOADED:
                _LOADED[key] = Seq2SeqGenerator.from_pretrained(spec, device, purpose)
    return _LOADED[key]


def _model_spec(name: str, models: Mapping[str, Any] | None) -> Any:
    if models and name in models:
        return models[name]
    if name in _TEXT_MODELS:
        return _TEXT_MODELS[name]
    return DEFAULT_TEXT_MODELS[name]


def _missing_model_error(name: str, err: Exception) -> MissingResourceError:
    default = DEFAULT_TEXT_MODELS[name]
    how = (
        "models={'back_translation': (en_de_path, de_en_path)}" if name == "back_translation" else f"models={{{name!r}: path}}"
    )
    return MissingResourceError(
        f"{err} The benchmark used {default!r}. Pass your own checkpoint(s) with `{how}` (any Hugging Face seq2seq "
        f"model; {'translation models' if name == 'back_translation' else 'Styleformer-style T5 prompted with ' + repr(STYLE_PREFIXES[name])}), "
        f"or `register_text_model({name!r}, ...)`."
    )


def sentence_generators(name: str, models: Mapping[str, Any] | None = None, device=None) -> list[Seq2SeqGenerator]:
    """The loaded generator(s) of a sentence-level corruption (two for back-translation); raises a clear error."""
    spec = _model_spec(name, models)
    try:
        if name == "back_translation":
            if isinstance(spec, Mapping):
                spec = (spec["forward"], spec["backward"])
            if not isinstance(spec, (tuple, list)) or len(spec) != 2:
                raise MissingResourceError("back_translation needs two models: (en→de, de→en).")
            return [
                _resolve_generator(spec[0], name, device, " (en→de)"),
                _resolve_generator(spec[1], name, device, " (de→en)"),
            ]
        return [_resolve_generator(spec, name, device)]
    except MissingResourceError as err:
        raise _missing_model_error(name, err) from err


def _sentence_corrupt(
    texts: Sequence[str], name: str, models=None, device=None, generate_kwargs: Mapping[str, Any] | None = None
) -> list[str]:
    gens = sentence_generators(name, models, device)
    if name == "back_translation":
        kw = {**BACK_TRANSLATION_GENERATE_KWARGS, **(generate_kwargs or {})}
        return gens[1](gens[0](texts, **kw), **kw)
    kw = {**STYLE_GENERATE_KWARGS, **(generate_kwargs or {})}
    if "max_new_tokens" in kw:
        kw.pop("max_length", None)
    return gens[0](texts, prefix=STYLE_PREFIXES[name], **kw)


# ------------------------------------------------------------------------------------------------ public API
def _check(name: str, severity: int) -> int:
    if name not in TEXT_CORRUPTIONS:
        raise ValueError(f"Unknown text corruption {name!r}; choose from {list(TEXT_CORRUPTIONS)}.")
    return check_severity(name, severity, TEXT_SEVERITIES[name])


def _draw(text: str, name: str, severity: int, seed: int | None, wordnet, models, device, generate_kwargs) -> str:
    level = TEXT_CORRUPTION_LEVELS[name]
    with seeded(seed, torch_too=level == "sentence"):
        if level == "char":
            return _char_corrupt(text, name, severity)
        if level == "word":
            return _word_corrupt(text, name, severity, wordnet)
        return _sentence_corrupt([text], name, models, device, generate_kwargs)[0]


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
        similarity_fn, min_similarity, max_tries: the optional "re-draw until similar enough" filter.

    Raises:
        MissingResourceError: when WordNet, ``nlpaug`` or a seq2seq checkpoint is missing (says what to install).
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str; got {type(text).__name__}.")
    severity = _check(name, severity)

    def draw(s):
        return _draw(text, name, severity, s, wordnet, models, device, generate_kwargs)

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
    if TEXT_CORRUPTION_LEVELS[name] == "sentence" and similarity_fn is None:
        out: list[str] = []
        for start in range(0, len(texts), batch_size):
            chunk = texts[start : start + batch_size]
            with seeded(None if seed is None else derive_seed(seed, "batch", start), torch_too=True):
                out.extend(
                    _sentence_corrupt(chunk, name, kwargs.get("models"), kwargs.get("device"), kwargs.get("generate_kwargs"))
                )
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


__all__ = [
    "BACK_TRANSLATION_GENERATE_KWARGS",
    "CHAR_CORRUPTIONS",
    "DEFAULT_TEXT_MODELS",
    "MAX_TEXT_SEVERITY",
    "MissingResourceError",
    "PAPER_TEXT_SEVERITIES",
    "PUNCTUATION_MARKS",
    "SENTENCE_CORRUPTIONS",
    "STYLE_GENERATE_KWARGS",
    "STYLE_PREFIXES",
    "Seq2SeqGenerator",
    "TEXT_CORRUPTIONS",
    "TEXT_CORRUPTION_ABBREVIATIONS",
    "TEXT_CORRUPTION_LEVELS",
    "TEXT_SEVERITIES",
    "WORD_CORRUPTIONS",
    "clear_text_model_cache",
    "corrupt_text",
    "corrupt_texts",
    "load_wordnet",
    "register_text_model",
    "sentence_generators",
    "text_corruption_requirements",
]
