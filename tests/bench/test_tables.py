"""What a benchmark's report is made of: cells, markdown tables and the rows' JSON."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from interlace.bench.tables import Row, markdown_table, ms, number, speedup, write_json


def test_cells_read_dash_where_there_is_no_value() -> None:
    assert (ms(0.2), ms(0.0123, 2), ms(None)) == ("200.0", "12.30", "-")
    assert (number(0.254), number(256.0, 1), number(None)) == ("0.25", "256.0", "-")
    assert (speedup(1.8181), speedup(None)) == ("1.82x", "-")


def test_a_markdown_table_aligns_each_column() -> None:
    table = markdown_table(("model", "ms"), "lr", [("mlp", "1.0"), ("vgg11", "2.0")])
    lines = ["| model | ms |", "|---|---:|", "| mlp | 1.0 |", "| vgg11 | 2.0 |"]
    assert table.splitlines() == lines


@dataclass(frozen=True)
class _Row(Row):
    model: str
    phases_s: dict[str, float] = field(default_factory=dict)


def test_rows_are_written_as_a_json_list(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "deep" / "rows.json"
    write_json(path, [_Row("mlp", {"step": 0.5}).to_dict()])
    assert json.loads(path.read_text()) == [{"model": "mlp", "phases_s": {"step": 0.5}}]
    assert f"rows written to {path}" in capsys.readouterr().out
