"""Tensor parallelism from outside the single-device model (`tensor`, `layers`), the process
groups it runs over (`groups`: gloo on the CPU, NCCL on GPUs), and the ranks' processes: the
driver's worker group (`workers`), each worker's loop (`worker`), the step records they share
(`messages`, `step_diff`) and the compute-only hosts of a multi-node replica (`node`)."""
