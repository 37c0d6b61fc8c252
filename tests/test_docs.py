"""The documentation site builds with ``mkdocs build --strict`` (no broken link, missing anchor or
unresolvable API identifier), and README.md stays a short front page whose links into docs/
exist."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAX_README_LINES = 200

# [text](target) links of Markdown, outside code spans; the target up to a space or ")".
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def markdown_links(text: str) -> list[str]:
    """The link targets of a Markdown text, code blocks and code spans left out."""
    prose, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            prose.append(re.sub(r"`[^`]*`", "", line))
    return LINK.findall("\n".join(prose))


def test_the_site_builds_strictly(tmp_path):
    import material  # noqa: F401  (the docs extra: a missing package fails, never skips)
    import mkdocs  # noqa: F401
    import mkdocstrings_handlers.python  # noqa: F401
    site = tmp_path / "site"
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                           str(ROOT / "mkdocs.yml"), "--site-dir", str(site)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    warnings = [line for line in done.stderr.splitlines() if line.startswith("WARNING")]
    assert not warnings, "\n".join(warnings)
    # Every page of docs/ was built, and the API reference was generated from the docstrings.
    for page in DOCS.rglob("*.md"):
        assert (site / page.relative_to(DOCS).with_suffix(".html")).is_file(), page
    api = (site / "api" / "model.html").read_text()
    assert 'id="transformer_jax.model.transformer.Transformer"' in api
    assert 'id="transformer_jax.decode.generation.generate"' in (
        site / "api" / "decode.html").read_text()


def test_the_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines"


def test_the_readme_links_into_the_docs_exist():
    links = [link for link in markdown_links(README.read_text()) if "://" not in link]
    docs_links = [link for link in links if link.split("#")[0].startswith("docs/")]
    assert len(docs_links) >= 10, docs_links
    for link in links:
        target = link.split("#")[0]
        assert target and (ROOT / target).exists(), f"README.md links to a missing {link}"


def test_the_quick_start_has_the_two_commands():
    """``.ci/run`` runs the first ``-m pytest`` line of README.md's Quick start verbatim."""
    text = README.read_text()
    quick_start = text[text.index("## Quick start"):]
    quick_start = quick_start[:quick_start.index("\n## ", 1)]
    commands = [line for line in quick_start.splitlines() if line.startswith("python3 -m venv")]
    assert len(commands) == 2, commands
    train, tests = commands
    assert train.endswith(".venv/bin/transformer-jax train")
    assert "-m pytest" in tests and "docs" in tests.split("'")[1].strip(".[]").split(",")
