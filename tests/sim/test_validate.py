"""The validation's comparison side: rows of predicted against measured, drawn."""

from __future__ import annotations

from pathlib import Path

import matplotlib.image
import pytest

from interlace.errors import UsageError
from interlace.sim.validate import ValidationRow, plot_validation


def test_the_validation_plot_draws_every_row(tmp_path: Path) -> None:
    def row(strategy: str, ranks: int, predicted: float, measured: float) -> ValidationRow:
        error = (predicted - measured) / measured
        return ValidationRow(
            model="mlp",
            strategy=strategy,
            ranks=ranks,
            link="1gbit",
            predicted_s=predicted,
            measured_s=measured,
            error=error,
            predicted_uncontended_s=predicted,
            compute_slowdown=1.0,
            compute_drift=1.0,
            stream_a=0.001,
            stream_b=1e-8,
            predicted_buckets=1,
            measured_buckets=1,
            comm_compute=0.5,
            cost_a=0.0001,
            cost_b=1e-8,
        )

    rows = [row("wfbp", 2, 0.05, 0.06), row("single", 4, 0.2, 0.19), row("mgwfbp", 2, 0.03, 0.03)]
    path = plot_validation(rows, tmp_path / "out" / "validation.png")
    assert path.read_bytes()[:4] == b"\x89PNG"
    height, width = matplotlib.image.imread(path).shape[:2]
    assert width > 400 and height > 400
    with pytest.raises(UsageError, match="no validation rows"):
        plot_validation([], tmp_path / "empty.png")
