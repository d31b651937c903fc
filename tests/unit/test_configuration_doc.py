"""docs/configuration.md is the rendering of rl_tpu/config.py's field comments, and the check that says
so can fail: a changed comment, a new field or a field without a comment is caught."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from rl_tpu import config_doc


@dataclass(kw_only=True)
class _Engine:
    """A section for the tests."""

    # how many engines
    # (one Ray actor each)
    count: int = 1
    ratio: float = 0.5  # share of the device
    names: list[str] = field(default_factory=lambda: ["a"])  # engine names


@dataclass(kw_only=True)
class _Root:
    engine: _Engine = field(default_factory=_Engine)


@dataclass(kw_only=True)
class _Undocumented:
    count: int = 1  # documented
    size: int = 2


@dataclass(kw_only=True)
class _RootUndocumented:
    part: _Undocumented = field(default_factory=_Undocumented)


def test_committed_page_is_current() -> None:
    message = config_doc.stale_message()
    assert message is None, message


def test_every_section_and_key_is_on_the_page() -> None:
    page = config_doc.render()
    for name, cls in config_doc.sections(config_doc.Config):
        assert f"\n## {name}\n" in page
        for row in config_doc.rows(cls, name):
            assert row.description and f"| `{row.key}` |" in page


def test_rows_read_comments_above_and_after_fields() -> None:
    page = config_doc.render(_Root, intro="# test\n")
    assert "## engine\n\nA section for the tests.\n" in page
    assert "| `engine.count` | `int` | `1` | how many engines (one Ray actor each) |" in page
    assert "| `engine.ratio` | `float` | `0.5` | share of the device |" in page
    assert '| `engine.names` | `list[str]` | `["a"]` | engine names |' in page


def test_a_changed_comment_changes_the_page(monkeypatch: pytest.MonkeyPatch) -> None:
    before = config_doc.render(_Root, intro="# test\n")
    real = config_doc._field_comments

    def patched(cls: type) -> dict[str, str]:
        found = dict(real(cls))
        if cls is _Engine:
            found["ratio"] = "a new description"
        return found

    monkeypatch.setattr(config_doc, "_field_comments", patched)
    after = config_doc.render(_Root, intro="# test\n")
    assert after != before
    assert "| `engine.ratio` | `float` | `0.5` | a new description |" in after


def test_stale_page_is_reported_with_the_command(tmp_path: Path) -> None:
    page = tmp_path / "configuration.md"
    assert "is missing" in (config_doc.stale_message(page, _Root) or "")
    page.write_text(config_doc.render(_Root))
    assert config_doc.stale_message(page, _Root) is None
    page.write_text(config_doc.render(_Root).replace("share of the device", "old text"))
    message = config_doc.stale_message(page, _Root)
    assert message is not None and config_doc.REGENERATE in message


def test_a_field_without_a_comment_is_named() -> None:
    with pytest.raises(config_doc.MissingDescription, match=r"`part\.size`"):
        config_doc.render(_RootUndocumented)
