# Local control plane targets; the harness is e2e/cluster.py (see README "Local control plane").
.PHONY: cluster-status cluster-bin

# Built before pytest runs: a cold build (10-30 min) would exceed a test's timeout.
cluster-bin: venv
	@$(PY) e2e/cluster.py build

cluster-up: venv
	@$(PY) e2e/cluster.py up

cluster-down: venv
	@$(PY) e2e/cluster.py down

cluster-status: venv
	@$(PY) e2e/cluster.py status

# For now the demo is the control plane and its GPU nodes; later issues extend it.
demo: venv
	@$(PY) e2e/cluster.py up
	@$(PY) e2e/cluster.py nodes
	@$(PY) e2e/demo_autoscaling.py
