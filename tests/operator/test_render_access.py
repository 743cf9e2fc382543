"""spec.auth and spec.networkPolicy in the rendered children (golden YAML: UPDATE_GOLDEN=1)."""

from __future__ import annotations

from test_render import children

from kvfleet_operator.render import API_KEY_DIGEST_ANNOTATION


def _kinds(objects: list[dict]) -> list[str]:
    return [o["kind"] for o in objects]


def test_network_policy_and_api_key_secret(check_golden, make_spec) -> None:
    spec = make_spec(
        auth={"apiKeySecretRef": {"name": "llama-api-key", "key": "api-key"}},
        networkPolicy={"allowedNamespaces": ["team-a", "gateway", "team-a"]},
    )
    objects = children(spec, api_key_digest="0123456789abcdef0123456789abcdef")
    check_golden("auth-network-policy", objects)
    deployment = objects[0]
    policy = next(o for o in objects if o["kind"] == "NetworkPolicy")
    template = deployment["spec"]["template"]
    assert template["metadata"]["annotations"] == {
        API_KEY_DIGEST_ANNOTATION: "0123456789abcdef0123456789abcdef"
    }
    env = {e["name"]: e for e in template["spec"]["containers"][0]["env"]}
    assert env["KVFLEET_API_KEY"]["valueFrom"] == {
        "secretKeyRef": {"name": "llama-api-key", "key": "api-key"}
    }
    assert policy["kind"] == "NetworkPolicy"
    assert policy["spec"]["podSelector"] == deployment["spec"]["selector"]
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 8000}]
    namespaces = [
        s["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
        for s in rule["from"]
        if "namespaceSelector" in s
    ]
    assert namespaces == ["kvfleet-system", "monitoring", "team-a", "gateway"]
    routers = [s for s in rule["from"] if "namespaceSelector" not in s]
    assert routers == [{"podSelector": {"matchLabels": {"kvfleet.io/router": "llama"}}}]


def _admits(rule: dict, pod_labels: dict[str, str]) -> bool:
    """Whether a pod of the policy's own namespace with `pod_labels` is among the rule's
    sources (a podSelector without a namespaceSelector: the policy's namespace)."""
    return any(
        "namespaceSelector" not in source
        and source["podSelector"]["matchLabels"].items() <= pod_labels.items()
        for source in rule["from"]
    )


def test_only_this_deployments_router_reaches_the_engines(make_spec) -> None:
    """The engine port admits the router pods of this InferenceDeployment, not the router of
    another one in the same namespace (before, any pod labelled as a kvfleet router was let in,
    though the README and the CRD promised "this deployment's router pods")."""
    spec = make_spec()
    objects = children(spec)
    (rule,) = next(o for o in objects if o["kind"] == "NetworkPolicy")["spec"]["ingress"]
    own_router = _router_deployment(objects)["spec"]["template"]["metadata"]["labels"]
    other_router = _router_deployment(children(spec, name="mistral"))
    other_labels = other_router["spec"]["template"]["metadata"]["labels"]
    assert _admits(rule, own_router)
    assert not _admits(rule, other_labels)


def _router_deployment(objects: list[dict]) -> dict:
    return next(
        o for o in objects if o["kind"] == "Deployment" and "router" in o["metadata"]["name"]
    )


def test_the_router_gets_the_key_from_the_same_secret(make_spec) -> None:
    spec = make_spec(auth={"apiKeySecretRef": {"name": "llama-api-key", "key": "api-key"}})
    router = _router_deployment(children(spec, api_key_digest="c" * 32))
    template = router["spec"]["template"]
    assert template["metadata"]["annotations"] == {API_KEY_DIGEST_ANNOTATION: "c" * 32}
    env = {e["name"]: e for e in template["spec"]["containers"][0]["env"]}
    assert env["KVFLEET_API_KEY"]["valueFrom"] == {
        "secretKeyRef": {"name": "llama-api-key", "key": "api-key"}
    }
    assert "api-key" not in " ".join(template["spec"]["containers"][0]["args"])


def test_a_rotated_key_rolls_the_engine_and_router_pods_and_nothing_else(make_spec) -> None:
    spec = make_spec(auth={"apiKeySecretRef": {"name": "k", "key": "v"}})
    before = children(spec, api_key_digest="a" * 32)
    after = children(spec, api_key_digest="b" * 32)
    changed = [
        f"{b['kind']}/{b['metadata']['name']}" for b, a in zip(before, after, strict=True) if b != a
    ]
    assert changed == ["Deployment/llama", "Deployment/llama-router"]
    for b, a in zip(before, after, strict=True):
        if b != a:  # only the pod template's annotation moved
            assert {**b["spec"], "template": None} == {**a["spec"], "template": None}


def test_network_policy_off_and_no_auth(make_spec) -> None:
    objects = children(make_spec(networkPolicy={"enabled": False}))
    assert "NetworkPolicy" not in _kinds(objects)
    template = objects[0]["spec"]["template"]
    assert "annotations" not in template["metadata"]
    env = [e["name"] for e in template["spec"]["containers"][0]["env"]]
    assert "KVFLEET_API_KEY" not in env
    router = _router_deployment(objects)["spec"]["template"]
    assert "annotations" not in router["metadata"]
    assert "KVFLEET_API_KEY" not in [e["name"] for e in router["spec"]["containers"][0]["env"]]
    assert "NetworkPolicy" in _kinds(children(make_spec()))  # on by default
