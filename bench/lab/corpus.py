"""The lab target's text: the Python sources and documentation of a fixed selection of installed
packages (scales.py names them), split three ways by a hash of each file's path.

A document is one file: a package's ``.py``, ``.pyi``, ``.md`` or ``.rst`` file, or its
distribution's ``METADATA`` (the long description: the package's README). Its path is written
relative to the folder the package is installed in (``torch/nn/modules/linear.py``;
``dist-info/torch/METADATA``), the same on every machine, and ``sha256(path)`` decides its split
for good:

- ``heldout``: never trained on by the target; its held-out loss and the evaluation's two prompt
  sets (code, docstrings) come from these files only;
- ``chat``: never trained on either; the user turns of the drafter's conversations;
- ``train``: the tokenizer's and the target's training text.

A file that is not UTF-8, is empty or is larger than ``max_file_bytes`` is left out. The corpus
digest hashes every document's path and text: another version of a package is another corpus,
and so another target (its cache key says so).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
from dataclasses import dataclass
from pathlib import Path

SUFFIXES = (".py", ".pyi", ".md", ".rst")
SPLITS = ("train", "chat", "heldout")


@dataclass(frozen=True)
class Document:
    path: str  # relative, machine-independent: the split's hash is taken of it
    text: str

    @property
    def split_hash(self) -> int:
        """0..999 from the path alone."""
        return int(hashlib.sha256(self.path.encode("utf-8")).hexdigest()[:8], 16) % 1000


def split_of(path: str, heldout_per_mille: int, chat_per_mille: int) -> str:
    h = Document(path, "").split_hash
    if h < heldout_per_mille:
        return "heldout"
    return "chat" if h < heldout_per_mille + chat_per_mille else "train"


@dataclass
class Corpus:
    documents: list[Document]  # sorted by path
    found: dict[str, str]  # package -> its version ("" when no distribution names it)
    missing: list[str]  # packages of the selection not installed here
    skipped: dict[str, int]  # reason -> files left out
    heldout_per_mille: int
    chat_per_mille: int

    def split(self, name: str) -> list[Document]:
        if name not in SPLITS:
            raise ValueError(f"no split {name!r}: one of {', '.join(SPLITS)}")
        return [d for d in self.documents
                if split_of(d.path, self.heldout_per_mille, self.chat_per_mille) == name]

    @property
    def digest(self) -> str:
        h = hashlib.sha256()
        for d in self.documents:
            h.update(d.path.encode("utf-8") + b"\0" + d.text.encode("utf-8") + b"\0")
        return h.hexdigest()[:12]

    def summary(self) -> dict:
        per = {s: self.split(s) for s in SPLITS}
        return {"digest": self.digest, "packages": self.found, "missing": self.missing,
                "skipped": self.skipped,
                "files": {s: len(v) for s, v in per.items()},
                "chars": {s: sum(len(d.text) for d in v) for s, v in per.items()}}


def _package_root(name: str) -> tuple[Path, list[Path]] | None:
    """(the folder the package is installed in, its files) without importing it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        folder = Path(next(iter(spec.submodule_search_locations)))
        return folder.parent, sorted(p for p in folder.rglob("*") if p.suffix in SUFFIXES)
    if spec.origin and spec.origin.endswith(".py"):
        origin = Path(spec.origin)
        return origin.parent, [origin]
    return None


def _distributions() -> dict[str, list[str]]:
    try:
        return importlib.metadata.packages_distributions()
    except Exception:  # a broken distribution's metadata must not stop the corpus
        return {}


def _read(path: Path, max_bytes: int, skipped: dict[str, int]) -> str | None:
    try:
        raw = path.read_bytes()
    except OSError:
        skipped["unreadable"] = skipped.get("unreadable", 0) + 1
        return None
    if len(raw) > max_bytes:
        skipped["too_large"] = skipped.get("too_large", 0) + 1
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        skipped["not_utf8"] = skipped.get("not_utf8", 0) + 1
        return None
    if not text.strip():
        skipped["empty"] = skipped.get("empty", 0) + 1
        return None
    return text


def collect(packages: tuple[str, ...] | list[str], *, heldout_per_mille: int,
            chat_per_mille: int, max_file_bytes: int) -> Corpus:
    """The corpus of the installed ``packages`` (in a fixed order; the result sorted by path)."""
    docs: dict[str, str] = {}
    found: dict[str, str] = {}
    missing: list[str] = []
    skipped: dict[str, int] = {}
    dists = _distributions()
    for name in packages:
        got = _package_root(name)
        if got is None:
            missing.append(name)
            continue
        root, files = got
        for f in files:
            text = _read(f, max_file_bytes, skipped)
            if text is not None:
                docs[f.relative_to(root).as_posix()] = text
        version = ""
        for dist in sorted(set(dists.get(name, []))):
            try:
                meta = importlib.metadata.distribution(dist)
            except importlib.metadata.PackageNotFoundError:
                continue
            version = meta.version
            body = meta.read_text("METADATA") or ""
            if body.strip() and len(body.encode("utf-8")) <= max_file_bytes:
                docs[f"dist-info/{dist}/METADATA"] = body
        found[name] = version
    return Corpus([Document(p, docs[p]) for p in sorted(docs)], found, missing, skipped,
                  heldout_per_mille, chat_per_mille)


def collect_for(scale) -> Corpus:
    return collect(scale.packages, heldout_per_mille=scale.heldout_per_mille,
                   chat_per_mille=scale.chat_per_mille, max_file_bytes=scale.max_file_bytes)
