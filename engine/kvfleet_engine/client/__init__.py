"""The API process's side of the engine core: the process client and the output processor."""
