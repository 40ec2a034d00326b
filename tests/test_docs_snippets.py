"""Every code block of README.md and docs/ runs as written (tests/docs_snippets.py says how): a page's
blocks in order, against nsqlookupd, a broker and trio-nsqadmin started for the page on free ports. The
Spark blocks run under the spark_log marker (`make test-spark`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.docs_snippets import CLUSTER_PORTS, ROOT, Session, pages, programs, snippets

# The blocks kept out, by page and first line, with why: each is run another way or cannot run here.
NOT_RUN = {
    ("README.md", "make run    # creates .venv, installs, starts nsqlookupd (4160/4161), nsqd (4150/4151, data in ./data)"):
        "the getting-started page runs the same `make run` as a daemon, and `make test` is the suite itself",
    ("docs/getting-started.md", "make test          # creates .venv if needed, installs, runs the whole suite but the two below"):
        "the suite these tests are part of: .ci/run runs it, and `make docs`",
    ("docs/spark/index.md", "pip install '.[spark]'      # from a clone: pyspark and pyarrow; Java 17 on PATH"):
        "it would install into the venv the tests run in; `make test` installs the same extra",
}


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def _run_page(page: Path, tmp_path: Path, *, spark: bool) -> int:
    chosen = [(s, text) for s, text in programs(snippets(page)) if (s.kind == "spark") == spark]
    if not chosen:
        return 0
    session = Session(tmp_path)
    try:
        if not any(s.kind == "daemon" and any(str(port) in text for port in CLUSTER_PORTS) for s, text in chosen):
            session.start_cluster()  # (unless the page starts processes on those ports itself)
        for snippet, text in chosen:
            session.run(snippet, text)
    finally:
        session.close()
    return len(chosen)


@pytest.mark.parametrize("page", pages(), ids=_name)
def test_every_block_says_its_language_and_every_directive_is_known(page: Path):
    snippets(page)  # raises ValueError, naming the line


def test_only_the_listed_blocks_are_kept_out():
    kept_out = {(_name(page), s.text.splitlines()[0]): s.reason for page in pages() for s in snippets(page)
                if s.kind == "not-run"}
    assert set(kept_out) == set(NOT_RUN)


@pytest.mark.parametrize("page", pages(), ids=_name)
def test_the_pages_blocks_run_as_written(page: Path, tmp_path: Path):
    _run_page(page, tmp_path, spark=False)


def _with_spark_blocks(page: Path) -> bool:
    try:
        return any(s.kind == "spark" for s in snippets(page))
    except ValueError:
        return False  # the page's fault is reported by the test of directives, not at collection


@pytest.mark.spark_log
@pytest.mark.parametrize("page", [p for p in pages() if _with_spark_blocks(p)], ids=_name)
def test_the_pages_spark_blocks_run_as_written(page: Path, tmp_path: Path):
    assert _run_page(page, tmp_path, spark=True) > 0


@pytest.mark.parametrize("page", [ROOT / "README.md", ROOT / "trio_nsq" / "spark" / "README.md"], ids=_name)
def test_the_readmes_links_name_files_that_exist(page: Path):
    """The READMEs are read on a code host, outside the site (whose links `make docs` checks)."""
    import re
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8"))
    local = [t for t in targets if "://" not in t]
    assert local, "no link into the docs"
    missing = [t for t in local if not (page.parent / t).exists()]
    assert missing == []
