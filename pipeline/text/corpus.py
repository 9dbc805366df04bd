"""The training corpus of the project's tiny model: real English text that every Python install carries.

Two sources, both read from the running interpreter, so the same Python gives the same documents:

- ``pydoc_data.topics.topics``: the language-reference topics behind ``help("assert")`` (id ``topics/<key>``);
- the docstrings of a fixed, sorted list of standard-library modules (:data:`STDLIB_PACKAGES` walked into
  their public submodules, plus a few built-in ones in :data:`BUILTIN_MODULES`): module, public class,
  function, method and property docstrings, one document each, with ids
  ``module/json``, ``class/json.JSONEncoder``, ``function/json.dumps``, ``method/json.JSONEncoder.encode``
  and ``attribute/...`` for properties.

The split is by document (:func:`split`: a sha256 of the id decides, never a random chunk, and a held-out
document that near-duplicates train text moves to train), so no text of a held-out document is trained on. The text
differs between Python versions, so the held-out documents and the calibration texts are shipped in :data:`ASSET_DIR`
with the version that made them (:func:`load_heldout`, :func:`load_calib`).
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import pkgutil
import re
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Callable, Iterator, Sequence

from pipeline.assets import EMBEDDED_MODEL_DIR
from pipeline.io import storage

ASSET_DIR = EMBEDDED_MODEL_DIR

# Pure-Python standard-library modules and packages whose docstrings are read; packages are walked into
# their public submodules. Left out: modules with import side effects (antigravity, this, __hello__,
# idlelib, tkinter, turtle, turtledemo, rlcompleter, site), test suites, lib2to3/distutils (deprecated,
# write caches), the modules removed in 3.13 (PEP 594), the pure-Python twins of C modules (_pydecimal,
# _pyio) and ntpath, whose docstrings near-duplicate posixpath's. A name that fails to import is skipped.
STDLIB_PACKAGES = tuple("""
__future__ abc argparse ast asyncio base64 bdb bisect bz2 cProfile calendar cmd code codecs codeop
collections colorsys compileall concurrent configparser contextlib contextvars copy copyreg csv ctypes
dataclasses datetime dbm decimal difflib dis doctest email enum filecmp fileinput fnmatch fractions ftplib
functools genericpath getopt getpass gettext glob graphlib gzip hashlib heapq hmac html http imaplib
importlib inspect io ipaddress json keyword linecache locale logging lzma mailbox mimetypes modulefinder
multiprocessing netrc numbers opcode operator optparse os pathlib pdb pickle pickletools pkgutil platform
plistlib poplib posixpath pprint profile pstats pty py_compile pyclbr pydoc queue quopri random re reprlib
runpy sched secrets selectors shelve shlex shutil signal smtplib socket socketserver sqlite3 ssl stat
statistics string stringprep struct subprocess symtable sysconfig tabnanny tarfile tempfile textwrap
threading timeit token tokenize tomllib trace traceback tracemalloc tty types typing unittest urllib uuid
warnings wave weakref webbrowser wsgiref xml xmlrpc zipapp zipfile zipimport zoneinfo
""".split())
# Built-in (C) modules without side effects whose docstrings are plain English too.
BUILTIN_MODULES = ("builtins", "gc", "itertools", "math", "sys", "time")
_SKIP_SUBMODULES = ("test", "tests", "idle_test")

MIN_DOC_CHARS = 40  # shorter docstrings ("Return self.") carry too little text to be worth a document
HELDOUT_PER_10K = 500  # 5% of documents are held out
SHINGLE_WORDS = 8  # near-duplicates are found by shared runs of this many words
MAX_SHARED_SHINGLES = 0.5  # a held-out document may share less than this fraction of its runs with train
MIN_ANSWER_CHARS = 200
MAX_ANSWER_CHARS = 400
SNIPPET_CHARS = (300, 600)  # a calibration text snippet is cut at a line end within this range
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+>")  # an object repr: differs from run to run


@dataclass(frozen=True)
class Doc:
    """One document: ``id`` is ``<kind>/<name>`` (kind: topics, module, class, function, method, attribute)."""

    id: str
    text: str

    @property
    def kind(self) -> str:
        return self.id.split("/", 1)[0]

    @property
    def name(self) -> str:
        return self.id.split("/", 1)[1]

    @property
    def title(self) -> str:
        """What the document is about: a topic's heading line, else the dotted name."""
        return self.text.split("\n", 1)[0].strip() if self.kind == "topics" else self.name


# ----------------------------------------------------------------------------------------------- sources


def documents() -> list[Doc]:
    """All documents, topics first, then docstrings in module order; each text occurs once.

    Read in a fresh, isolated interpreter (``python -I``): what this process has imported or patched
    (pytest's ``sys.unraisablehook``, the methods transformers adds to ``logging.Logger``) would change
    the docstrings seen, and the ~300 modules imported to read them stay out of this process.
    """
    root = str(Path(__file__).resolve().parents[2])
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); from pipeline.text.corpus import _read_documents; "
        "sys.stdout.write(json.dumps([[d.id, d.text] for d in _read_documents()]))"
    )
    run = subprocess.run([sys.executable, "-I", "-c", code, root], capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"reading the corpus in {sys.executable} failed:\n{run.stderr[-2000:]}")
    return [Doc(doc_id, text) for doc_id, text in json.loads(run.stdout)]


def _read_documents() -> list[Doc]:
    """:func:`documents` as read in this process."""
    seen: set[str] = set()
    docs: list[Doc] = []
    for doc in _topic_docs():
        if doc.text not in seen:
            seen.add(doc.text)
            docs.append(doc)
    for module_name, module in _modules():
        for doc_id, header, body in _docstrings(module_name, module):
            if len(body) < MIN_DOC_CHARS or body in seen or _ADDRESS.search(header + body):
                continue
            seen.add(body)
            docs.append(Doc(doc_id, f"{header}\n\n{body}"))
    return docs


def _topic_docs() -> list[Doc]:
    from pydoc_data.topics import topics

    # "else" and "if" share a text: the shortest key names a shared text.
    keys = sorted(topics, key=lambda k: (len(k), k))
    first = {}
    for key in keys:
        first.setdefault(topics[key].strip(), key)
    return [Doc(f"topics/{first[t]}", t) for t in sorted(first, key=lambda t: first[t])]


def _import(name: str) -> ModuleType | None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a module this platform or version lacks is skipped
            return None


def _modules() -> Iterator[tuple[str, ModuleType]]:
    """(import name, module) for the built-in modules, then each package and its public submodules."""
    def walk(name: str) -> Iterator[tuple[str, ModuleType]]:
        module = _import(name)
        if module is None:
            return
        yield name, module
        for info in sorted(pkgutil.iter_modules(getattr(module, "__path__", [])), key=lambda i: i.name):
            if not info.name.startswith("_") and info.name not in _SKIP_SUBMODULES:
                yield from walk(f"{name}.{info.name}")

    for name in BUILTIN_MODULES + STDLIB_PACKAGES:
        yield from walk(name)


def _own_doc(obj: object) -> str:
    """``obj``'s own docstring, cleaned as ``inspect.getdoc`` does; a class's inherited docstring is not its own."""
    raw = vars(obj).get("__doc__") if isinstance(obj, type) else getattr(obj, "__doc__", None)
    return inspect.cleandoc(raw) if isinstance(raw, str) else ""


def _signature(obj: object) -> str:
    try:
        return str(inspect.signature(obj))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return ""


def _docstrings(module_name: str, module: ModuleType) -> Iterator[tuple[str, str, str]]:
    """(id, header line, docstring) of a module and of the public objects it defines."""
    yield f"module/{module_name}", module_name, _own_doc(module)
    # _collections_abc calls itself collections.abc; heapq's functions live in its C twin _heapq.
    homes = {module_name, module.__name__, "_" + module_name}
    public = getattr(module, "__all__", None)
    names = sorted({n for n in (public if public is not None else vars(module)) if not n.startswith("_")})
    for name in names:
        obj = getattr(module, name, None)
        if getattr(obj, "__module__", None) not in homes:
            continue  # re-exported from elsewhere: documented where it is defined
        qual = f"{module_name}.{name}"
        if isinstance(obj, type):
            yield f"class/{qual}", f"class {qual}{_signature(obj)}", _own_doc(obj)
            for attr, member in sorted(vars(obj).items()):
                if attr.startswith("_"):
                    continue
                if inspect.isroutine(member) or isinstance(member, (classmethod, staticmethod)):
                    func = getattr(obj, attr, member)
                    yield f"method/{qual}.{attr}", f"{qual}.{attr}{_signature(func)}", _own_doc(func)
                elif inspect.isdatadescriptor(member):  # properties, C getsets
                    yield f"attribute/{qual}.{attr}", f"{qual}.{attr}", _own_doc(member)
        elif inspect.isroutine(obj):
            yield f"function/{qual}", f"{qual}{_signature(obj)}", _own_doc(obj)


# ----------------------------------------------------------------------------------------------- split


def _stable_int(key: str) -> int:
    """A hash of ``key`` that is the same in every process and Python version (``hash`` is salted)."""
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big")


def is_heldout(doc_id: str) -> bool:
    return _stable_int(doc_id) % 10_000 < HELDOUT_PER_10K


def _shingles(text: str) -> set[tuple[str, ...]]:
    """The runs of SHINGLE_WORDS consecutive words of ``text`` (the whole text if it is shorter)."""
    words = text.split()
    return {tuple(words[i : i + SHINGLE_WORDS]) for i in range(max(1, len(words) - SHINGLE_WORDS + 1))}


def split(docs: Sequence[Doc]) -> tuple[list[Doc], list[Doc]]:
    """(train, heldout), order kept; a document is wholly on one side.

    Held out: the documents whose id hashes into 5% (:func:`is_heldout`), except those that near-duplicate
    the train side: a document with at least MAX_SHARED_SHINGLES of its word runs in train documents
    (``str.rjust`` beside ``bytes.rjust``, a topic that is a section of another) moves to train, until
    none is left.
    """
    held = {d.id: _shingles(d.text) for d in docs if is_heldout(d.id)}
    seen = set().union(*(_shingles(d.text) for d in docs if d.id not in held))
    moved = True
    while moved:
        moved = False
        for doc_id, shingles in list(held.items()):
            if len(shingles & seen) >= MAX_SHARED_SHINGLES * len(shingles):
                del held[doc_id]
                seen |= shingles
                moved = True
    return [d for d in docs if d.id not in held], [d for d in docs if d.id in held]


# ------------------------------------------------------------------------------------------ chat samples

SYSTEM_PROMPTS = (
    "You are a helpful assistant that answers questions about Python.",
    "Answer briefly, in the words of the Python documentation.",
)
_QUESTIONS = {
    "topics": ("Explain {t}.", "Tell me about {t}.", "What does the Python reference say about {t}?"),
    "module": ("What is the {t} module for?", "Explain the {t} module.", "What does the {t} module do?"),
    "class": ("What is {t}?", "Explain the {t} class.", "What is the {t} class used for?"),
    "function": ("What does {t}() do?", "Explain {t}().", "Describe the function {t}."),
    "method": ("What does {t}() do?", "Explain the method {t}().", "Describe {t}()."),
    "attribute": ("What is {t}?", "Explain the attribute {t}.", "What does {t} hold?"),
}
_KEEP_CASE = {"Python"}
_VERSION_NOTES = ("New in version", "Changed in version", "Deprecated since version", "Added in version")


def _topic_phrase(title: str) -> str:
    """A heading as a phrase inside a sentence: "The Ellipsis Object" -> "the ellipsis object"."""
    words = title.split(" ")
    return " ".join(
        w.lower() if w[:1].isupper() and w[1:].islower() and w.isalpha() and w not in _KEEP_CASE else w
        for w in words
    )


def _is_prose(paragraph: str) -> bool:
    """Unindented running text: not a code block, grammar rule, doctest, heading or version note."""
    lines = paragraph.splitlines()
    return (
        bool(lines)
        and not lines[0][:1].isspace()
        and not paragraph.startswith(_VERSION_NOTES)
        and ">>>" not in paragraph
        and "::=" not in paragraph
        and any(c.isalpha() for c in paragraph)
        and not re.fullmatch(r"[*=\-~^]+", lines[-1].strip())
    )


def _trim(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` chars: at the last sentence end, else the last space."""
    if len(text) <= limit:
        return text
    cut = text[: limit + 1]
    ends = [m.end() for m in re.finditer(r"[.!?:](?=\s)", cut)]
    if ends and ends[-1] >= limit // 3:
        return cut[: ends[-1]]
    return cut[: cut.rfind(" ")].rstrip(",;") + "..."


def answer(doc: Doc) -> str:
    """The doc's first prose paragraph(s) after its heading, reflowed, about 200-400 chars; "" if none."""
    parts: list[str] = []
    for paragraph in re.split(r"\n\s*\n", doc.text)[1:]:
        if not _is_prose(paragraph):
            if parts:
                break
            continue
        parts.append(" ".join(line.strip() for line in paragraph.splitlines()))
        if sum(map(len, parts)) >= MIN_ANSWER_CHARS:
            break
    text = _trim("\n\n".join(parts), MAX_ANSWER_CHARS)
    return text[:-1] + "." if text.endswith(":") else text  # "... as follows:" led into code left out


def chat_samples(docs: Sequence[Doc]) -> list[list[dict[str, str]]]:
    """One single-turn chat per document with a prose answer: a question on its title, the answer from
    :func:`answer`; a quarter get a system prompt. Pass the train documents only."""
    samples = []
    for doc in docs:
        reply = answer(doc)
        if not reply:
            continue
        subject = _topic_phrase(doc.title) if doc.kind == "topics" else doc.title
        templates = _QUESTIONS[doc.kind]
        question = templates[_stable_int(doc.id) % len(templates)].format(t=subject)
        messages = [{"role": "user", "content": question}, {"role": "assistant", "content": reply}]
        pick = _stable_int("system:" + doc.id) % (4 * len(SYSTEM_PROMPTS))
        if pick < len(SYSTEM_PROMPTS):
            messages.insert(0, {"role": "system", "content": SYSTEM_PROMPTS[pick]})
        samples.append(messages)
    return samples


# ----------------------------------------------------------------------------------------- calibration


def snippet(doc: Doc) -> str:
    """The start of a document, whole lines, between SNIPPET_CHARS[0] and SNIPPET_CHARS[1] chars if it can."""
    lo, hi = SNIPPET_CHARS
    if len(doc.text) <= hi:
        return doc.text
    head = doc.text[:hi]
    end = head.rfind("\n", lo)
    return head[:end] if end >= 0 else _trim(head, hi)


def calibration_texts(
    train: Sequence[Doc], render: Callable[[list[dict[str, str]]], str], n: int = 64
) -> list[str]:
    """``n`` calibration texts from train documents only, alternating a rendered chat of at least
    MIN_ANSWER_CHARS (``render`` should leave out the bos: the quantizer's tokenizer adds it) and a text
    snippet; chosen by a stable hash."""
    ranked = sorted(train, key=lambda d: _stable_int("calib:" + d.id))
    chats = (text for text in map(render, chat_samples(ranked)) if len(text) >= MIN_ANSWER_CHARS)
    snippets = (snippet(d) for d in reversed(ranked) if len(d.text) >= SNIPPET_CHARS[0])
    texts: list[str] = []
    for i in range(n):
        texts.append(next(chats) if i % 2 == 0 else next(snippets))
    return texts


# ------------------------------------------------------------------------------------- shipped assets


def load_heldout(asset_dir: str = ASSET_DIR) -> tuple[str, list[Doc]]:
    """(python_version, documents) from ``heldout.json``, as :func:`split` made them for that version."""
    path = storage.join(asset_dir, "heldout.json")
    data = json.loads(storage.read_bytes(path))
    return data["python_version"], [Doc(d["id"], d["text"]) for d in data["documents"]]


def load_calib(asset_dir: str = ASSET_DIR) -> list[str]:
    """The calibration texts of ``calib.json`` (a JSON list of strings, msModelSlim's calib form)."""
    return json.loads(storage.read_bytes(storage.join(asset_dir, "calib.json")))
