"""Checkpoint formats: where a model's config, tokenizer and tensors come from.

- `safetensors`: a Hugging Face directory (config.json, *.safetensors, tokenizer files).
- `gguf_metadata`, `gguf_tensors`, `gguf_tokenizer`: one llama.cpp GGUF file, which carries the
  config, the tokenizer and the chat template in its metadata, and quantized tensors.

Every format yields `(name, tensor)` pairs under the Hugging Face tensor names, so the model
code and `models.loader` see one layout whatever the file was.
"""
