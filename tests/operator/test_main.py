"""`kvfleet operator` and `kvfleet crds` at the command line."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfleet_operator.main import main


def test_operator_without_a_cluster_exits_2_with_a_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert main([]) == 2
    err = capsys.readouterr().err
    assert "kvfleet operator: no Kubernetes cluster configured" in err
    assert "Traceback" not in err


def test_operator_rejects_unknown_flags() -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--bogus"])
    assert exit_.value.code == 2


@pytest.mark.parametrize("prefix", ["var/models", "/", "/var/../etc"])
def test_a_host_path_prefix_must_be_an_absolute_directory(
    prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--host-path-prefix", prefix])
    assert exit_.value.code == 2
    assert "--host-path-prefix: an absolute directory other than /" in capsys.readouterr().err
