"""The model runner's parts, each rank's own: the batch tensors of a step (`inputs`), the
sampling settings of its rows (`sampling_inputs`), the KV cache tensors and their size
(`kv_memory`), and the model with its forward pass and decode graphs (`executor`). The driver's
`ModelRunner` (model_runner.py) puts them together with the sampler."""
