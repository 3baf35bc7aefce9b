"""The committed protobuf stubs are exactly what `make proto` generates."""

from pathlib import Path

from outrider import _protogen


def test_committed_stubs_are_not_stale(tmp_path: Path):
    _protogen.generate(tmp_path)
    generated = sorted((tmp_path / "outrider" / "v1").iterdir())
    assert generated, "protoc generated nothing"
    committed_dir = _protogen.REPO_ROOT / "outrider" / "v1"
    for fresh in generated:
        committed = committed_dir / fresh.name
        assert committed.exists(), f"{committed} is missing: run `make proto`"
        assert committed.read_text() == fresh.read_text(), f"{committed} is stale: run `make proto`"
