# Local control plane targets; the harness is e2e/cluster.py.
cluster-up: venv
	@$(PY) e2e/cluster.py up

cluster-down: venv
	@$(PY) e2e/cluster.py down
