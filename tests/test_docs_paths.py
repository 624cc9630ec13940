"""Every result file, GPU script and benchmarks module that the docs cite exists, and the docs
speak of the project only.

Scanned: README.md, docs/*.md, benchmarks/README.md, benchmarks/experiments/README.md,
benchmarks/results/README.md. Cited are repository paths under `benchmarks/` and `tests/gpu/`,
result paths relative to `benchmarks/results/` (`h200/forward/fwd.json`, `cpu/...`,
`h200x2/...`), bare result names (`x.jsonl`), which belong to the results folder that the
nearest heading above them names (anywhere in `benchmarks/results/` under a heading that names
none), and modules run as `python -m benchmarks.x`. `{a,b}` and `*` expand as in the shell; each
expansion must match.

A file that left the tree is cited at a commit, `git show <sha>:<path>`: that path must exist
at that commit, and a bare mention of the same path (or a folder above it) on the same line is
then allowed. Under a heading that names a folder and "files at commit <sha>", bare names may
be files of that folder at that commit. A line that cites a commit describes that commit's
tree, so its module names are not checked against today's. The first column of
benchmarks/README.md's "Files" table names files relative to benchmarks/.
"""

import fnmatch
import functools
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = "benchmarks/results"
RESULTS_INDEX = "benchmarks/results/README.md"
DOCS = ["README.md", "benchmarks/README.md", "benchmarks/experiments/README.md", RESULTS_INDEX] + sorted(
    str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")
)

_SEG = r"(?:[\w.*-]|\{[\w.,*-]*\})+"  # one path component, with {a,b} and * patterns
_PATH = rf"{_SEG}(?:/{_SEG})*/?"
SHA_REF = re.compile(rf"\b([0-9a-f]{{7,40}}):((?:benchmarks|tests)/{_PATH})")
REPO_PATH = re.compile(rf"(?<![\w./:-])((?:benchmarks|tests/gpu)/(?:{_PATH})?)")
RESULT_FOLDER = r"(?:h200x\d+|h200|cpu)/"  # a machine kind's folder under benchmarks/results/
RESULT_REL = re.compile(rf"(?<![\w./:-])({RESULT_FOLDER}(?:{_PATH})?)")
BARE = re.compile(
    r"(?<![\w./:{,*-])([\w*-]+(?:\.[\w*-]+)*\.(?:jsonl|json|log|png|txt|sass\.gz|\*|\{[\w.,]+\})"
    r"|validate_[\w*-]+\.(?:md|\{[\w.,]+\}))(?![\w/*-])"
)
MODULE = re.compile(r"python3? -m (benchmarks(?:\.\w+)+)")
HEADING = re.compile(r"^(#+)\s")
HEAD_COMMIT = re.compile(r"files at commit ([0-9a-f]{7,40})")


def _expand(pattern):
    """Shell-style brace expansion (not nested)."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    return [x for alt in m.group(1).split(",") for x in _expand(pattern[: m.start()] + alt + pattern[m.end() :])]


def _clean(path):
    return path.rstrip(".,;:")


def _in_tree(path):
    if "*" in path:
        return any(ROOT.glob(path.rstrip("/")))
    p = ROOT / path
    return p.is_dir() if path.endswith("/") else p.exists()


@functools.lru_cache(maxsize=None)
def _git_files(sha):
    """Files at commit sha, or None where git or the commit is not available (a shallow clone)."""
    try:
        out = subprocess.run(
            ["git", "ls-tree", "-r", "--name-only", sha], cwd=ROOT, capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return frozenset(out.stdout.split()) if out.returncode == 0 else None


def _at_commit(files, path):
    path = path.rstrip("/")
    return any(fnmatch.fnmatchcase(f, path) or f.startswith(path + "/") for f in files)


def _folder_of(path):
    """The results folder a heading names: the path itself if it ends in "/", else its folder."""
    return path.rstrip("/") if path.endswith("/") else path.rsplit("/", 1)[0]


def _contexts(lines):
    """Per line: (results folder, commit) from the nearest heading above that names a folder."""
    stack, out = [], []
    for line in lines:
        m = HEADING.match(line)
        if m:
            level = len(m.group(1))
            stack = [h for h in stack if h[0] < level]
            folder = RESULT_REL.search(line) or re.search(rf"{RESULTS}/({RESULT_FOLDER}(?:{_PATH})?)", line)
            commit = HEAD_COMMIT.search(line)
            stack.append((level, folder and _folder_of(folder.group(1)), commit and commit.group(1)))
        ctx = next(((f, c) for _, f, c in reversed(stack) if f), (None, None))
        out.append(ctx)
    return out


def _citations():
    """(doc, line, kind, path, extra, heading commit) for each citation.

    kind "at_commit": path cited as <sha>:path, extra = sha; "repo": a repository path, extra =
    the line's (sha, path) citations; "bare": a bare result name, extra = the heading's folder;
    "module": a benchmarks module run with -m, on a line that cites no commit.
    """
    for doc in DOCS:
        lines = (ROOT / doc).read_text().splitlines()
        for n, (line, (folder, commit)) in enumerate(zip(lines, _contexts(lines)), 1):
            refs = [(sha, _clean(p)) for sha, p in SHA_REF.findall(line)]
            for sha, p in refs:
                yield doc, n, "at_commit", p, sha, None
            rest = SHA_REF.sub(" ", line)
            historical = bool(refs) or bool(commit)
            for p in REPO_PATH.findall(rest):
                yield doc, n, "repo", _clean(p), refs, commit
            for p in RESULT_REL.findall(rest):
                yield doc, n, "repo", f"{RESULTS}/{_clean(p)}", refs, commit
            for name in BARE.findall(REPO_PATH.sub(" ", RESULT_REL.sub(" ", rest))):
                yield doc, n, "bare", name, folder, commit
            if not historical:
                for mod in MODULE.findall(rest):
                    yield doc, n, "module", mod, None, None


def _bare_ok(name, folder):
    """In the tree: in the heading's folder, else anywhere in the results folder."""
    base = ROOT / RESULTS / folder if folder else ROOT / RESULTS
    files = [p.relative_to(base).as_posix() for p in base.rglob("*") if p.is_file()]
    if folder:
        files = [f for f in files if "/" not in f]
    else:
        files = [f.rsplit("/", 1)[-1] for f in files]
    return any(fnmatch.fnmatchcase(f, name) for f in files)


def test_docs_exist():
    assert all((ROOT / d).is_file() for d in DOCS) and len(DOCS) > 4


def test_cited_paths_exist_in_the_tree():
    missing = []
    for doc, n, kind, path, extra, commit in _citations():
        if kind == "at_commit":
            continue
        for p in _expand(path):
            if kind == "repo":
                if _in_tree(p):
                    continue
                root = p.rstrip("/")
                if any(q == root or q.startswith(root + "/") for _, ref in extra for q in _expand(ref)):
                    continue  # cited at a commit on the same line: test_cited_commits_hold_the_files
                if commit:
                    continue  # under a "files at commit" heading: checked there too
            elif kind == "bare":
                if _bare_ok(p, extra) or commit:
                    continue
            elif kind == "module":
                rel = p.replace(".", "/")
                if (ROOT / f"{rel}.py").is_file() or (ROOT / rel).is_dir():
                    continue
            missing.append(f"{doc}:{n}: {kind} {p}")
    assert not missing, "cited but not in the tree:\n" + "\n".join(missing)


def test_cited_commits_hold_the_files():
    """Files cited at a commit (git show <sha>:<path>, or under a "files at commit" heading) are there."""
    missing, unavailable = [], set()
    for doc, n, kind, path, extra, commit in _citations():
        if kind == "at_commit":
            sha, wanted = extra, [path]
        elif kind in ("repo", "bare") and commit:
            sha = commit
            if kind == "repo":
                wanted = [p for p in _expand(path) if not _in_tree(p)]
            else:
                wanted = [f"{RESULTS}/{extra}/{p}" for p in _expand(path) if not _bare_ok(p, extra)]
        else:
            continue
        if not wanted:
            continue
        files = _git_files(sha)
        if files is None:
            unavailable.add(sha)
            continue
        for w in wanted:
            for p in _expand(w):
                if not _at_commit(files, p):
                    missing.append(f"{doc}:{n}: {p} not at {sha}")
    assert not missing, "\n".join(missing)
    if unavailable:
        pytest.skip(f"commits not in this clone (shallow?): {sorted(unavailable)}")


def test_every_kept_result_is_indexed():
    """Each file under benchmarks/results/ is named in its README's index (with its command)."""
    named = {
        q for doc, _, kind, path, _, _ in _citations() if doc == RESULTS_INDEX and kind == "repo" for q in _expand(path)
    }
    files = sorted(
        p.relative_to(ROOT).as_posix() for p in (ROOT / RESULTS).rglob("*") if p.is_file() and p.name != "README.md"
    )
    assert len(files) > 20
    unnamed = [
        f for f in files if not any(fnmatch.fnmatchcase(f, q) or f.startswith(q.rstrip("/") + "/") for q in named)
    ]
    assert not unnamed, f"not in {RESULTS_INDEX}: {unnamed}"


def test_benchmarks_readme_files_table():
    """The first column of benchmarks/README.md's "Files" table names files under benchmarks/."""
    text = (ROOT / "benchmarks/README.md").read_text()
    table = text.split("## Files", 1)[1].split("\n## ", 1)[0]
    names = [
        name
        for row in table.splitlines()
        if row.startswith("| `")
        for name in re.findall(r"`([^`]+)`", row.split(" | ")[0])
    ]
    assert len(names) > 5
    missing = [n for n in names if not (ROOT / "benchmarks" / n).exists()]
    assert not missing, f"benchmarks/README.md lists {missing}, not under benchmarks/"


def test_patterns():
    assert _expand("a.{json,png}") == ["a.json", "a.png"]
    assert _expand("h{b,c}/p*.{x,y}") == ["hb/p*.x", "hb/p*.y", "hc/p*.x", "hc/p*.y"]
    line = "see `git show abc1234:tests/gpu/old.sh` and `tests/gpu/old.sh`, `h200/x/a.log`, `b.jsonl`."
    assert SHA_REF.findall(line) == [("abc1234", "tests/gpu/old.sh")]
    rest = SHA_REF.sub(" ", line)
    assert REPO_PATH.findall(rest) == ["tests/gpu/old.sh"]
    assert RESULT_REL.findall(rest) == ["h200/x/a.log"]
    assert BARE.findall(RESULT_REL.sub(" ", REPO_PATH.sub(" ", rest))) == ["b.jsonl"]
    assert RESULT_REL.findall("`cpu/tp/x.json`, `h200x2/tp/`, benchmarks/results/h200/y.log") == [
        "cpu/tp/x.json",
        "h200x2/tp/",
    ]
    assert (
        _contexts(["## S (`h200/x/`, files at commit abc1234)", "x", "### T", "y", "## U", "z"])
        == [("h200/x", "abc1234")] * 4 + [(None, None)] * 2
    )
    assert _contexts(["# A `benchmarks/results/cpu/main_job/r.md`"]) == [("cpu/main_job", None)]


# What the docs must not say: the project's history is in git, not in its prose.
DIARY = [
    (re.compile(r"\bsessions?\b", re.I), "a word of sessions"),
    (re.compile(r"(?<![-\w])calls? \d"), "a device call by number"),
    (re.compile(r"(?<![\w.])(?:/tmp/|/work/|\.\./)"), "a path outside the repository"),
]
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def test_docs_speak_of_the_project_only():
    """No diary in the docs: no sessions, numbered device calls or paths outside the repository;
    dates only in the results index, as the dates of the kept reference runs."""
    found = []
    for doc in DOCS:
        for n, line in enumerate((ROOT / doc).read_text().splitlines(), 1):
            found += [f"{doc}:{n}: {why}: {line.strip()[:100]}" for rx, why in DIARY if rx.search(line)]
            if doc != RESULTS_INDEX and DATE.search(line):
                found.append(f"{doc}:{n}: a date outside the results index: {line.strip()[:100]}")
    assert not found, "\n".join(found)
    assert DIARY[0][0].search("the twenty-second session") and DIARY[1][0].search("in call 3")
    assert not DIARY[1][0].search("100 calls per sync") and not DIARY[1][0].search("trace_calls --calls 20")
    assert DIARY[2][0].search("see /tmp/x.log") and not DIARY[2][0].search("benchmarks/results/a.log")
