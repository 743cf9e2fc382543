"""A real local Kubernetes control plane for kvfleet's end-to-end tests.

etcd, kube-apiserver, kube-controller-manager and kube-scheduler run as plain processes on
127.0.0.1; kwok plays the kubelets of fake GPU nodes. Binaries are built from the Go module
proxy by the consumer modules in e2e/tools/ and cached by version under ~/.cache/kvfleet/bin.

Modules: `config` (versions, ports, paths), `binaries` (build and cache), `pki` (certificates
and kubeconfig), `plan` (pure: command lines and node manifests), `procs` (start, probe, stop
processes), `controlplane` (up / down / status).
"""
