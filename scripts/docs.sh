#!/usr/bin/env bash
# Builds the book (docs/book, mdBook) and checks that every relative link
# and anchor resolves: in the Markdown as GitHub shows it (README.md,
# SECURITY.md and docs/**/*.md) and in the built site (target/book).
# mdBook has no link checker of its own. Installs mdbook from crates.io if
# it is missing (a few minutes, once per machine).
set -euo pipefail
cd "$(dirname "$0")/.."

MDBOOK_VERSION=0.5.4
if ! command -v mdbook >/dev/null 2>&1; then
  echo "scripts/docs.sh: installing mdbook $MDBOOK_VERSION (cargo install --locked)" >&2
  cargo install mdbook --locked --version "$MDBOOK_VERSION"
fi
rm -rf target/book
mdbook build docs/book

python3 - <<'PY'
"""Link check: a relative link names a file that exists, and its #anchor a
heading or an id= in that file. Book pages may link only inside the book
(anything else is not on the site: use an absolute URL)."""
import html.parser, os, re, sys

ROOT = os.getcwd()
BOOK_SRC = os.path.join(ROOT, "docs", "book", "src")
SITE = os.path.join(ROOT, "target", "book")
errors = []

# ---- Markdown, as GitHub (and mdBook) derive heading ids ----
FENCE = re.compile(r"^\s*(```|~~~)")
INCLUDE = re.compile(r"\{\{#include\s+([^}:\s]+)(?::([A-Za-z0-9_-]+))?\s*\}\}")
LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)|\bhref=\"([^\"]+)\"")
ID = re.compile(r"\b(?:id|name)=\"([^\"]+)\"")

def expanded(path, anchor=None, depth=0):
    """The file's text with {{#include}} expanded (ANCHOR regions honoured)."""
    text = open(path, encoding="utf-8").read()
    if anchor:
        m = re.search(r"ANCHOR:\s*%s\b.*?\n(.*?)\n[^\n]*ANCHOR_END:\s*%s\b" % (anchor, anchor), text, re.S)
        if not m:
            errors.append(f"{rel(path)}: no ANCHOR {anchor} for an include")
            return ""
        text = m.group(1)
    if depth > 3:
        return text
    def sub(m):
        target = os.path.normpath(os.path.join(os.path.dirname(path), m.group(1)))
        if not os.path.isfile(target):
            errors.append(f"{rel(path)}: include of a missing file {m.group(1)}")
            return ""
        return expanded(target, m.group(2), depth + 1)
    return INCLUDE.sub(sub, text)

def prose_lines(text):
    """Lines outside fenced code blocks."""
    fenced = False
    for n, line in enumerate(text.split("\n"), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield n, line

def slug(heading):
    text = re.sub(r"<[^>]+>", "", heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    out = []
    for ch in text.strip().lower():
        if ch.isalnum() or ch in "-_":
            out.append(ch)
        elif ch.isspace():
            out.append("-")
    return "".join(out)

anchor_cache = {}
def anchors(path):
    if path not in anchor_cache:
        found, seen = set(), {}
        for _, line in prose_lines(expanded(path)):
            m = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
            if m:
                s = slug(m.group(2))
                n = seen.get(s, 0)
                seen[s] = n + 1
                found.add(s if n == 0 else f"{s}-{n}")
            found.update(ID.findall(line))
        anchor_cache[path] = found
    return anchor_cache[path]

def rel(path):
    return os.path.relpath(path, ROOT)

sources = ["README.md", "SECURITY.md"]
for dirpath, _, files in os.walk("docs"):
    sources += [os.path.join(dirpath, f) for f in sorted(files) if f.endswith(".md")]

checked = 0
for src in sources:
    path = os.path.join(ROOT, src)
    in_book = path.startswith(BOOK_SRC + os.sep)
    text = open(path, encoding="utf-8").read()
    for n, line in prose_lines(text):
        line = re.sub(r"`[^`]*`", "", line)
        for m in LINK.finditer(line):
            target = m.group(1) or m.group(2)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                continue  # absolute: https:, mailto:, urn:
            checked += 1
            file, _, frag = target.partition("#")
            dest = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
            where = f"{src}:{n}: ({target})"
            if not os.path.exists(dest):
                errors.append(f"{where}: no such file {rel(dest)}")
                continue
            if in_book and not dest.startswith(BOOK_SRC + os.sep):
                errors.append(f"{where}: links outside the book (not on the site); use an absolute URL")
            if frag and dest.endswith(".md") and frag not in anchors(dest):
                errors.append(f"{where}: no anchor #{frag} in {rel(dest)}")

# ---- The built site: every relative href and src, and its #id ----
class Page(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.ids, self.refs = set(), []
    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if a.get("id"):
            self.ids.add(a["id"])
        if tag == "a" and a.get("name"):
            self.ids.add(a["name"])
        for key in ("href", "src"):
            if a.get(key):
                self.refs.append((tag, a[key]))

pages = {}
def page(path):
    if path not in pages:
        p = Page()
        p.feed(open(path, encoding="utf-8").read())
        pages[path] = p
    return pages[path]

# Pages of mdBook's own (print, 404, toc) are generated; the chapters are ours.
for dirpath, _, files in os.walk(SITE):
    for f in files:
        if not f.endswith(".html") or f in ("print.html", "404.html", "toc.html"):
            continue
        path = os.path.join(dirpath, f)
        for tag, ref in page(path).refs:
            if re.match(r"^[a-z][a-z0-9+.-]*:", ref) or ref.startswith("//"):
                continue
            checked += 1
            file, _, frag = ref.partition("#")
            file = file.split("?")[0]
            dest = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
            where = f"{os.path.relpath(path, SITE)} (site): <{tag} {ref}>"
            if os.path.isdir(dest):
                dest = os.path.join(dest, "index.html")
            if not os.path.exists(dest):
                errors.append(f"{where}: no such file")
            elif frag and dest.endswith(".html") and frag not in page(dest).ids:
                errors.append(f"{where}: no id {frag}")

for e in errors:
    print(f"scripts/docs.sh: {e}", file=sys.stderr)
if errors:
    sys.exit(1)
print(f"scripts/docs.sh: {checked} relative links and anchors resolve", file=sys.stderr)
PY
