"""MkDocs hook (mkdocs.yml): a page's link to the repository's README, outside the docs, goes
to the site's home page instead, which says what the README says."""

from __future__ import annotations

import re

README = re.compile(r"\]\((?:\.\./)+README\.md(#[^)]*)?\)")


def on_page_markdown(markdown: str, page, config, files) -> str:
    depth = page.file.src_uri.count("/")
    return README.sub(lambda m: f"]({'../' * depth}index.md)", markdown)
