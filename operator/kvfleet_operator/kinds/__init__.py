"""The sections of the kvfleet.io/v1alpha1 kinds' specs and status, one module each;
kvfleet_operator.models assembles InferenceDeploymentSpec from them and re-exports every name."""
