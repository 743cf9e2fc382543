"""Names shared by every part of the operator: API group, kinds, labels, field managers."""

from __future__ import annotations

import os

GROUP = "kvfleet.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

INFERENCE_DEPLOYMENT = "InferenceDeployment"
INFERENCE_DEPLOYMENTS = "inferencedeployments"
ACCELERATOR_PROFILE = "AcceleratorProfile"
ACCELERATOR_PROFILES = "acceleratorprofiles"

# Server-side-apply field managers: the reconciler owns everything it renders; the autoscaler
# owns only the child workload's spec.replicas.
FIELD_MANAGER = "kvfleet-operator"
AUTOSCALER_FIELD_MANAGER = "kvfleet-autoscaler"

# The one label every child carries; the Deployment selector and status.selector use it.
DEPLOYMENT_LABEL = f"{GROUP}/deployment"

# Optional CRDs the operator adapts to.
SERVICE_MONITOR_CRD = "servicemonitors.monitoring.coreos.com"
LEADER_WORKER_SET_API = "leaderworkerset.x-k8s.io/v1"
KEDA_SCALED_OBJECT_CRD = "scaledobjects.keda.sh"

ENGINE_PORT = 8000
# The engine image of InferenceDeployments that set no spec.engine.image: $KVFLEET_ENGINE_IMAGE
# of the operator's container (the Helm chart's engine.image), else this release's image.
RELEASE_ENGINE_IMAGE = "ghcr.io/kvfleet/kvfleet-engine:0.1.0"
DEFAULT_ENGINE_IMAGE = os.environ.get("KVFLEET_ENGINE_IMAGE") or RELEASE_ENGINE_IMAGE
# The router image of InferenceDeployments that set no spec.routing.image: $KVFLEET_ROUTER_IMAGE
# of the operator's container (the Helm chart and manifests/operator.yaml set it to the
# operator's own image, which carries `kvfleet router`), else this release's operator image.
RELEASE_ROUTER_IMAGE = "ghcr.io/kvfleet/kvfleet-operator:0.1.0"
DEFAULT_ROUTER_IMAGE = os.environ.get("KVFLEET_ROUTER_IMAGE") or RELEASE_ROUTER_IMAGE
# Where the operator reads the GGUF headers of hf:// files (`--hf-endpoint`, $HF_ENDPOINT).
DEFAULT_HF_ENDPOINT = "https://huggingface.co"
