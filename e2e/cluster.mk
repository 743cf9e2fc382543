# Local control plane targets; the harness is e2e/cluster.py (see README "Local control plane").
.PHONY: cluster-up cluster-down cluster-status cluster-bin integrations-bin

# Built before pytest runs: a cold build (10-30 min) would exceed a test's timeout.
cluster-bin: venv
	@$(PY) e2e/cluster.py build

# Prometheus and KEDA for `make test-integrations` (cold: see README "Integrations").
integrations-bin: venv
	@$(PY) e2e/cluster.py build --integrations

cluster-up: venv
	@$(PY) e2e/cluster.py up

cluster-down: venv
	@$(PY) e2e/cluster.py down

cluster-status: venv
	@$(PY) e2e/cluster.py status

# The demo: the control plane, its GPU nodes, then SmolLM2 answering a question and the operator
# autoscaling its engines under chat load.
demo: venv
	@$(PY) e2e/cluster.py up
	@$(PY) e2e/cluster.py nodes
	@$(PY) e2e/demo_autoscaling.py
