"""`kvfleet operator` and `kvfleet crds` at the command line."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

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


@pytest.fixture
def no_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No cluster to reach, and none of the variables the operator reads."""
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    monkeypatch.setenv("HOME", str(tmp_path))
    for variable in ("KUBERNETES_SERVICE_HOST", "HF_ENDPOINT", "POD_NAMESPACE", "POD_NAME",
                     "KVFLEET_ENGINE_IMAGE", "KVFLEET_ROUTER_IMAGE"):  # fmt: skip
        monkeypatch.delenv(variable, raising=False)
    return monkeypatch


def refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """`kvfleet operator ARGV`'s message, which must come before it looks for a cluster."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "no Kubernetes cluster" not in err
    return err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # kopf serves only http://, and fails with a traceback once running on anything else
        (["--liveness", "https://0.0.0.0:8080/healthz"], "argument --liveness: http://HOST:PORT"),
        (["--liveness", "0.0.0.0:8080"], "argument --liveness: http://HOST:PORT"),
        (["--liveness", "http://0.0.0.0:99999/healthz"], "argument --liveness: http://HOST:PORT"),
        (["--liveness", "http://0.0.0.0:8080"], "argument --liveness: a path such as /healthz"),
        # an address of no interface here: kopf could not bind it
        (["--liveness", "http://192.0.2.1:8080/healthz"], "--liveness: cannot serve"),
        (["--liveness", "http://127.0.0.1:8081/healthz", "--metrics-port", "8081"],
         "--liveness: port 8081 is --metrics-port too"),
        (["--metrics-port", "-1"], "argument --metrics-port: a port 1..65535, got '-1'"),
        (["--metrics-port", "70000"], "argument --metrics-port: a port 1..65535"),
        # a Lease name the API server refuses: the replica campaigned forever, never leading
        (["--leader-election", "--leader-election-id", "Kvfleet_Operator"],
         "--leader-election-id: a Lease name"),
        # without --leader-election the id was ignored: every replica acted
        (["--leader-election-id", "kvfleet-canary"], "add that flag"),
        # patterns no namespace can match: the operator watched nothing, silently
        (["--namespace", "Team_A"], "--namespace: a namespace or a glob pattern"),
        (["--namespace", ""], "--namespace: a namespace or a glob pattern"),
        (["--hf-endpoint", "hf-mirror.example"], "--hf-endpoint: an http:// or https:// URL"),
    ],
)  # fmt: skip
def test_a_bad_flag_exits_2_naming_it_before_looking_for_a_cluster(
    argv: list[str], message: str, no_cluster: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    assert message in refused(argv, capsys)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"POD_NAMESPACE": "Kvfleet_System", "POD_NAME": "op-0"},
         "$POD_NAMESPACE: the namespace of the Lease (a DNS label), got 'Kvfleet_System'"),
        # the identity fell back to hostname-pid, which replicas with one hostname share
        ({"POD_NAMESPACE": "kvfleet-system"}, "--leader-election: set $POD_NAME"),
    ],
)  # fmt: skip
def test_leader_election_with_a_bad_environment_exits_2_naming_the_variable(
    env: dict[str, str], message: str, no_cluster: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    for name, value in env.items():
        no_cluster.setenv(name, value)
    assert message in refused(["--leader-election"], capsys)


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("HF_ENDPOINT", "hf-mirror.example"),
        # every engine or router pod of an InferenceDeployment naming no image: InvalidImageName
        ("KVFLEET_ENGINE_IMAGE", "registry.example/engine 0.1"),
        ("KVFLEET_ROUTER_IMAGE", " registry.example/router:0.1"),
    ],
)
def test_a_bad_variable_exits_2_naming_it(
    variable: str, value: str, no_cluster: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    no_cluster.setenv(variable, value)
    assert f"${variable}: " in refused([], capsys)


def test_a_liveness_port_in_use_exits_2_naming_the_flag(
    no_cluster: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        err = refused(["--liveness", f"http://127.0.0.1:{port}/healthz"], capsys)
    assert f"--liveness: cannot serve http://127.0.0.1:{port}/healthz" in err


def test_good_flags_and_an_empty_hf_endpoint_reach_kopf_with_the_defaults(
    no_cluster: pytest.MonkeyPatch,
) -> None:
    """$HF_ENDPOINT set empty is unset (the operator read GGUF headers from "/<repo>/...")."""
    import kopf

    import kvfleet_operator.main as operator_main

    async def no_problem() -> None:
        return None

    ran: dict[str, Any] = {}
    no_cluster.setattr(operator_main, "_preflight_with_timeout", no_problem)
    no_cluster.setattr(kopf, "run", lambda **kwargs: ran.update(kwargs))
    no_cluster.setattr(kopf, "configure", lambda **kwargs: None)  # leaves logging alone
    no_cluster.setenv("HF_ENDPOINT", "")
    no_cluster.setenv("POD_NAMESPACE", "kvfleet-system")
    no_cluster.setenv("POD_NAME", "kvfleet-operator-0")
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    argv = ["--liveness", f"http://127.0.0.1:{port}/healthz", "--leader-election",
            "--namespace", "team-*", "--namespace", "team-a,!team-b"]  # fmt: skip
    assert main(argv) == 0
    memo = ran["memo"]
    assert memo.hf_endpoint == "https://huggingface.co"
    assert (memo.leader_namespace, memo.identity, memo.leader_election_id) == (
        "kvfleet-system", "kvfleet-operator-0", "kvfleet-operator"
    )  # fmt: skip
    assert ran["namespaces"] == ["team-*", "team-a,!team-b"]
