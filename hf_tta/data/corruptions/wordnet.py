"""The WordNet 3.0 database for the synonym text corruptions (EDA's synonym replacement and random insertion).

Searched in this order: a folder given with ``wordnet=`` / ``$HF_TTA_WORDNET``, nltk's ``wordnet`` data
(``python -m nltk.downloader wordnet``), then Debian's ``wordnet-base`` (``apt-get install wordnet-base``,
``/usr/share/wordnet``). A folder that lacks nltk's ``lexnames`` file is staged (copied, with the file added) under
``$HF_TTA_CACHE/wordnet``.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

from .base import MissingResourceError, bare_word, derive_seed

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
    cache = Path(os.environ.get("HF_TTA_CACHE", Path.home() / ".cache" / "hf_tta")) / "wordnet"
    target = cache / f"{folder.name}-{derive_seed(str(folder.resolve())):08x}"
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


_SYN_CACHE: dict[str, list[str]] = {}


def synonyms(wordnet, word: str) -> list[str]:
    """EDA's ``get_synonyms``, sorted so that a seed gives the same choice in every process (cached per word)."""
    word = bare_word(word)
    if not word:
        return []
    if word not in _SYN_CACHE:
        syns = set()
        for syn in wordnet.synsets(word):
            for lemma in syn.lemmas():
                s = lemma.name().replace("_", " ").replace("-", " ").lower()
                s = "".join(ch for ch in s if ch in " qwertyuiopasdfghjklzxcvbnm").strip()
                if s:
                    syns.add(s)
        syns.discard(word)
        _SYN_CACHE[word] = sorted(syns)
    return _SYN_CACHE[word]


__all__ = ["WORDNET_INSTALL_HINT", "WORDNET_SYSTEM_DIRS", "load_wordnet", "synonyms"]
