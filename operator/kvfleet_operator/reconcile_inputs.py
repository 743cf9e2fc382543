"""What a reconcile pass reads besides the InferenceDeployment: the model's architecture (from a
GGUF header when it has to), the digest of the API key the pods carry, the AcceleratorProfiles."""

from __future__ import annotations

import logging

from pydantic import ValidationError

from kvfleet_operator import api
from kvfleet_operator.apply import Cluster
from kvfleet_operator.header_cache import HeaderCache
from kvfleet_operator.model_catalog import (
    ModelArchitecture,
    UnknownModel,
    model_architecture,
    reads_gguf_header,
)
from kvfleet_operator.models import AcceleratorProfileSpec, InferenceDeploymentSpec, ModelSpec

log = logging.getLogger(__name__)


async def read_model_architecture(
    cluster: Cluster, headers: HeaderCache, namespace: str, model: ModelSpec
) -> ModelArchitecture | UnknownModel:
    """The model's numbers; for an hf:// GGUF file without hints, from its header (read once per
    uri, revision and credentials, with the HF_TOKEN of model.credentialsSecret when the
    operator may read it, else without one)."""
    if not reads_gguf_header(model):
        return model_architecture(model)
    secret = model.credentials_secret

    async def token() -> str | None:
        if secret is None:
            return None
        return await cluster.secret_value(namespace, secret.name, "HF_TOKEN")

    credentials = None if secret is None else f"{namespace}/{secret.name}"
    return model_architecture(model, await headers.summary(model, token, credentials=credentials))


async def read_api_key_digest(
    cluster: Cluster, namespace: str, spec: InferenceDeploymentSpec
) -> str | None:
    """The digest of spec.auth's Secret key that the pod template carries (rotating the Secret
    rolls the pods); None without spec.auth or when the Secret cannot be read."""
    ref = spec.auth.api_key_secret_ref
    if ref is None:
        return None
    return await cluster.secret_digest(namespace, ref.name, ref.key)


async def read_accelerator_profiles(
    cluster: Cluster,
) -> tuple[dict[str, AcceleratorProfileSpec], dict[str, str]]:
    """AcceleratorProfile objects by name, and why each invalid one (stored before the CRD's
    rules refused it) is left out, by name."""
    profiles, invalid = {}, {}
    for item in await cluster.list(api.API_VERSION, api.ACCELERATOR_PROFILE):
        name = item["metadata"]["name"]
        try:
            profiles[name] = AcceleratorProfileSpec.model_validate(item.get("spec", {}))
        except ValidationError as exc:
            log.warning("ignoring AcceleratorProfile %s: %s", name, exc)
            invalid[name] = "; ".join(
                f"{'.'.join(map(str, error['loc']))}: {error['msg']}" for error in exc.errors()
            )
    return profiles, invalid
