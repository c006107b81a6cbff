"""docs/RESULTS.md is made one way, by benchmarks/report.py: regenerating it with no benchmark
output at hand changes nothing (every hand-written line is in its findings, from
`# Findings behind the design` to the end, kept as they stand), and a benchmark's output
rebuilds its own section and nothing else."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def report(tmp_path, monkeypatch):
    from benchmarks import report as mod

    monkeypatch.setattr(mod, "RESULTS", tmp_path / "results")  # no benchmark has run here
    return mod


def test_regenerating_results_changes_nothing(report):
    old = (ROOT / "docs" / "RESULTS.md").read_text()
    text, rebuilt = report.build(old)
    assert rebuilt == ["## Figures"]  # drawn from the tracked figures, always
    assert text == old, "docs/RESULTS.md differs from what benchmarks/report.py makes: " \
        f"hand-written lines belong below '{report.FINDINGS_HEADING}'"


def test_a_benchmarks_output_rebuilds_its_section_only(report, monkeypatch):
    old = (ROOT / "docs" / "RESULTS.md").read_text()
    heading = "## Structured output (`benchmarks/structured.py`)"
    sections = tuple((h, (lambda: "a fresh table") if h == heading else make)
                     for h, make in report.SECTIONS)
    monkeypatch.setattr(report, "SECTIONS", sections)
    text, rebuilt = report.build(old)
    assert heading in rebuilt
    before, after = report.written_sections(old), report.written_sections(text)
    assert list(before) == list(after)
    assert after[heading] == f"{heading}\na fresh table\n"
    assert {h: b for h, b in after.items() if h != heading} == \
        {h: b for h, b in before.items() if h != heading}
    findings = report.FINDINGS_HEADING
    assert text[text.index("\n" + findings):] == old[old.index("\n" + findings):]


def test_the_findings_are_kept_as_written(report):
    """The findings are written in RESULTS.md itself, their one source: an edit there stays."""
    old = (ROOT / "docs" / "RESULTS.md").read_text()
    edited = old + "\nA finding written since.\n"
    text, _ = report.build(edited)
    assert text == edited
    assert not (ROOT / "benchmarks" / "findings.md").exists()
